"""One HTTP exchange with a server, as the endpoint client (endpoint.py) makes it: on a connection of its own that
another thread can cut short (a deadline, a run given up), redirects not followed, the answer read no further than
a size cap, and what an answer's failure says - its status, the start of its body, the wait a Retry-After asks,
whether nobody serves at the address. Standard library only."""

from __future__ import annotations

import email.utils
import errno
import http.client
import math
import socket
import threading
import time
import urllib.error
import urllib.request

READ_CHUNK = 1 << 16


class NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects end a request as the HTTP answers they are: urllib would send a POST on as a GET without its
    body (301 to 303), and follow a redirect to ftp:// outside the exchange's deadline and size cap."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


def status_text(error: urllib.error.HTTPError) -> str:
    """`HTTP <code>`, and where a redirect points."""
    if 300 <= error.code < 400 and error.headers is not None:
        location = snippet(error.headers.get("Location", "").encode())
        return f"HTTP {error.code} (a redirect to {location}, not followed: give that URL)"
    return f"HTTP {error.code}"


class OverCap(Exception):
    """An answer longer than the bytes it was read for; the rest of it is left unread."""


def read_capped(response: http.client.HTTPResponse, limit: int) -> bytes:
    """The body of `response`, at most `limit` bytes of it: OverCap as soon as a Content-Length or the bytes
    read pass the limit, chunked or unframed bodies alike, before the rest is read."""
    if response.length is not None and response.length > limit:
        raise OverCap
    parts, size = [], 0
    while chunk := response.read(min(READ_CHUNK, limit + 1 - size)):  # one byte past the limit tells
        parts.append(chunk)
        size += len(chunk)
        if size > limit:
            raise OverCap
    return b"".join(parts)


def _shutdown(sock: socket.socket) -> None:
    try:  # the plain socket's shutdown, also for TLS: it unblocks the reader without touching the TLS state
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:  # already closed by the peer or by us
        pass


class Exchange:
    """One request and its answer on their own connection. `cut(reason)` shuts the socket down from any
    thread, so a connect, send or read blocked on it returns at once; urllib's `timeout` alone bounds each
    socket operation, not the exchange (a server dripping a byte a second would never time out)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.cut_reason: str | None = None

    def attach(self, sock: socket.socket) -> None:
        """Called once connected: a cut that came during the connect takes effect now."""
        with self._lock:
            self._sock = sock
            already_cut = self.cut_reason is not None
        if already_cut:
            _shutdown(sock)

    def cut(self, reason: str) -> None:
        with self._lock:
            if self.cut_reason is None:
                self.cut_reason = reason
            sock = self._sock
        if sock is not None:
            _shutdown(sock)


class _Cuttable:
    """Mixed into an http.client connection: hands its socket to the exchange once connected."""

    def __init__(self, host: str, *, exchange: Exchange, **kwargs):
        super().__init__(host, **kwargs)
        self._exchange = exchange

    def connect(self) -> None:
        super().connect()
        self._exchange.attach(self.sock)


class _CuttableHTTPConnection(_Cuttable, http.client.HTTPConnection):
    pass


class _CuttableHTTPSConnection(_Cuttable, http.client.HTTPSConnection):
    pass


class CuttableHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, exchange: Exchange):
        super().__init__()
        self._exchange = exchange

    def http_open(self, req):
        return self.do_open(_CuttableHTTPConnection, req, exchange=self._exchange)


class CuttableHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, exchange: Exchange):
        super().__init__()
        self._exchange = exchange

    def https_open(self, req):
        return self.do_open(_CuttableHTTPSConnection, req, context=self._context, exchange=self._exchange)


def retry_after_seconds(value: str | None, cap: float) -> float | None:
    """The wait a `Retry-After` header asks for, at most `cap`: delay-seconds ("120") or an HTTP date;
    None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    if not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), cap)


_UNREACHABLE_ERRNOS = {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL}


def is_unreachable(reason: object) -> bool:
    """Whether a connect failure says nobody serves at that address (rather than a slow or flaky server)."""
    return isinstance(reason, (ConnectionRefusedError, socket.gaierror)) or (
        isinstance(reason, OSError) and reason.errno in _UNREACHABLE_ERRNOS)


def error_body_start(error: urllib.error.HTTPError) -> bytes:
    """The start of an error answer's body; whatever the connection does meanwhile (cut at the deadline)."""
    try:
        return error.read(4096) if error.fp is not None else b""
    except (http.client.HTTPException, OSError):
        return b""


def snippet(body: bytes, limit: int = 200) -> str:
    """The start of a body for an error line; only its first bytes are decoded (an answer may be megabytes)."""
    text = body[:4 * limit].decode("utf-8", errors="replace").strip()  # UTF-8: at most 4 bytes a character
    return repr(text if len(text) <= limit and len(body) <= 4 * limit else text[:limit] + "...")
