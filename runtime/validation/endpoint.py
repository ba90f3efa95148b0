"""A client for an OpenAI-compatible `/v1/completions` server (sglang, vllm-ascend), standard library only:
greedy completions of many prompts in parallel, with retries, and the wall latency of the batch."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

from npuport.errors import EndpointError


def completions_url(base_url: str) -> str:
    """The completions URL of a server given as `http://host:port`, `.../v1` or `.../v1/completions`."""
    url = base_url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise EndpointError(f"{base_url!r} is not an http(s) URL")
    if url.endswith("/v1/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/completions"
    return url + "/v1/completions"


@dataclass(frozen=True)
class EndpointCompletion:
    """One prompt's answer: the text and `usage.completion_tokens` (None when the server did not say)."""

    text: str
    completion_tokens: int | None
    finish_reason: str | None = None


@dataclass(frozen=True)
class EndpointBatch:
    """All answers, in prompt order, and the wall seconds from the first request sent to the last answer."""

    completions: list[EndpointCompletion]
    latency_s: float

    @property
    def texts(self) -> list[str]:
        return [c.text for c in self.completions]

    @property
    def completion_tokens(self) -> int | None:
        """Total completion tokens, or None if any answer lacked a count."""
        counts = [c.completion_tokens for c in self.completions]
        return None if any(c is None for c in counts) else sum(counts)


class _Transient(Exception):
    """A failure worth another attempt: no connection, a timeout, HTTP 429 or 5xx."""


class CompletionsEndpoint:
    """Greedy completions from `<url>/v1/completions`.

    Each request sends `model`, `prompt`, `max_tokens`, `temperature` 0 and `stop`. A request is tried
    1 + `retries` times when the connection fails, the server does not answer within `timeout_s` (applied
    to the connect and to every read, as urllib does), or it answers HTTP 429 or 5xx; before retry i
    (1, 2, ...) it waits `backoff_s * 2**(i-1)` seconds (defaults: 4 attempts, waits 1, 2, 4 s). Any other
    HTTP status, a body that is not JSON, or one without `choices[0].text` fails at once. Every failure is
    an EndpointError naming the URL. Proxy variables of the environment apply as urllib applies them."""

    def __init__(self, url: str, model: str, *, parallel: int = 16, timeout_s: float = 600.0, retries: int = 3,
                 backoff_s: float = 1.0, api_key: str | None = None):
        if parallel < 1 or retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError("need parallel >= 1, retries >= 0, timeout_s > 0, backoff_s >= 0")
        self.url = completions_url(url)
        self.model = model
        self.parallel = parallel
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def complete(self, prompts: Sequence[str], *, max_tokens: int, stop: Sequence[str] = (),
                 progress: Callable[[int], None] | None = None) -> EndpointBatch:
        """Complete every prompt, `parallel` requests at a time; `progress(done)` after each answer.
        The first prompt that fails for good raises its EndpointError; requests not yet sent are dropped."""
        results: list[EndpointCompletion | None] = [None] * len(prompts)
        start = time.perf_counter()
        pool = ThreadPoolExecutor(max_workers=max(1, min(self.parallel, len(prompts))))
        try:
            futures = {pool.submit(self.complete_one, p, max_tokens=max_tokens, stop=stop): i
                       for i, p in enumerate(prompts)}
            for done, future in enumerate(as_completed(futures), start=1):
                results[futures[future]] = future.result()
                if progress is not None:
                    progress(done)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        latency = time.perf_counter() - start
        return EndpointBatch([r for r in results if r is not None], latency)

    def complete_one(self, prompt: str, *, max_tokens: int, stop: Sequence[str] = ()) -> EndpointCompletion:
        """One greedy completion, with the retries described on the class."""
        payload = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                              "temperature": 0, "stop": list(stop)}).encode("utf-8")
        attempts = self.retries + 1
        failure = ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                body = self._post(payload)
            except _Transient as e:
                failure = str(e)
                continue
            return self._parse(body)
        raise EndpointError(f"{self.url}: gave up after {attempts} attempt(s), the last: {failure}")

    def _post(self, payload: bytes) -> bytes:
        request = urllib.request.Request(self.url, data=payload, headers=self._headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as e:
            detail = _snippet(e.read() if e.fp is not None else b"")
            if e.code == 429 or e.code >= 500:
                raise _Transient(f"HTTP {e.code} {detail}") from e
            raise EndpointError(f"{self.url} answered HTTP {e.code}: {detail}") from e
        except TimeoutError as e:
            raise _Transient(f"no answer within {self.timeout_s:g} s") from e
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise _Transient(f"no answer within {self.timeout_s:g} s") from e
            raise _Transient(f"unreachable ({e.reason})") from e
        except (http.client.HTTPException, OSError) as e:  # reset, refused mid-way, bad status line
            raise _Transient(f"connection failed ({type(e).__name__}: {e})") from e

    def _parse(self, body: bytes) -> EndpointCompletion:
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise EndpointError(f"{self.url} answered malformed JSON: {_snippet(body)}") from e
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise EndpointError(f"{self.url} answered without choices: {_snippet(body)}")
        text = choices[0].get("text")
        if not isinstance(text, str):
            raise EndpointError(f"{self.url} answered a choice without text: {_snippet(body)}")
        usage = data.get("usage")
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        return EndpointCompletion(text, tokens if isinstance(tokens, int) else None, choices[0].get("finish_reason"))


def _snippet(body: bytes, limit: int = 200) -> str:
    text = body.decode("utf-8", errors="replace").strip()
    return repr(text if len(text) <= limit else text[:limit] + "...")
