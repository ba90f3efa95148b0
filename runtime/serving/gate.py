"""The gate of `npuport serve` (serve.py): every connection from its accept until its request line and headers
(the head) have arrived, read by one thread over a selector, so that a connection still sending its head costs a
socket and the bytes it sent - no thread - and is cut at the header deadline; once its head is in, it is handed to a
thread of its own (http_handler.py), which checks the API key before it reads the body. Idle and dripping sockets
thus never reach a thread, and a client without the key never holds a slot while its body arrives.

Each client address may have `max_client_connections` connections open at once (any stage: head, body, served),
and all clients together `max_pending_connections` connections that have not arrived whole yet. A connection over
either limit takes the place of the oldest connection still sending its head - of its own address, or, for the
shared limit, of the address with the most such connections - which is answered 503 and closed; where there is no
such connection to take the place of, the new one is answered 503 at once. A client flooding the server thus
displaces only its own connections (or those of the address flooding the most), and a client whose head arrives
within moments of connecting is never displaced by another address."""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from http import HTTPStatus
from typing import Any

from npuport.runtime.serving.api_requests import error_body
from npuport.runtime.serving.limits import Log, ServeLimits

MAX_HEAD_BYTES = 64 * 1024  # the request line and headers: clients send a few hundred bytes
RECV_BYTES = 16 * 1024  # read at once from a connection sending its head
HandOver = Callable[[socket.socket, Any, bytes, float], None]  # (connection, address, bytes so far, head deadline)


@dataclass(eq=False)
class Arrival:
    """A connection sending its head: when it must be in, and what it sent so far."""

    sock: socket.socket
    address: Any
    deadline: float
    head: bytearray = field(default_factory=bytearray)

    @property
    def host(self) -> str:
        return client_host(self.address)


def client_host(address: Any) -> str:
    """The client's address as the per-client limits count it (the IP address, without the port)."""
    return str(address[0]) if isinstance(address, tuple) and address else str(address)


def head_complete(head: bytes | bytearray) -> bool:
    """Whether `head` holds a whole request head: a request line and headers up to an empty line - or a first
    line that http.server answers without reading headers (not three words: HTTP/0.9, or malformed)."""
    first_end = head.find(b"\n")
    if first_end == -1:
        return False
    if len(bytes(head[:first_end]).split()) != 3:
        return True
    return head.find(b"\n\n", first_end) != -1 or head.find(b"\n\r\n", first_end) != -1


def busy_answer(message: str) -> bytes:
    """A 503 in the OpenAI shape, written without reading the request."""
    payload = json.dumps(error_body(HTTPStatus.SERVICE_UNAVAILABLE, message, None, "server_busy")).encode()
    return (f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}"
            f"\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode() + payload


class Gate:
    """The connections sending their heads (see above), with the counts behind the per-client and shared limits.
    `hand_over` gets each connection whose head is in (or over MAX_HEAD_BYTES, for the handler to refuse) on the
    gate's thread, and must not block; the handler's thread then calls `arrived` once its request is whole and
    `closed` once the connection is done."""

    def __init__(self, limits: ServeLimits, hand_over: HandOver, log: Log | None = None) -> None:
        self.limits, self.hand_over, self.log = limits, hand_over, log
        self._lock = threading.Lock()
        self._open: Counter[str] = Counter()  # connections of each client address, open (any stage)
        self._pending = 0  # connections that have not arrived whole (head, then body)
        self._new: deque[tuple[socket.socket, Any]] = deque()  # accepted, not taken in by the gate's thread yet
        self._heads: dict[Arrival, None] = {}  # in accept order, so in deadline order (the gate's thread only)
        self._by_host: dict[str, dict[Arrival, None]] = {}  # the same, per address
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._closing = False
        self.thread = threading.Thread(target=self._run, name="npuport-gate", daemon=True)
        self.thread.start()

    # -- from other threads -------------------------------------------------------------------------------------

    def admit(self, sock: socket.socket, address: Any) -> None:
        """A connection just accepted (the accepting thread's call: never blocks)."""
        with self._lock:
            if self._closing:
                sock.close()
                return
            self._new.append((sock, address))
        self._wake()

    def arrived(self) -> None:
        """A handed-over connection's request has arrived whole: it no longer counts as pending."""
        with self._lock:
            self._pending -= 1

    def closed(self, address: Any) -> None:
        """A handed-over connection is done (its pending count given back first, by `arrived`, if still held)."""
        host = client_host(address)
        with self._lock:
            self._open[host] -= 1
            if self._open[host] <= 0:
                del self._open[host]

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def open_connections(self, address: Any) -> int:
        with self._lock:
            return self._open.get(client_host(address), 0)

    def close(self) -> None:
        """Stop the gate: the connections still sending their heads are closed."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._wake()
        if threading.current_thread() is not self.thread:
            self.thread.join(5)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # its buffer is full (the gate will wake anyway) or it is closed
            pass

    # -- the gate's thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closing:
                timeout = None
                if self._heads:
                    timeout = max(0.0, next(iter(self._heads)).deadline - time.monotonic())
                for key, _ in self._selector.select(timeout):
                    if key.fileobj is self._wake_r:
                        self._drain_wake()
                    else:
                        self._read(key.data)
                self._take_new()
                self._expire()
        finally:
            for arrival in list(self._heads):
                self._drop(arrival)
            for sock, _ in self._new:
                sock.close()
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _take_new(self) -> None:
        while True:
            with self._lock:
                if not self._new:
                    return
                sock, address = self._new.popleft()
            self._admit(sock, address)

    def _admit(self, sock: socket.socket, address: Any) -> None:
        """Take a new connection in, within the per-client and shared limits (see the module's docstring)."""
        host = client_host(address)
        limits = self.limits
        with self._lock:
            over_client = self._open[host] >= limits.max_client_connections
            over_shared = self._pending >= limits.max_pending_connections
        victim = None
        if over_client:
            victim = next(iter(self._by_host.get(host, ())), None)
            why = f"this client has {limits.max_client_connections} connections open (--max-client-connections)"
        elif over_shared:
            crowded = max(self._by_host, key=lambda h: len(self._by_host[h]), default=None)
            victim = None if crowded is None else next(iter(self._by_host[crowded]))
            why = (f"the server has {limits.max_pending_connections} connections still sending their requests "
                   "(--max-pending-connections)")
        if (over_client or over_shared) and victim is None:
            self._refuse(sock, address, f"{why}; retry shortly")
            return
        if victim is not None:
            self._drop(victim, answer=f"{why}: this connection, still sending its request, made room for a newer "
                                      "one; retry shortly")
        sock.setblocking(False)
        arrival = Arrival(sock, address, time.monotonic() + limits.header_timeout_s)
        try:
            self._selector.register(sock, selectors.EVENT_READ, arrival)
        except (OSError, ValueError):
            sock.close()
            return
        with self._lock:
            self._open[host] += 1
            self._pending += 1
        self._heads[arrival] = None
        self._by_host.setdefault(host, {})[arrival] = None
        self._read(arrival)  # a client sends its head as it connects: often it is there already

    def _read(self, arrival: Arrival) -> None:
        try:
            data = arrival.sock.recv(min(RECV_BYTES, MAX_HEAD_BYTES + 1 - len(arrival.head)))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client closed (or reset) before its head was in
            self._drop(arrival)
            return
        arrival.head += data
        if len(arrival.head) > MAX_HEAD_BYTES or head_complete(arrival.head):
            self._forget(arrival)
            try:
                self.hand_over(arrival.sock, arrival.address, bytes(arrival.head), arrival.deadline)
            except Exception:  # noqa: BLE001 - no thread for it (the machine's limit): the connection ends
                self._closed(arrival, pending=True)
                arrival.sock.close()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._heads and (oldest := next(iter(self._heads))).deadline <= now:
            self._drop(oldest)
            if self.log is not None:
                when = datetime.now().astimezone().isoformat(timespec="milliseconds")
                self.log(f"{when} {oldest.host} - request timed out: its request line and headers did not arrive "
                         f"within {self.limits.header_timeout_s:g} s")

    def _forget(self, arrival: Arrival) -> None:
        """No longer the gate's: out of the selector and the lists of heads (its counts stay)."""
        try:
            self._selector.unregister(arrival.sock)
        except (KeyError, ValueError, OSError):
            pass
        self._heads.pop(arrival, None)
        mine = self._by_host.get(arrival.host)
        if mine is not None:
            mine.pop(arrival, None)
            if not mine:
                del self._by_host[arrival.host]

    def _closed(self, arrival: Arrival, pending: bool) -> None:
        with self._lock:
            if pending:
                self._pending -= 1
            self._open[arrival.host] -= 1
            if self._open[arrival.host] <= 0:
                del self._open[arrival.host]

    def _drop(self, arrival: Arrival, answer: str | None = None) -> None:
        """Close a connection still sending its head (with a 503 saying why, when `answer`)."""
        self._forget(arrival)
        self._closed(arrival, pending=True)
        if answer is not None:
            self._send(arrival.sock, busy_answer(answer))
        arrival.sock.close()

    def _refuse(self, sock: socket.socket, address: Any, message: str) -> None:
        self._send(sock, busy_answer(message))
        sock.close()
        if self.log is not None:
            self.log(f"{client_host(address)} refused: {message}")

    @staticmethod
    def _send(sock: socket.socket, data: bytes) -> None:
        """Best effort, never blocking: the answer fits a fresh socket's send buffer, and a client that cannot take
        it is not waited for."""
        try:
            sock.setblocking(False)
            sock.send(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
