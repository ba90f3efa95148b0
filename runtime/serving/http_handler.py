"""One connection of `npuport serve` (serve.py): its request read against deadlines and size limits - the head
(request line and headers) within the header timeout and MAX_HEAD_BYTES, the body within the request timeout and
MAX_BODY_BYTES - the API key checked, the request routed to the service, and the answer written: a JSON object, or
a stream of server-sent events. Every refusal and failure is answered in the OpenAI shape, and every request is
logged in one line (access_line)."""

from __future__ import annotations

import functools
import hmac
import io
import json
import socket
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol

from npuport.chat_prompt import chat_template_source
from npuport.runtime.completion import CANCELLED
from npuport.runtime.serving.api_answers import models_object, sse
from npuport.runtime.serving.api_requests import (
    ChatRequest,
    RequestError,
    check_text,
    error_body,
    parse_chat_request,
    parse_completion_request,
    shown,
)
from npuport.runtime.serving.gate import MAX_HEAD_BYTES, client_host
from npuport.runtime.serving.limits import Log, PendingSlot, ServeLimits
from npuport.runtime.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from npuport.runtime.serving.service import OpenAIService, Prepared, RequestCancelled, peer_closed


class Hosting(Protocol):
    """What a connection's handler asks of the server that accepted it (serve.py's CompletionsServer)."""

    service: OpenAIService
    limits: ServeLimits
    api_key: str | None
    log: Log | None

    def internal_error(self, where: str, error: BaseException) -> None: ...

    def serving(self, client: str = "") -> AbstractContextManager[None]: ...



def access_line(client: str, method: str, path: str, status: int | str, latency_s: float,
                tokens: tuple[int, int] | None, note: str = "") -> str:
    """The log line of one request: when it ended (ISO 8601, local time with its offset), the client, method, path,
    status (or `cancelled`), latency in ms, and the prompt / completion tokens of a generation ("-" for none)."""
    when = datetime.now().astimezone().isoformat(timespec="milliseconds")
    used = "-" if tokens is None else f"{tokens[0]}/{tokens[1]}"
    return (f"{when} {client} {method or '-'} {shown(path) or '-'} {status} {latency_s * 1000:.1f} ms tokens {used}"
            + (f": {note}" if note else ""))


MAX_BODY_BYTES = 16 * 1024 * 1024
BODY_CHUNK_BYTES = 64 * 1024


class HeadTooLarge(Exception):
    """The request line and headers went past MAX_HEAD_BYTES."""


class RequestReader(io.RawIOBase):
    """The reading side of a connection, against a deadline: each read waits at most the time left, so a client
    that sends nothing, or a byte at a time, is cut off when the deadline passes (a per-read timeout alone would
    let a byte every few seconds hold the connection for ever). The head - request line and headers - has its
    deadline and at most MAX_HEAD_BYTES; `start_body` gives the body a deadline of its own. `already`: the bytes the
    gate read first (gate.py), given before any more are read."""

    def __init__(self, connection: socket.socket, head_deadline: float, already: bytes = b"") -> None:
        self._connection = connection
        self._deadline = head_deadline
        self._head_left: int | None = MAX_HEAD_BYTES  # None once the body is read: Content-Length bounds it
        self._already, self._given = already, 0

    def start_body(self, deadline: float) -> None:
        self._deadline, self._head_left = deadline, None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        into = memoryview(buffer)
        if self._head_left is not None:
            if self._head_left == 0:
                raise HeadTooLarge
            into = into[:self._head_left]
        if self._given < len(self._already):
            received = min(len(into), len(self._already) - self._given)
            into[:received] = self._already[self._given:self._given + received]
            self._given += received
        else:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request was not received in time")
            self._connection.settimeout(left)
            received = self._connection.recv_into(into)
        if self._head_left is not None:
            self._head_left -= received
        return received


class RequestHandler(BaseHTTPRequestHandler):
    server: Hosting
    requestline = request_version = command = ""  # what a refusal before the request line is read logs

    def __init__(self, request: socket.socket, client_address: Any, server: Hosting, pending: PendingSlot,
                 head: bytes = b"", head_deadline: float | None = None) -> None:
        self.pending = pending  # given back once the request has arrived whole
        self._head, self._head_deadline = head, head_deadline  # what the gate read, and the head's deadline
        super().__init__(request, client_address, server)

    @property
    def timeout(self) -> float:  # read by StreamRequestHandler.setup: the timeout of each socket operation
        return self.server.limits.request_timeout_s

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # replaced by a reader that enforces the request's deadlines and the head's size
        deadline = self._head_deadline
        if deadline is None:
            deadline = time.monotonic() + self.server.limits.header_timeout_s
        self.reader = RequestReader(self.connection, deadline, self._head)
        self.rfile = io.BufferedReader(self.reader)

    def handle_one_request(self) -> None:
        self._started: float | None = None  # once a request line has come; then it is logged when answered
        self._status: int | str | None = None
        self._tokens: tuple[int, int] | None = None
        self._note = ""
        try:
            super().handle_one_request()
        except HeadTooLarge:
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                            f"the request line and headers are more than {MAX_HEAD_BYTES} bytes")
        finally:
            if self._status is not None and self.server.log is not None:
                started = self._started if self._started is not None else time.monotonic()
                self.server.log(access_line(self.address_string(), self.command, self.path, self._status,
                                            time.monotonic() - started, self._tokens, self._note))

    def parse_request(self) -> bool:
        self._started = time.monotonic()
        return super().parse_request()

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        """Called by send_response: the status is kept for the request's one line (handle_one_request)."""
        self._status = code.value if isinstance(code, HTTPStatus) else code

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.split("?", 1)[0].rstrip("/") == "/metrics":  # for Prometheus, which holds no key (as /health)
            self._write(HTTPStatus.OK, self.server.service.metrics.exposition().encode(), METRICS_CONTENT_TYPE)
            return
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
        with self.server.serving(client_host(self.client_address)):
            service = self.server.service
            prepared = self._prepare(path, body)
            client_gone = functools.partial(peer_closed, self.connection)  # its rows then stop: cancelled
            try:
                if not prepared.generation.stream:
                    answer = service.answer(prepared, client_gone=client_gone)
                    usage = answer["usage"]
                    self._tokens = usage["prompt_tokens"], usage["completion_tokens"]
                    return answer
                self._stream(lambda write: service.stream(prepared, write, client_gone=client_gone))
            except RequestCancelled as e:
                self._cancelled(e.reason)
            return None

    def _cancelled(self, reason: str) -> None:
        """Log a request whose client went away while it was served as cancelled (CANCELLED, the finish reason
        its rows ended with): the client's doing, not a failure of the connection or the server. The connection
        is closed; nothing more is written to it."""
        self.close_connection = True
        self._status, self._note = CANCELLED, reason

    def _prepare(self, path: str, body: Any) -> Prepared:
        """The request read against this server's limits (max_prompt_tokens travels with it, for the service to
        check once the prompts are tokenized) and made ready for the model."""
        service, limits = self.server.service, self.server.limits
        if path == "/v1/completions":
            return service.prepare_completion(parse_completion_request(
                body, service.served_model, limits.max_tokens, max_prompt_tokens=limits.max_prompt_tokens,
                aliases=service.aliases))
        return self._prepare_chat(parse_chat_request(
            body, service.served_model, limits.max_tokens, max_prompt_tokens=limits.max_prompt_tokens,
            allow_chat_template=limits.allow_client_chat_template, aliases=service.aliases))

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

    def _stream(self, produce: Callable[[Callable[[bytes], None]], tuple[int, int]]) -> None:
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
            self._tokens = produce(write)
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
            parsed = json.loads(body)
        except json.JSONDecodeError as e:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"the body is not JSON ({e.msg} at line {e.lineno} column "
                                                       f"{e.colno})") from None
        except (ValueError, RecursionError):  # not UTF-8, an integer of too many digits, nesting too deep
            raise RequestError(HTTPStatus.BAD_REQUEST, "the body is not JSON that this server reads") from None
        check_text(body, parsed)
        return parsed

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a malformed request line, headers too long, an unsupported method) in
        the OpenAI shape as well."""
        self.close_connection = True
        status = HTTPStatus(code)
        self._answer(status, error_body(status, shown(message or status.phrase)))

    def _answer(self, status: HTTPStatus, data: dict[str, Any]) -> None:
        self._write(status, json.dumps(data).encode("utf-8"), "application/json")

    def _write(self, status: HTTPStatus, payload: bytes, content_type: str) -> None:
        self.connection.settimeout(self.timeout)  # the reader left it at what remained of the request's time
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        if status == HTTPStatus.UNAUTHORIZED:
            self.send_header("WWW-Authenticate", "Bearer")
        if status in (HTTPStatus.SERVICE_UNAVAILABLE, HTTPStatus.TOO_MANY_REQUESTS):
            self.send_header("Retry-After", "1")
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        """http.server's other lines (a request that timed out): time-stamped as the requests' lines are."""
        if self.server.log is not None:
            when = datetime.now().astimezone().isoformat(timespec="milliseconds")
            self.server.log(f"{when} {self.address_string()} {format % args}")
