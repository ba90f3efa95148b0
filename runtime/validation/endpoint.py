"""A client for an OpenAI-compatible `/v1/completions` server (sglang, vllm-ascend), standard library only:
greedy completions of many prompts in parallel, each question's answer or error as it arrives, retries that
honour Retry-After, a wall-clock deadline and a size cap per answer, and a run that stops for good when the server
is lost."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, as_completed, wait

from npuport.errors import EndpointError
from npuport.runtime.completion import Completion, CompletionBatch
from npuport.runtime.validation.endpoint_http import (
    CuttableHTTPHandler,
    CuttableHTTPSHandler,
    Exchange,
    NoRedirect,
    OverCap,
    error_body_start,
    is_unreachable,
    read_capped,
    retry_after_seconds,
    snippet,
    status_text,
)

DEFAULT_MAX_RETRY_AFTER_S = 60.0  # a server asking for longer is waited on this long, then tried again
DEFAULT_FAILURES_TO_GIVE_UP = 8  # questions failed in a row (after their retries) that end the run
# The bytes an answer is read for are capped by what its request can need, so that a server answering without end
# fills neither memory nor the answers files: a floor for the envelope (ids, usage, a server's extra fields), then
# per token room for its text JSON-escaped (\uXXXX: up to 6 bytes a byte) in each place an answer lists it.
ANSWER_BYTES_FLOOR = 1 << 20
ANSWER_BYTES_PER_TOKEN = 1 << 10
OPENAI_DEFAULT_MAX_TOKENS = 16  # what the API generates when a request does not say
MODEL_LIST_BYTES = 1 << 20  # a /v1/models answer: names of a few models
_DEADLINE = "deadline"
_GIVEN_UP = "given up"


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


def served_models(base_url: str, timeout_s: float = 30.0, api_key: str | None = None) -> list[str]:
    """The model names a server lists at `/v1/models` (the OpenAI API's `data[].id`). EndpointError naming the URL
    if it cannot say."""
    url = completions_url(base_url).removesuffix("/completions") + "/models"
    headers = {"Accept": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    opener = urllib.request.build_opener(NoRedirect())
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=timeout_s) as response:
            data = json.loads(read_capped(response, MODEL_LIST_BYTES))
        return [m["id"] for m in data["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)]
    except urllib.error.HTTPError as e:
        raise EndpointError(f"{url}: answered {status_text(e)}") from None
    except OverCap:
        raise EndpointError(f"{url}: answered more than {MODEL_LIST_BYTES} bytes for a model list") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise EndpointError(f"{url}: unreachable ({getattr(e, 'reason', e)})") from None
    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: JSON nested past the parser's depth
        raise EndpointError(f"{url}: answered no model list") from None


class QuestionFailed(EndpointError):
    """One prompt got no usable answer. The message starts with the URL; `reason` is the rest, and
    `unreachable` says no connection could be made at all (refused, unknown host, no route)."""

    def __init__(self, url: str, reason: str, *, unreachable: bool = False):
        super().__init__(f"{url}: {reason}")
        self.reason = reason
        self.unreachable = unreachable


class EndpointGivenUp(EndpointError):
    """The run stopped: the server is unreachable or too many questions failed in a row. `answered` holds
    every question that ended before (index -> its answer or failure); nothing was sent after."""

    def __init__(self, message: str, answered: dict[int, Completion]):
        super().__init__(message)
        self.answered = answered


class _Transient(Exception):
    """A failure worth another attempt: no connection, the deadline passed, HTTP 429 or 5xx."""

    def __init__(self, message: str, *, unreachable: bool = False, retry_after: float | None = None):
        super().__init__(message)
        self.unreachable = unreachable
        self.retry_after = retry_after


class _Cancelled(Exception):
    """The run was given up before this request ended; the question stays unanswered, not failed."""


def answer_byte_limit(fields: Mapping) -> int:
    """The most bytes an answer to a completions request of `fields` is read for: ANSWER_BYTES_FLOOR, and
    ANSWER_BYTES_PER_TOKEN for each token it may hold (`max_tokens`, with `echo` also the prompt's: a text
    prompt's characters, at least its tokens) in each place it may list it (the text, `logprobs.tokens`, each
    of the top `logprobs`), for each of its `n` choices."""
    def count(name: str, default: int) -> int:
        value = fields.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default

    tokens = count("max_tokens", OPENAI_DEFAULT_MAX_TOKENS)
    if fields.get("echo") and isinstance(fields.get("prompt"), (str, list)):
        tokens += len(fields["prompt"])
    return ANSWER_BYTES_FLOOR + ANSWER_BYTES_PER_TOKEN * tokens * (2 + count("logprobs", 0)) * max(count("n", 1), 1)


class _Run:
    """The requests of one `complete` call and when to give the endpoint up. Each question that ends is
    counted at once, in the worker thread, so the decision does not wait for the caller's thread; `stop()`
    cuts every exchange in flight and refuses new ones (retry waits on `stopped` end at once too), so that
    nothing is sent once the endpoint is given up."""

    def __init__(self, failures_to_give_up: int) -> None:
        self._lock = threading.Lock()
        self._open: set[Exchange] = set()
        self._limit = failures_to_give_up
        self._streak = 0
        self.stopped = threading.Event()
        self.given_up: str | None = None  # why, once given up

    def enter(self, exchange: Exchange) -> None:
        with self._lock:
            if self.stopped.is_set():
                raise _Cancelled
            self._open.add(exchange)

    def leave(self, exchange: Exchange) -> None:
        with self._lock:
            self._open.discard(exchange)

    def ended(self, failure: QuestionFailed | None) -> None:
        """Count a question that ended (failure None: answered); give up when the server is unreachable or
        the last `failures_to_give_up` questions all failed."""
        with self._lock:
            if self.stopped.is_set():
                return
            self._streak = 0 if failure is None else self._streak + 1
            if failure is not None and failure.unreachable:
                self.given_up = failure.reason
            elif self._streak >= self._limit:
                self.given_up = f"{self._streak} question(s) in a row failed, the last: {failure.reason}"
        if self.given_up is not None:
            self.stop()

    def stop(self) -> None:
        with self._lock:
            self.stopped.set()
            in_flight = list(self._open)
        for exchange in in_flight:
            exchange.cut(_GIVEN_UP)


class CompletionsEndpoint:
    """Greedy completions from `<url>/v1/completions`.

    Each request sends `model`, `prompt`, `max_tokens`, `temperature` 0 and `stop`. A request has
    `timeout_s` of wall-clock time from connect to the last byte of the answer; past it the connection is
    closed. A request is tried 1 + `retries` times when the connection fails, the deadline passes, or the
    server answers HTTP 429 or 5xx; before retry i (1, 2, ...) it waits what a 429/503 `Retry-After` header
    asks (at most `max_retry_after_s`), else `backoff_s * 2**(i-1)` seconds (defaults: 4 attempts, waits
    1, 2, 4 s). Any other HTTP status, a body that is not JSON (or that Python's parser refuses: nested too
    deep, an integer too long), one without `choices[0].text`, or one longer than `answer_byte_limit` (read no
    further than that) fails the question at once. Errors are one line naming the URL. Proxy variables of the
    environment apply as urllib applies them."""

    def __init__(self, url: str, model: str, *, parallel: int = 16, timeout_s: float = 600.0, retries: int = 3,
                 backoff_s: float = 1.0, api_key: str | None = None,
                 max_retry_after_s: float = DEFAULT_MAX_RETRY_AFTER_S,
                 failures_to_give_up: int = DEFAULT_FAILURES_TO_GIVE_UP):
        if (parallel < 1 or retries < 0 or timeout_s <= 0 or backoff_s < 0 or max_retry_after_s < 0
                or failures_to_give_up < 1):
            raise ValueError("need parallel >= 1, retries >= 0, timeout_s > 0, backoff_s >= 0, "
                             "max_retry_after_s >= 0, failures_to_give_up >= 1")
        self.url = completions_url(url)
        self.model = model
        self.parallel = parallel
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_retry_after_s = max_retry_after_s
        self.failures_to_give_up = failures_to_give_up
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def complete(self, prompts: Sequence[str], *, max_tokens: int, stop: Sequence[str] = (),
                 progress: Callable[[int], None] | None = None,
                 on_answer: Callable[[int, Completion], None] | None = None) -> CompletionBatch:
        """Complete every prompt, `parallel` requests at a time. A question that fails for good (after its
        retries) is recorded as failed and the run goes on; `on_answer(index, completion)` and then
        `progress(done)` are called as each question ends, in the calling thread.

        The endpoint is given up when it is unreachable, or when the last `failures_to_give_up` questions
        to end (every question, in a shorter run) all failed: requests in flight are then cut, no request
        is sent any more, and EndpointGivenUp is raised with what had ended."""
        answered: dict[int, Completion] = {}

        def deliver(index: int, future: Future) -> None:
            try:
                answer = future.result()
            except (_Cancelled, CancelledError):
                return
            except QuestionFailed as e:
                answer = Completion.failed(e.reason)
            answered[index] = answer
            if on_answer is not None:
                on_answer(index, answer)
            if progress is not None:
                progress(len(answered))

        run = _Run(min(self.failures_to_give_up, len(prompts)))
        start = time.perf_counter()
        pool = ThreadPoolExecutor(max_workers=max(1, min(self.parallel, len(prompts))))
        try:
            futures = {pool.submit(self._counted, p, max_tokens, stop, run): i for i, p in enumerate(prompts)}
            for future in as_completed(futures):
                deliver(futures[future], future)
                if run.stopped.is_set():
                    break
            if run.given_up is not None:  # keep what ended before the give-up and was not delivered yet
                for future in futures:
                    future.cancel()  # not started: never sent
                # The rest end at once (their exchanges cut, their retry waits over), the question whose failure
                # gave the endpoint up among them: it is counted in its worker before its future completes.
                wait(futures, timeout=self.timeout_s)
                for future, index in futures.items():
                    if index not in answered and future.done():
                        deliver(index, future)
        finally:
            run.stop()  # whatever ends the loop (done, given up, an exception): nothing is sent after this
            pool.shutdown(wait=False, cancel_futures=True)
        if run.given_up is not None:
            failed = sum(a.error is not None for a in answered.values())
            raise EndpointGivenUp(
                f"{self.url}: stopped sending requests ({run.given_up}); {len(answered) - failed} of "
                f"{len(prompts)} question(s) answered, {failed} failed, the rest not sent or cut", answered)
        return CompletionBatch([answered[i] for i in range(len(prompts))], time.perf_counter() - start)

    def complete_one(self, prompt: str, *, max_tokens: int, stop: Sequence[str] = ()) -> Completion:
        """One greedy completion, with the retries described on the class; QuestionFailed if it fails."""
        return self._complete(prompt, max_tokens, stop, None)

    # -----------------------------------------------------------------------------------------------------

    def _counted(self, prompt: str, max_tokens: int, stop: Sequence[str], run: _Run) -> Completion:
        """`_complete`, and the run told that the question ended."""
        try:
            answer = self._complete(prompt, max_tokens, stop, run)
        except QuestionFailed as e:
            run.ended(e)
            raise
        run.ended(None)
        return answer

    def _complete(self, prompt: str, max_tokens: int, stop: Sequence[str], run: _Run | None) -> Completion:
        return self._parse(self._request({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                          "stop": list(stop)}, run))

    def request(self, fields: dict) -> dict:
        """One completions request of `fields` (the model's name added), with the retries described on the
        class; its answer as JSON, checked to hold `choices`. QuestionFailed if it fails."""
        return self._choices(self._request(fields, None))

    def _request(self, fields: dict, run: _Run | None) -> bytes:
        payload = json.dumps({"model": self.model, **fields}).encode("utf-8")
        limit = answer_byte_limit(fields)
        attempts = self.retries + 1
        failure = _Transient("not tried")
        for attempt in range(attempts):
            if attempt:
                wait = (failure.retry_after if failure.retry_after is not None
                        else self.backoff_s * 2 ** (attempt - 1))
                if run is None:
                    time.sleep(wait)
                elif run.stopped.wait(wait):
                    raise _Cancelled
            try:
                return self._exchange(payload, limit, run)
            except _Transient as e:
                failure = e
        raise QuestionFailed(self.url, f"gave up after {attempts} attempt(s), the last: {failure}",
                             unreachable=failure.unreachable)

    def _exchange(self, payload: bytes, limit: int, run: _Run | None) -> bytes:
        """POST the payload and read the whole answer, at most `limit` bytes, within the deadline; the body of
        a 2xx answer."""
        exchange = Exchange()
        if run is not None:
            run.enter(exchange)
        deadline = threading.Timer(self.timeout_s, exchange.cut, args=(_DEADLINE,))
        deadline.daemon = True
        deadline.start()
        try:
            try:
                body = self._post(payload, limit, exchange)
            except (_Transient, QuestionFailed):
                self._raise_if_cut(exchange)
                raise
            self._raise_if_cut(exchange)  # a cut read can look complete when the server sent no length
            return body
        finally:
            deadline.cancel()
            if run is not None:
                run.leave(exchange)

    def _raise_if_cut(self, exchange: Exchange) -> None:
        if exchange.cut_reason == _GIVEN_UP:
            raise _Cancelled
        if exchange.cut_reason == _DEADLINE:
            raise _Transient(f"no answer within {self.timeout_s:g} s")

    def _post(self, payload: bytes, limit: int, exchange: Exchange) -> bytes:
        request = urllib.request.Request(self.url, data=payload, headers=self._headers, method="POST")
        opener = urllib.request.build_opener(CuttableHTTPHandler(exchange), CuttableHTTPSHandler(exchange),
                                             NoRedirect())
        try:
            with opener.open(request, timeout=self.timeout_s) as response:  # closing it hangs up on the rest
                return read_capped(response, limit)
        except OverCap:  # a server that answers this much would again: not retried
            raise QuestionFailed(self.url, f"answered more than {limit} bytes, more than the request can need; "
                                 "read no further") from None
        except urllib.error.HTTPError as e:
            detail = snippet(error_body_start(e))
            if e.code == 429 or e.code >= 500:
                wait = (retry_after_seconds(e.headers.get("Retry-After"), self.max_retry_after_s)
                        if e.code in (429, 503) and e.headers is not None else None)
                raise _Transient(f"HTTP {e.code} {detail}", retry_after=wait) from e
            raise QuestionFailed(self.url, f"answered {status_text(e)}: {detail}") from e
        except TimeoutError as e:
            raise _Transient(f"no answer within {self.timeout_s:g} s") from e
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise _Transient(f"no answer within {self.timeout_s:g} s") from e
            raise _Transient(f"unreachable ({e.reason})", unreachable=is_unreachable(e.reason)) from e
        except (http.client.HTTPException, OSError) as e:  # reset, refused mid-way, bad status line
            raise _Transient(f"connection failed ({type(e).__name__}: {e})") from e

    def _choices(self, body: bytes) -> dict:
        """The answer's JSON, which must hold a non-empty `choices` list of objects."""
        try:
            data = json.loads(body)
        except RecursionError:
            raise QuestionFailed(self.url, f"answered malformed JSON (nested too deep): {snippet(body)}") from None
        except ValueError as e:  # also bytes not UTF-8, and an integer past Python's int-from-string limit
            reason = str(e).split(";")[0]  # the limit's message goes on with advice for programmers
            raise QuestionFailed(self.url, f"answered malformed JSON ({reason}): {snippet(body)}") from None
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, dict) for c in choices):
            raise QuestionFailed(self.url, f"answered without choices: {snippet(body)}")
        return data

    def _parse(self, body: bytes) -> Completion:
        data = self._choices(body)
        choices = data["choices"]
        text = choices[0].get("text")
        if not isinstance(text, str):
            raise QuestionFailed(self.url, f"answered a choice without text: {snippet(body)}")
        usage = data.get("usage")
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        reason = choices[0].get("finish_reason")
        counted = isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0  # JSON true is an int here
        return Completion(text, tokens if counted else None, reason if isinstance(reason, str) else None)


