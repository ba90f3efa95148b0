"""`npuport serve`: an OpenAI-compatible server on the built-in runtime - `POST /v1/completions` and
`/v1/chat/completions` (log-probabilities, echo, n, streaming as server-sent events), `GET /v1/models`, `GET
/health` - whose requests in flight are batched together (batching.py: one worker owns the model; a request that
arrives while a batch runs joins the next one).

The HTTP layer is the standard library's threaded server, not the FastAPI / uvicorn stack of the engines' own
servers: it does the job as well here - a thread per connection, each waiting on the batcher, and a stream is a
`text/event-stream` response written as the tokens come and closed at its end - and the limits below are written
against it and tested, while the engines' stack would add three dependencies to every install for no feature the
API needs.

A client cannot make the server hold more than it allows: every request field that sizes work is checked before
anything is allocated (`max_tokens` against `--max-tokens-limit` and the model's context; prompts against
`--max-prompt-tokens` and the context, token ids as the body is read and text once tokenized; `n`, the number of
prompts, top log-probabilities, the chat template's variables, the body size), and a chat template of the
request's own is refused unless the operator passes `--allow-client-chat-template` (a template is code the server
runs). A connection has `--header-timeout` to send its request line and headers (at most MAX_HEAD_BYTES), then
`--request-timeout` for its body; at most `--max-pending-connections` connections may be sending their requests at
once, and `--max-connections` requests - counted once one has arrived whole and passed the API key - are served at
once (one more, of either kind, gets 503 at once), so clients that send nothing, or a byte at a time, never hold a
slot that a real request needs. With `--api-key` every /v1 request needs `Authorization: Bearer <key>`. The host
may be an IPv4 or IPv6 address or a name; a port in use is one line of error. Every error is answered in the
OpenAI shape without the server's internals."""

from __future__ import annotations

import functools
import hmac
import io
import ipaddress
import json
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from npuport.errors import NpuportError
from npuport.runtime.validation.completions import RuntimeCompletions
from npuport.runtime.validation.gsm8k import chat_template_source
from npuport.runtime.validation.openai_api import (
    ChatRequest,
    RequestError,
    error_body,
    models_object,
    parse_chat_request,
    parse_completion_request,
    shown,
    sse,
)
from npuport.runtime.validation.service import OpenAIService, Prepared, peer_closed

DEFAULT_HOST = "127.0.0.1"
API_KEY_ENV = "NPUPORT_API_KEY"  # npuport/cli.py names it too: the command line starts without torch
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_HEAD_BYTES = 64 * 1024  # the request line and headers: clients send a few hundred bytes
BODY_CHUNK_BYTES = 64 * 1024
LISTEN_BACKLOG = 128  # connections the kernel holds until accepted (each then gets a thread or a 503 at once)

Log = Callable[[str], None]


def print_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ServeLimits:
    """What one client may ask of the server; each has a command-line option of `npuport serve` (which names
    the same defaults).

    max_tokens: the largest `max_tokens` a request may ask for (the model's context bounds it too).
    request_timeout_s: seconds a client has to send the body once its headers have arrived; also the longest a
        single write of the answer may wait for the client to read.
    max_connections: requests served at once, counted once a request has arrived whole and passed the API key;
        one more is answered 503.
    max_prompt_tokens: the most tokens a prompt may have (the model's context bounds it too): token ids are
        counted as the body is read, text once tokenized.
    header_timeout_s: seconds a client has, from connecting, to send its request line and headers.
    max_pending_connections: connections still sending their request line, headers or body (each has a thread);
        one more is answered 503 and closed at once.
    allow_client_chat_template: whether a chat request may bring a chat template of its own. A template is code
        the server runs, with no bound on the memory it takes: only for clients trusted with the machine."""

    max_tokens: int = 4096
    request_timeout_s: float = 30.0
    max_connections: int = 32
    max_prompt_tokens: int = 32768
    header_timeout_s: float = 5.0
    max_pending_connections: int = 256
    allow_client_chat_template: bool = False

    def __post_init__(self) -> None:
        counts = (self.max_tokens, self.max_connections, self.max_prompt_tokens, self.max_pending_connections)
        if min(counts) < 1 or not (self.request_timeout_s > 0 and self.header_timeout_s > 0):
            raise NpuportError(f"serve limits must be positive, got {self}")


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


def host_port(host: str, port: int) -> str:
    """`host:port` as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listening_family(host: str, port: int) -> socket.AddressFamily:
    """The address family to listen on `host` with: IPv4 where the host has an IPv4 address (a name such as
    localhost keeps listening where IPv4 clients reach it), else IPv6 (`::1`, `::`, an IPv6-only name). "" is
    every interface, as bind takes it."""
    families = [family for family, *_ in socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                            flags=socket.AI_PASSIVE)]
    return socket.AF_INET if socket.AF_INET in families else families[0]


class _Slot:
    """A slot taken from `bound`, given back once: by whichever of its holders is done with it first."""

    def __init__(self, bound: threading.BoundedSemaphore) -> None:
        self._bound = bound
        self._held = True
        self._lock = threading.Lock()  # its holders may be two threads: the accepting one and the connection's

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._bound.release()


class CompletionsServer(ThreadingHTTPServer):
    """The HTTP server: `runner`'s model behind an OpenAIService (batches of at most runner.batch_size rows);
    `served_model` is the name clients use. A connection gets a thread while fewer than
    `limits.max_pending_connections` are still sending their requests, and a request is served while fewer than
    `limits.max_connections` are; `log` gets a line per request, `report` the details of internal errors (which
    clients only see as "internal error")."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], runner: RuntimeCompletions, served_model: str, *,
                 limits: ServeLimits = ServeLimits(), api_key: str | None = None, log: Log | None = None,
                 report: Log = print_to_stderr) -> None:
        if api_key is not None and not api_key.strip():
            raise NpuportError("the API key is empty; give a key or none")
        self.request_queue_size = LISTEN_BACKLOG  # read by server_activate
        try:
            self.address_family = listening_family(*address)  # read by the socket's creation
            super().__init__(address, _Handler, bind_and_activate=False)
        except OSError as e:
            raise NpuportError(f"cannot listen on {host_port(*address)}: {e.strerror or e}") from None
        try:
            self.server_bind()
            self.server_activate()
        except OSError as e:
            self.socket.close()
            raise NpuportError(f"cannot listen on {host_port(*address)}: {e.strerror or e}") from None
        try:
            self.service = OpenAIService(runner, served_model, runner.batch_size)
        except BaseException:
            self.socket.close()
            raise
        self.limits = limits
        self.api_key = api_key
        self.log = log
        self.report = report
        self._pending = threading.BoundedSemaphore(limits.max_pending_connections)
        self._slots: dict[socket.socket, _Slot] = {}  # a connection's pending slot, from accept to its thread
        self._serving = threading.BoundedSemaphore(limits.max_connections)

    def server_close(self) -> None:
        super().server_close()
        self.service.close()

    @property
    def url(self) -> str:
        return f"http://{host_port(*self.server_address[:2])}"

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        """A thread for the connection while fewer than max_pending_connections are sending their requests; else
        503 at once."""
        if not self._pending.acquire(blocking=False):
            self._refuse_busy(request, client_address)
            return
        slot = self._slots[request] = _Slot(self._pending)
        try:
            super().process_request(request, client_address)
        except BaseException:  # e.g. a signal's exception after the thread started: the slot goes back once
            slot.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        """ThreadingMixIn's, handing the connection's pending slot to its handler, which gives it back once the
        request has arrived whole; else it goes back when the connection ends."""
        pending = self._slots.pop(request)
        try:
            _Handler(request, client_address, self, pending)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            pending.release()
            self.shutdown_request(request)

    @contextmanager
    def serving(self) -> Iterator[None]:
        """One of the max_connections slots while a request that arrived whole is served; 503 when none is free."""
        if not self._serving.acquire(blocking=False):
            raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE, f"the server is serving {self.limits.max_connections} "
                               "requests; retry shortly", None, "server_busy")
        try:
            yield
        finally:
            self._serving.release()

    def _refuse_busy(self, request: socket.socket, client_address: Any) -> None:
        """Answer 503 without reading the request, on the accepting thread: never blocks (the answer fits the
        fresh socket's send buffer, and a client that cannot take it is not waited for)."""
        pending = self.limits.max_pending_connections
        message = f"the server has {pending} connections still sending their requests; retry shortly"
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
            self.log(f"{client_address[0]} refused: {pending} connections still sending their requests")

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed outside a request (a client that reset it): one line, no traceback."""
        error = sys.exc_info()[1]
        self.report(f"{client_address[0]}: connection dropped ({type(error).__name__}: {error})")

    def internal_error(self, where: str, error: BaseException) -> None:
        """Report a failure of the server's own (the details stay in the operator's log)."""
        frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
        at = f" (at {Path(frame.filename).name}:{frame.lineno})" if frame is not None else ""
        self.report(f"{where}: internal error: {type(error).__name__}: {error}{at}")


class _HeadTooLarge(Exception):
    """The request line and headers went past MAX_HEAD_BYTES."""


class _RequestReader(io.RawIOBase):
    """The reading side of a connection, against a deadline: each read waits at most the time left, so a client
    that sends nothing, or a byte at a time, is cut off when the deadline passes (a per-read timeout alone would
    let a byte every few seconds hold the connection for ever). The head - request line and headers - has its
    deadline and at most MAX_HEAD_BYTES; `start_body` gives the body a deadline of its own."""

    def __init__(self, connection: socket.socket, head_deadline: float) -> None:
        self._connection = connection
        self._deadline = head_deadline
        self._head_left: int | None = MAX_HEAD_BYTES  # None once the body is read: Content-Length bounds it

    def start_body(self, deadline: float) -> None:
        self._deadline, self._head_left = deadline, None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request was not received in time")
        into = memoryview(buffer)
        if self._head_left is not None:
            if self._head_left == 0:
                raise _HeadTooLarge
            into = into[:self._head_left]
        self._connection.settimeout(left)
        received = self._connection.recv_into(into)
        if self._head_left is not None:
            self._head_left -= received
        return received


class _Handler(BaseHTTPRequestHandler):
    server: CompletionsServer
    requestline = request_version = command = ""  # what a refusal before the request line is read logs

    def __init__(self, request: socket.socket, client_address: Any, server: CompletionsServer,
                 pending: _Slot) -> None:
        self.pending = pending  # given back once the request has arrived whole
        super().__init__(request, client_address, server)

    @property
    def timeout(self) -> float:  # read by StreamRequestHandler.setup: the timeout of each socket operation
        return self.server.limits.request_timeout_s

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # replaced by a reader that enforces the request's deadlines and the head's size
        self.reader = _RequestReader(self.connection, time.monotonic() + self.server.limits.header_timeout_s)
        self.rfile = io.BufferedReader(self.reader)

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except _HeadTooLarge:
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                            f"the request line and headers are more than {MAX_HEAD_BYTES} bytes")

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._respond(self._get)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self._respond(self._post)

    def _get(self, path: str) -> dict[str, Any] | None:
        if path == "/health":
            return {"status": "ok"}
        self._check_api_key()
        if path == "/v1/models":
            return models_object(self.server.service.served_model)
        raise RequestError(HTTPStatus.NOT_FOUND, f"no such path {shown(self.path)!r}", None, "not_found")

    def _post(self, path: str) -> dict[str, Any] | None:
        """The answer object, or None once a stream has been written."""
        self._check_api_key()
        if path not in ("/v1/completions", "/v1/chat/completions"):
            raise RequestError(HTTPStatus.NOT_FOUND, f"no such path {shown(self.path)!r}; POST /v1/completions or "
                                                     "/v1/chat/completions", None, "not_found")
        body = self._body()
        self.pending.release()  # the request has arrived: from here it counts against max_connections
        with self.server.serving():
            service = self.server.service
            prepared = self._prepare(path, body)
            client_gone = functools.partial(peer_closed, self.connection)  # its rows then stop: cancelled
            if not prepared.generation.stream:
                return service.answer(prepared, client_gone=client_gone)
            self._stream(lambda write: service.stream(prepared, write, client_gone=client_gone))
            return None

    def _prepare(self, path: str, body: Any) -> Prepared:
        """The request read against this server's limits (max_prompt_tokens travels with it, for the service to
        check once the prompts are tokenized) and made ready for the model."""
        service, limits = self.server.service, self.server.limits
        if path == "/v1/completions":
            return service.prepare_completion(parse_completion_request(
                body, service.served_model, limits.max_tokens, max_prompt_tokens=limits.max_prompt_tokens))
        return self._prepare_chat(parse_chat_request(
            body, service.served_model, limits.max_tokens, max_prompt_tokens=limits.max_prompt_tokens,
            allow_chat_template=limits.allow_client_chat_template))

    def _prepare_chat(self, request: ChatRequest) -> Prepared:
        """service.prepare_chat; a failure of a template the request brought is put on the request field it came
        from, not on the model's template file, which the service's message names."""
        service = self.server.service
        try:
            return service.prepare_chat(request)
        except RequestError as e:
            if request.template_field is None or e.code != "chat_template":
                raise
            failure = str(e).removeprefix(f"{chat_template_source(service.runner.tokenizer)}: ")
            raise RequestError(e.status, f"'{request.template_field}': {failure}", request.template_field,
                               e.code) from None

    def _stream(self, produce: Callable[[Callable[[bytes], None]], None]) -> None:
        """A `text/event-stream` answer, written by produce(write) as it goes; the connection closes at its end.
        A failure of the model after the stream began ends it with an error event."""
        self.close_connection = True
        self.connection.settimeout(self.timeout)  # each write may wait this long for the client to read
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()

        def write(data: bytes) -> None:
            self.wfile.write(data)
            self.wfile.flush()

        try:
            produce(write)
        except (TimeoutError, ConnectionError):
            raise  # the client is gone: nothing more to say to it
        except Exception as e:  # the server's fault, in the middle of a stream
            self.server.internal_error(f"{self.address_string()} {self.command} {shown(self.path)}", e)
            write(sse(error_body(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error", None, "internal_error")))
            write(sse("[DONE]"))

    def _respond(self, route: Callable[[str], dict[str, Any] | None]) -> None:
        try:
            status, data = HTTPStatus.OK, route(self.path.split("?", 1)[0].rstrip("/"))
        except RequestError as e:
            status, data = e.status, error_body(e.status, str(e), e.param, e.code)
        except (TimeoutError, ConnectionError):
            raise  # a client too slow or gone: the connection is dropped (http.server logs the timeout)
        except Exception as e:  # the server's fault: details to the operator, "internal error" to the client
            self.server.internal_error(f"{self.address_string()} {self.command} {shown(self.path)}", e)
            status, data = HTTPStatus.INTERNAL_SERVER_ERROR, error_body(
                HTTPStatus.INTERNAL_SERVER_ERROR, "internal error", None, "internal_error")
        if data is not None:
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
        claims, and the whole body must arrive within request_timeout_s of the headers."""
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise RequestError(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required") from None
        if length > MAX_BODY_BYTES:
            raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is {length} bytes; this server takes "
                               f"at most {MAX_BODY_BYTES}", None, "request_too_large")
        if length < 0:
            raise RequestError(HTTPStatus.BAD_REQUEST, "Content-Length must not be negative")
        self.reader.start_body(time.monotonic() + self.server.limits.request_timeout_s)
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
        self._answer(status, error_body(status, shown(message or status.phrase)))

    def _answer(self, status: HTTPStatus, data: dict[str, Any]) -> None:
        payload = json.dumps(data).encode("utf-8")
        self.connection.settimeout(self.timeout)  # the reader left it at what remained of the request's time
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        if status == HTTPStatus.UNAUTHORIZED:
            self.send_header("WWW-Authenticate", "Bearer")
        if status == HTTPStatus.SERVICE_UNAVAILABLE:
            self.send_header("Retry-After", "1")
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
