"""`npuport serve`: an OpenAI-compatible completions endpoint on the built-in runtime (`POST /v1/completions`,
`GET /v1/models`, `GET /health`), on the standard library's threaded HTTP server with one lock around the model,
so requests run one at a time (a request's list of prompts runs as one batch)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from npuport.errors import NpuportError
from npuport.runtime.sampling import SamplingParams
from npuport.runtime.validation.completions import RuntimeCompletions

DEFAULT_HOST = "127.0.0.1"
DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # likewise; clients that want greedy send temperature 0
MAX_BODY_BYTES = 16 * 1024 * 1024


class RequestError(Exception):
    """A request the server refuses, with the HTTP status and the message it answers."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[str]
    max_tokens: int
    stop: list[str]
    sampling: SamplingParams


def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise RequestError(HTTPStatus.BAD_REQUEST, f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}")
    return value


def parse_request(body: Any, served_model: str) -> CompletionRequest:
    """Read a /v1/completions body: `prompt` (a string or a list of strings), `max_tokens`, `temperature`,
    `top_p`, `seed`, `stop` (a string or a list), `model` (absent or the served name); `n` must be 1 and
    `stream`, `echo` and `logprobs` must be off. Other fields are ignored, as the engines ignore unknown ones."""
    if not isinstance(body, dict):
        raise RequestError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model:
        raise RequestError(HTTPStatus.NOT_FOUND, f"model {model!r} is not served here; this server serves "
                                                 f"{served_model!r}")
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise RequestError(HTTPStatus.BAD_REQUEST, "'prompt' must be a string or a non-empty list of strings")
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise RequestError(HTTPStatus.BAD_REQUEST, "'stop' must be a string or a list of non-empty strings")
    for name, off in (("n", 1), ("stream", False), ("echo", False), ("logprobs", None)):
        if body.get(name) not in (None, off):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"'{name}' other than {json.dumps(off)} is not supported")
    max_tokens = _field(body, "max_tokens", (int,), DEFAULT_MAX_TOKENS)
    temperature = float(_field(body, "temperature", (int, float), DEFAULT_TEMPERATURE))
    top_p = float(_field(body, "top_p", (int, float), 1.0))
    seed = _field(body, "seed", (int,), None)
    if max_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
        raise RequestError(HTTPStatus.BAD_REQUEST, "need max_tokens >= 1, temperature >= 0 and 0 < top_p <= 1")
    return CompletionRequest(prompts, max_tokens, list(stop), SamplingParams(temperature, top_p, seed))


class CompletionsServer(ThreadingHTTPServer):
    """The HTTP server: `runner` completes prompts, under `lock`; `served_model` is the name clients use."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], runner: RuntimeCompletions, served_model: str,
                 log: Callable[[str], None] | None = None) -> None:
        super().__init__(address, _Handler)
        self.runner = runner
        self.served_model = served_model
        self.log = log
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def complete(self, request: CompletionRequest) -> dict[str, Any]:
        """The OpenAI `text_completion` object for one request."""
        with self.lock:
            batch = self.runner.complete(request.prompts, max_tokens=request.max_tokens, stop=request.stop,
                                         sampling=request.sampling)
        prompt_tokens = sum(map(len, batch.prompt_ids))
        completion_tokens = sum(c.completion_tokens or 0 for c in batch.completions)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.served_model,
            "choices": [{"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                        for i, c in enumerate(batch.completions)],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.served_model, "object": "model", "created": 0,
                                            "owned_by": "npuport"}]}


class _Handler(BaseHTTPRequestHandler):
    server: CompletionsServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/v1/models":
            self._answer(HTTPStatus.OK, self.server.models())
        elif path == "/health":
            self._answer(HTTPStatus.OK, {"status": "ok"})
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no such path {self.path}")

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        try:
            if self.path.split("?", 1)[0].rstrip("/") != "/v1/completions":
                raise RequestError(HTTPStatus.NOT_FOUND, f"no such path {self.path}; POST /v1/completions")
            request = parse_request(self._body(), self.server.served_model)
            answer = self.server.complete(request)
        except RequestError as e:
            self._error(e.status, str(e))
        except NpuportError as e:  # e.g. an empty prompt: the request's fault
            self._error(HTTPStatus.BAD_REQUEST, str(e))
        except Exception as e:  # answered as a server error; the server keeps running
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")
        else:
            self._answer(HTTPStatus.OK, answer)

    def _body(self) -> Any:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise RequestError(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required") from None
        if not 0 <= length <= MAX_BODY_BYTES:
            raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body must be at most {MAX_BODY_BYTES} bytes")
        try:
            return json.loads(self.rfile.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {e}") from None

    def _error(self, status: HTTPStatus, message: str) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._answer(status, {"error": {"message": message, "type": kind, "code": int(status)}})

    def _answer(self, status: HTTPStatus, data: dict[str, Any]) -> None:
        payload = json.dumps(data).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.log is not None:
            self.server.log(f"{self.address_string()} {format % args}")


def make_server(runner: RuntimeCompletions, served_model: str, host: str = DEFAULT_HOST, port: int = 0,
                log: Callable[[str], None] | None = None) -> CompletionsServer:
    """A bound server (port 0: any free port; see `.url`); call `serve_forever()`, then `shutdown()`."""
    return CompletionsServer((host, port), runner, served_model, log)


def serve_model(path: Path | str, *, host: str = DEFAULT_HOST, port: int = 0, served_model: str | None = None,
                device: str | None = None, dtype: str = "bfloat16", mtp: int = 0, max_batch_size: int = 16,
                announce: Callable[[str], None] = print, log: Callable[[str], None] | None = None) -> None:
    """Load the model folder `path` and serve it until interrupted (Ctrl-C). `announce` gets one line naming
    the URL once the socket is bound (with port 0, the port the system chose); `log` one line per request."""
    runner = RuntimeCompletions.load(path, device=device, dtype=dtype, batch_size=max_batch_size, mtp=mtp)
    name = served_model or str(path)
    server = make_server(runner, name, host, port, log)
    announce(f"serving {path} as model {name!r} on {server.url}/v1 (device {runner.model.device}, MTP k={mtp}); "
             "Ctrl-C stops it")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
