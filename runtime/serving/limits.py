"""What one client may ask of `npuport serve` (ServeLimits), and a connection's pending count (PendingSlot): shared by
the server (serve.py) and the handler of one connection (http_handler.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from npuport.errors import NpuportError

Log = Callable[[str], None]


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
    max_pending_connections: connections of all clients still sending their request line, headers or body; one
        more takes the place of the oldest still sending its head, of the client with the most (gate.py), else is
        answered 503 at once.
    max_client_connections: connections one client address may have open at once, whatever they are doing; one
        more takes the place of that client's oldest connection still sending its head, else is answered 503.
    max_client_requests: requests of one client address served at once (waiting for the model or generating);
        one more is answered 429. By default as many as max_connections: one client may take every slot (a
        benchmark from one machine); lower it where clients share the server.
    allow_client_chat_template: whether a chat request may bring a chat template of its own. A template is code
        the server runs, with no bound on the memory it takes: only for clients trusted with the machine."""

    max_tokens: int = 4096
    request_timeout_s: float = 30.0
    max_connections: int = 32
    max_prompt_tokens: int = 32768
    header_timeout_s: float = 5.0
    max_pending_connections: int = 256
    allow_client_chat_template: bool = False
    max_client_connections: int = 64
    max_client_requests: int = 32

    def __post_init__(self) -> None:
        counts = (self.max_tokens, self.max_connections, self.max_prompt_tokens, self.max_pending_connections,
                  self.max_client_connections, self.max_client_requests)
        if min(counts) < 1 or not (self.request_timeout_s > 0 and self.header_timeout_s > 0):
            raise NpuportError(f"serve limits must be positive, got {self}")


DEFAULT_LIMITS = ServeLimits()


class PendingSlot:
    """A count held until `give_back` is called once: by whichever of its holders is done with it first."""

    def __init__(self, give_back: Callable[[], None]) -> None:
        self._give_back = give_back
        self._held = True
        self._lock = threading.Lock()  # its holders may be two threads: the accepting one and the connection's

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._give_back()
