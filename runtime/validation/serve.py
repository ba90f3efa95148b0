"""`npuport serve`: an OpenAI-compatible completions endpoint on the built-in runtime (`POST /v1/completions`,
`GET /v1/models`, `GET /health`), on the standard library's threaded HTTP server with one lock around the model,
so requests run one at a time (a request's list of prompts runs in batches).

A client cannot make the server hold more than it allows: every request field that sizes work is checked before
anything is allocated (`max_tokens` against `--max-tokens-limit` and the model's context, the prompt against the
context, the body size), a request must arrive whole within `--request-timeout`, at most `--max-connections`
connections are served at once (the next ones get 503 at once), and with `--api-key` every /v1 request needs
`Authorization: Bearer <key>`. Every error is answered in the OpenAI shape without the server's internals."""

from __future__ import annotations

import hmac
import io
import ipaddress
import json
import math
import socket
import sys
import threading
import time
import traceback
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
API_KEY_ENV = "NPUPORT_API_KEY"  # npuport/cli.py names it too: the command line starts without torch
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_PROMPTS = 128  # prompts in one request's list: each costs a tokenization and a slot in a batch
MAX_STOP_STRINGS = 16  # each is searched for in the text every few tokens
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes
BODY_CHUNK_BYTES = 64 * 1024
LISTEN_BACKLOG = 128  # connections the kernel holds until accepted (each then gets a thread or a 503 at once)
SHOWN_CHARS = 100  # of a client's own text (a path, a model name) quoted back in an error

Log = Callable[[str], None]


def print_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ServeLimits:
    """What one client may ask of the server; each has a command-line option of `npuport serve`.

    max_tokens: the largest `max_tokens` a request may ask for (the model's context bounds it too).
    request_timeout_s: seconds a client has to send its whole request (headers and body) after connecting;
        also the longest a single write of the answer may wait for the client to read.
    max_connections: connections served at once; one more is answered 503 and closed."""

    max_tokens: int = 4096
    request_timeout_s: float = 30.0
    max_connections: int = 32

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.max_connections < 1 or not self.request_timeout_s > 0:
            raise NpuportError(f"serve limits must be positive, got {self}")


class RequestError(Exception):
    """A request the server refuses: the HTTP status, the message it answers, the request field at fault
    (OpenAI's `param`) and a machine-readable `code`."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


def error_body(status: HTTPStatus, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI API's error object: `{"error": {"message", "type", "param", "code"}}`."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _shown(text: str) -> str:
    """A client's own text, cut short, for quoting back in an error."""
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


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
        raise RequestError(HTTPStatus.BAD_REQUEST, f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}",
                           name, "invalid_type")
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestError(HTTPStatus.BAD_REQUEST, f"'{name}' must be a finite number", name, "invalid_value")
    return value


def _refuse(name: str, message: str) -> RequestError:
    return RequestError(HTTPStatus.BAD_REQUEST, message, name, "invalid_value")


def parse_request(body: Any, served_model: str, max_tokens_limit: int = ServeLimits.max_tokens) -> CompletionRequest:
    """Read a /v1/completions body: `prompt` (a string or a list of at most MAX_PROMPTS strings), `max_tokens`
    (1 to `max_tokens_limit`), `temperature`, `top_p`, `seed`, `stop` (a string or a list of at most
    MAX_STOP_STRINGS), `model` (absent or the served name); `n` must be 1 and `stream`, `echo` and `logprobs` must
    be off. Other fields are ignored, as the engines ignore unknown ones. The model's context is checked later,
    once the prompts are tokenized (`check_context`)."""
    if not isinstance(body, dict):
        raise RequestError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model:
        raise RequestError(HTTPStatus.NOT_FOUND, f"model {_shown(str(model))!r} is not served here; this server "
                                                 f"serves {served_model!r}", "model", "model_not_found")
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise _refuse("prompt", "'prompt' must be a string or a non-empty list of strings")
    if len(prompts) > MAX_PROMPTS:
        raise _refuse("prompt", f"'prompt' lists {len(prompts)} prompts; this server takes at most {MAX_PROMPTS} "
                                "per request")
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise _refuse("stop", f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings")
    for name, off in (("n", 1), ("stream", False), ("echo", False), ("logprobs", None)):
        if body.get(name) not in (None, off):
            raise _refuse(name, f"'{name}' other than {json.dumps(off)} is not supported")
    max_tokens = _field(body, "max_tokens", (int,), DEFAULT_MAX_TOKENS)
    if max_tokens < 1:
        raise _refuse("max_tokens", f"'max_tokens' is {max_tokens}; need max_tokens >= 1")
    if max_tokens > max_tokens_limit:
        raise _refuse("max_tokens", f"'max_tokens' is {max_tokens}, more than this server's limit of "
                                    f"{max_tokens_limit} (npuport serve --max-tokens-limit)")
    temperature = float(_field(body, "temperature", (int, float), DEFAULT_TEMPERATURE))
    if temperature < 0:
        raise _refuse("temperature", "'temperature' must be >= 0")
    top_p = float(_field(body, "top_p", (int, float), 1.0))
    if not 0 < top_p <= 1:
        raise _refuse("top_p", "'top_p' must be in (0, 1]")
    seed = _field(body, "seed", (int,), None)
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise _refuse("seed", "'seed' must be a 64-bit integer")
    return CompletionRequest(prompts, max_tokens, list(stop), SamplingParams(temperature, top_p, seed))


def check_context(prompt_ids: list[list[int]], max_tokens: int, context_tokens: int) -> None:
    """Refuse a request whose prompt and `max_tokens` do not fit the model's context (`max_position_embeddings`
    tokens): the runtime sizes its caches by prompt + max_tokens, so this bounds the memory a request takes."""
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise _refuse("prompt", f"prompt {i} has no tokens; a prompt needs at least one token")
        room = context_tokens - len(ids)
        if room < 1:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"prompt {i} has {len(ids)} tokens; the model's context is "
                               f"{context_tokens} tokens", "prompt", "context_length_exceeded")
        if max_tokens > room:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"'max_tokens' is {max_tokens}, but the model's context of "
                               f"{context_tokens} tokens leaves {room} after the {len(ids)} tokens of prompt {i}",
                               "max_tokens", "context_length_exceeded")


def exposure_warning(address: str, key_required: bool) -> str | None:
    """The warning to print when the server listens on `address` (as bound) beyond this machine's loopback;
    None on loopback. `key_required`: whether requests need an API key."""
    try:
        if ipaddress.ip_address(address.split("%", 1)[0]).is_loopback:
            return None
    except ValueError:  # a name that is not an address: say so rather than guess
        pass
    if key_required:
        who = "requests need the API key, which travels unencrypted (plain HTTP): use a trusted network or a TLS proxy"
    else:
        who = f"anyone who can reach it can use the model; --api-key (or {API_KEY_ENV}) requires a key"
    return f"warning: listening on {address}, beyond this machine's loopback: {who}"


class CompletionsServer(ThreadingHTTPServer):
    """The HTTP server: `runner` completes prompts, under `lock`; `served_model` is the name clients use.
    At most `limits.max_connections` connections get a thread; `log` gets a line per request, `report` the
    details of internal errors (which clients only see as "internal error")."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], runner: RuntimeCompletions, served_model: str, *,
                 limits: ServeLimits = ServeLimits(), api_key: str | None = None, log: Log | None = None,
                 report: Log = print_to_stderr) -> None:
        if runner.context_tokens is None:
            raise NpuportError("the model's config.json states no max_position_embeddings; serve needs the "
                               "model's context to bound what a request may ask for")
        if api_key is not None and not api_key.strip():
            raise NpuportError("the API key is empty; give a key or none")
        self.request_queue_size = LISTEN_BACKLOG  # read by server_activate
        try:
            super().__init__(address, _Handler)
        except OSError as e:
            raise NpuportError(f"cannot listen on {address[0]}:{address[1]}: {e.strerror or e}") from None
        self.runner = runner
        self.served_model = served_model
        self.limits = limits
        self.api_key = api_key
        self.log = log
        self.report = report
        self.lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(limits.max_connections)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        """A thread for the connection while fewer than max_connections are open; else 503 at once."""
        if not self._slots.acquire(blocking=False):
            self._refuse_busy(request, client_address)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse_busy(self, request: socket.socket, client_address: Any) -> None:
        """Answer 503 without reading the request, on the accepting thread: never blocks (the answer fits the
        fresh socket's send buffer, and a client that cannot take it is not waited for)."""
        message = f"the server has {self.limits.max_connections} connections open; retry shortly"
        payload = json.dumps(error_body(HTTPStatus.SERVICE_UNAVAILABLE, message, None, "server_busy")).encode()
        head = (f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: "
                f"{len(payload)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
        try:
            request.setblocking(False)
            request.send(head + payload)
        except OSError:
            pass
        self.shutdown_request(request)
        if self.log is not None:
            self.log(f"{client_address[0]} refused: {self.limits.max_connections} connections open")

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed outside a request (a client that reset it): one line, no traceback."""
        error = sys.exc_info()[1]
        self.report(f"{client_address[0]}: connection dropped ({type(error).__name__}: {error})")

    def complete(self, request: CompletionRequest) -> dict[str, Any]:
        """The OpenAI `text_completion` object for one request; the prompts are tokenized and checked against
        the model's context before the model is touched (under the lock as well: transformers' tokenizers are
        not safe to call from several threads at once)."""
        with self.lock:
            prompt_ids = [self.runner.encode(p) for p in request.prompts]
            check_context(prompt_ids, request.max_tokens, self.runner.context_tokens)
            batch = self.runner.complete_ids(prompt_ids, max_tokens=request.max_tokens, stop=request.stop,
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


class _ReadBeforeDeadline(io.RawIOBase):
    """The reading side of a connection with one deadline for the whole request: each read waits at most the
    time left, so a client that sends nothing, or a byte at a time, is cut off when the deadline passes
    (a per-read timeout alone would let a byte every few seconds hold the connection for ever)."""

    def __init__(self, connection: socket.socket, deadline: float) -> None:
        self._connection = connection
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request was not received in time")
        self._connection.settimeout(left)
        return self._connection.recv_into(buffer)


class _Handler(BaseHTTPRequestHandler):
    server: CompletionsServer

    @property
    def timeout(self) -> float:  # read by StreamRequestHandler.setup: the timeout of each socket operation
        return self.server.limits.request_timeout_s

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # replaced by a reader that enforces the deadline of the whole request
        self.rfile = io.BufferedReader(_ReadBeforeDeadline(self.connection, time.monotonic() + self.timeout))

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._respond(self._get)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self._respond(self._post)

    def _get(self, path: str) -> dict[str, Any]:
        if path == "/health":
            return {"status": "ok"}
        self._check_api_key()
        if path == "/v1/models":
            return self.server.models()
        raise RequestError(HTTPStatus.NOT_FOUND, f"no such path {_shown(self.path)!r}", None, "not_found")

    def _post(self, path: str) -> dict[str, Any]:
        self._check_api_key()
        if path != "/v1/completions":
            raise RequestError(HTTPStatus.NOT_FOUND, f"no such path {_shown(self.path)!r}; POST /v1/completions",
                               None, "not_found")
        request = parse_request(self._body(), self.server.served_model, self.server.limits.max_tokens)
        return self.server.complete(request)

    def _respond(self, route: Callable[[str], dict[str, Any]]) -> None:
        try:
            status, data = HTTPStatus.OK, route(self.path.split("?", 1)[0].rstrip("/"))
        except RequestError as e:
            status, data = e.status, error_body(e.status, str(e), e.param, e.code)
        except (TimeoutError, ConnectionError):
            raise  # a client too slow or gone: the connection is dropped (http.server logs the timeout)
        except Exception as e:  # the server's fault: details to the operator, "internal error" to the client
            where = traceback.extract_tb(e.__traceback__)[-1]
            self.server.report(f"{self.address_string()} {self.command} {_shown(self.path)}: internal error: "
                               f"{type(e).__name__}: {e} (at {Path(where.filename).name}:{where.lineno})")
            status, data = HTTPStatus.INTERNAL_SERVER_ERROR, error_body(
                HTTPStatus.INTERNAL_SERVER_ERROR, "internal error", None, "internal_error")
        self._answer(status, data)

    def _check_api_key(self) -> None:
        """With an API key set, refuse a request without `Authorization: Bearer <key>` (compared in constant
        time, so the answer's timing does not tell how much of a guess was right)."""
        if self.server.api_key is None:
            return
        scheme, _, given = self.headers.get("Authorization", "").strip().partition(" ")
        expected = self.server.api_key.encode("utf-8")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("latin-1", "replace"),
                                                                   expected):
            raise RequestError(HTTPStatus.UNAUTHORIZED, "a valid API key is required: send 'Authorization: "
                               "Bearer <key>'", None, "invalid_api_key")

    def _body(self) -> Any:
        """The JSON body, read in chunks: memory grows with the bytes that arrive, not with the size a client
        claims, and the whole body must arrive before the request's deadline."""
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise RequestError(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required") from None
        if length > MAX_BODY_BYTES:
            raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is {length} bytes; this server takes "
                               f"at most {MAX_BODY_BYTES}", None, "request_too_large")
        if length < 0:
            raise RequestError(HTTPStatus.BAD_REQUEST, "Content-Length must not be negative")
        body = bytearray()
        while len(body) < length:
            chunk = self.rfile.read1(min(BODY_CHUNK_BYTES, length - len(body)))
            if not chunk:
                raise RequestError(HTTPStatus.BAD_REQUEST, f"the body ended after {len(body)} of {length} bytes")
            body += chunk
        try:
            return json.loads(body)
        except json.JSONDecodeError as e:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"the body is not JSON ({e.msg} at line {e.lineno} column "
                                                       f"{e.colno})") from None
        except (ValueError, RecursionError):  # not UTF-8, an integer of too many digits, nesting too deep
            raise RequestError(HTTPStatus.BAD_REQUEST, "the body is not JSON that this server reads") from None

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a malformed request line, headers too long, an unsupported method) in
        the OpenAI shape as well."""
        self.close_connection = True
        status = HTTPStatus(code)
        self._answer(status, error_body(status, _shown(message or status.phrase)))

    def _answer(self, status: HTTPStatus, data: dict[str, Any]) -> None:
        payload = json.dumps(data).encode("utf-8")
        self.connection.settimeout(self.timeout)  # the reader left it at what remained of the request's time
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        if status == HTTPStatus.UNAUTHORIZED:
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.log is not None:
            self.server.log(f"{self.address_string()} {format % args}")


def make_server(runner: RuntimeCompletions, served_model: str, host: str = DEFAULT_HOST, port: int = 0,
                log: Log | None = None, *, limits: ServeLimits = ServeLimits(), api_key: str | None = None,
                report: Log = print_to_stderr) -> CompletionsServer:
    """A bound server (port 0: any free port; see `.url`); call `serve_forever()`, then `shutdown()`."""
    return CompletionsServer((host, port), runner, served_model, limits=limits, api_key=api_key, log=log,
                             report=report)


def serve_model(path: Path | str, *, host: str = DEFAULT_HOST, port: int = 0, served_model: str | None = None,
                device: str | None = None, dtype: str = "bfloat16", mtp: int = 0, max_batch_size: int = 16,
                limits: ServeLimits = ServeLimits(), api_key: str | None = None, announce: Log = print,
                log: Log | None = None, warn: Log = print_to_stderr) -> None:
    """Load the model folder `path` and serve it until interrupted (Ctrl-C). `announce` gets one line naming
    the URL once the socket is bound (with port 0, the port the system chose); `warn` a warning when the address
    is reachable beyond loopback, and the details of internal errors; `log` one line per request."""
    runner = RuntimeCompletions.load(path, device=device, dtype=dtype, batch_size=max_batch_size, mtp=mtp)
    name = served_model or str(path)
    server = make_server(runner, name, host, port, log, limits=limits, api_key=api_key, report=warn)
    warning = exposure_warning(server.server_address[0], key_required=api_key is not None)
    if warning is not None:
        warn(warning)
    world = runner.model.parallel.world
    devices = f"{runner.model.device} x {world}" if world > 1 else f"{runner.model.device}"
    announce(f"serving {path} as model {name!r} on {server.url}/v1 (device {devices}, MTP k={mtp}); Ctrl-C stops it")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
