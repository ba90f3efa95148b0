"""`npuport serve`: an OpenAI-compatible server on the built-in runtime - `POST /v1/completions` and
`/v1/chat/completions` (log-probabilities, echo, n, streaming as server-sent events), `GET /v1/models`, `GET
/health` - whose requests in flight are batched continuously (continuous.py: one worker owns the model; a request
that arrives while others generate joins their batch at the next step; batching.py with --batch-invariant);
http_handler.py reads and answers one connection.

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
runs). No client can deny service to another: a connection's request line and headers (at most MAX_HEAD_BYTES)
are read by the gate (gate.py) - one thread over a selector, none per connection - within `--header-timeout` of
its connecting; only then does it get a thread, which checks the API key before reading the body (within
`--request-timeout`). Each client address may hold `--max-client-connections` connections and have
`--max-client-requests` requests served at once (429 beyond), all clients `--max-pending-connections` connections
still sending their requests (a connection over a connection limit takes the place of the oldest one still sending
its head - its own address's, or the address with the most - else gets 503), and the server serves
`--max-connections` requests at once (503 beyond), counted once a request has arrived whole and passed the key.
With `--api-key` every /v1 request needs `Authorization: Bearer <key>`. `GET /metrics` answers Prometheus' text
format (metrics.py), without the key, as /health. The host may be an IPv4 or IPv6 address or a name; a port in use
is one line of error. Every error is answered in the OpenAI shape without the server's internals.

Ctrl-C, SIGTERM or SIGHUP stop it promptly: it stops accepting, gives the requests in flight `shutdown_timeout_s`
to finish, cancels those still running (their rows end at their next stop check), and says so in two lines,
"shutting down: ..." and "stopped"."""

from __future__ import annotations

import gc
import ipaddress
import socket
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from npuport.errors import NpuportError
from npuport.runtime.serving.api_requests import RequestError
from npuport.runtime.serving.gate import Gate
from npuport.runtime.serving.http_handler import RequestHandler
from npuport.runtime.serving.limits import DEFAULT_LIMITS, Log, PendingSlot, ServeLimits
from npuport.runtime.serving.service import OpenAIService
from npuport.runtime.text_completions import RuntimeCompletions

DEFAULT_HOST = "127.0.0.1"
API_KEY_ENV = "NPUPORT_API_KEY"  # npuport/cli.py names it too: the command line starts without torch
LISTEN_BACKLOG = 128  # connections the kernel holds until accepted (each then gets a thread or a 503 at once)
SHUTDOWN_TIMEOUT_S = 5.0  # how long requests in flight may go on once the server is told to stop
CANCELLED_WAIT_S = 5.0  # then, how long cancelled rows may take to reach their next stop check


def print_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


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


class CompletionsServer(ThreadingHTTPServer):
    """The HTTP server: `runner`'s model behind an OpenAIService (batches of at most runner.batch_size rows);
    `served_model` is the name clients use. A connection is read by the gate until its head is in, then gets a
    thread (within the gate's limits), and a request is served while fewer than `limits.max_connections` are (and
    fewer than `limits.max_client_requests` of its client address); `log` gets a line per request, `report` the
    details of internal errors (which clients only see as "internal error")."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], runner: RuntimeCompletions, served_model: str, *,
                 limits: ServeLimits = DEFAULT_LIMITS, api_key: str | None = None, log: Log | None = None,
                 report: Log = print_to_stderr, aliases: tuple[str, ...] = (), invariant: bool = False,
                 prefill_tokens: int | None = None) -> None:
        if api_key is not None and not api_key.strip():
            raise NpuportError("the API key is empty; give a key or none")
        self.request_queue_size = LISTEN_BACKLOG  # read by server_activate
        try:
            self.address_family = listening_family(*address)  # read by the socket's creation
            super().__init__(address, RequestHandler, bind_and_activate=False)
        except OSError as e:
            raise NpuportError(f"cannot listen on {host_port(*address)}: {e.strerror or e}") from None
        try:
            self.server_bind()
            self.server_activate()
        except OSError as e:
            self.socket.close()
            raise NpuportError(f"cannot listen on {host_port(*address)}: {e.strerror or e}") from None
        try:
            self.service = OpenAIService(runner, served_model, runner.batch_size, aliases=aliases, invariant=invariant,
                                         prefill_tokens=prefill_tokens)
        except BaseException:
            self.socket.close()
            raise
        self.limits = limits
        self.api_key = api_key
        self.log = log
        self.report = report
        self._arrived: dict[socket.socket, tuple[bytes, float]] = {}  # a head in, from the gate to its thread
        self._serving = threading.BoundedSemaphore(limits.max_connections)
        self._clients_lock = threading.Lock()
        self._client_requests: Counter[str] = Counter()  # requests served at once, per client address
        self.gate = Gate(limits, self._hand_over, log)

    def server_close(self) -> None:
        self.gate.close()
        super().server_close()
        self.service.close()

    def stop(self, timeout_s: float = SHUTDOWN_TIMEOUT_S, say: Log = print_to_stderr) -> None:
        """Stop serving (call after serve_forever has returned): no more connections; the requests in flight
        have timeout_s to finish, then those still running are cancelled; says "shutting down: ..." first and
        "stopped" once the model is idle (or, if a cancelled row does not reach its stop check in
        CANCELLED_WAIT_S, that it stops without it)."""
        self.socket.close()
        self.gate.close()
        batcher = self.service.batcher
        say(f"shutting down: {batcher.in_flight} requests in flight (given {timeout_s:g} s to finish, then "
            "cancelled)")
        deadline = time.monotonic() + timeout_s
        while batcher.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        cancelled = batcher.cancel_all()
        finished = batcher.close(CANCELLED_WAIT_S)
        super().server_close()
        if not finished:
            say(f"stopped ({cancelled} cancelled requests still generating were left)")
        else:
            say(f"stopped ({cancelled} requests cancelled)" if cancelled else "stopped")

    @property
    def url(self) -> str:
        return f"http://{host_port(*self.server_address[:2])}"

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        """The accepted connection goes to the gate, which reads its head without a thread (gate.py)."""
        self.gate.admit(request, client_address)

    def _hand_over(self, request: socket.socket, client_address: Any, head: bytes, head_deadline: float) -> None:
        """The gate's call once a connection's head is in: a thread of its own for the rest (ThreadingMixIn's)."""
        self._arrived[request] = head, head_deadline
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._arrived.pop(request, None)
            raise

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        """ThreadingMixIn's, handing the connection's head and pending count to its handler, which gives the count
        back once the request has arrived whole; else it goes back when the connection ends."""
        head, head_deadline = self._arrived.pop(request)
        pending = PendingSlot(self.gate.arrived)
        try:
            RequestHandler(request, client_address, self, pending, head, head_deadline)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            pending.release()
            self.shutdown_request(request)
            self.gate.closed(client_address)

    @contextmanager
    def serving(self, client: str = "") -> Iterator[None]:
        """One of the max_connections slots while a request that arrived whole is served, and one of its client
        address's max_client_requests; 503 when no slot is free, 429 when the client has all of its own."""
        limit = self.limits.max_client_requests
        with self._clients_lock:
            mine = self._client_requests[client]
            if mine < limit:
                self._client_requests[client] += 1
        if mine >= limit:
            raise RequestError(HTTPStatus.TOO_MANY_REQUESTS, f"this client has {limit} requests being served "
                               "(npuport serve --max-client-requests); retry shortly", None, "client_busy")
        try:
            if not self._serving.acquire(blocking=False):
                raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE, f"the server is serving "
                                   f"{self.limits.max_connections} requests; retry shortly", None, "server_busy")
            try:
                yield
            finally:
                self._serving.release()
        finally:
            with self._clients_lock:
                self._client_requests[client] -= 1
                if self._client_requests[client] <= 0:
                    del self._client_requests[client]

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed outside a request (a client that reset it): one line, no traceback."""
        error = sys.exc_info()[1]
        self.report(f"{client_address[0]}: connection dropped ({type(error).__name__}: {error})")

    def internal_error(self, where: str, error: BaseException) -> None:
        """Report a failure of the server's own (the details stay in the operator's log)."""
        frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
        at = f" (at {Path(frame.filename).name}:{frame.lineno})" if frame is not None else ""
        self.report(f"{where}: internal error: {type(error).__name__}: {error}{at}")


def make_server(runner: RuntimeCompletions, served_model: str, host: str = DEFAULT_HOST, port: int = 0,
                log: Log | None = None, *, limits: ServeLimits = DEFAULT_LIMITS, api_key: str | None = None,
                report: Log = print_to_stderr, aliases: tuple[str, ...] = (),
                invariant: bool = False, prefill_tokens: int | None = None) -> CompletionsServer:
    """A bound server (port 0: any free port; see `.url`); call `serve_forever()`, then `shutdown()`. Requests
    may name the model `served_model` or one of `aliases`; `invariant`: batch-invariant answers (batching.py);
    prefill_tokens: the most prompt positions an iteration of continuous batching prefills (continuous.py)."""
    return CompletionsServer((host, port), runner, served_model, limits=limits, api_key=api_key, log=log,
                             report=report, aliases=aliases, invariant=invariant, prefill_tokens=prefill_tokens)


def served_names(path: Path | str, served_model: str | None) -> tuple[str, tuple[str, ...]]:
    """The name a server of model folder `path` answers by - `served_model`, else the folder's own name (what
    /v1/models lists) - and the names a request may also use: the path as given (and as resolved), as a server
    that named the model by its path accepted before."""
    name = served_model or Path(path).resolve().name
    aliases = tuple(dict.fromkeys(a for a in (str(path), str(Path(path).resolve())) if a != name))
    return name, aliases


def freeze_startup_heap() -> None:
    """Move everything alive once the server has started - the model and its modules, kernels, graphs, tokenizer -
    to the collector's permanent generation, after one last collection, as vLLM's and sglang's servers do after
    their warm-up: a full collection then walks only what was allocated since. Python's full collections stop
    every thread, the model's worker included, for a time that grows with the objects they walk, and the requests
    a server parses and answers make them run now and then. The frozen objects are never collected: the server
    holds them for its life anyway."""
    gc.collect()
    gc.freeze()


def serve_model(path: Path | str, *, host: str = DEFAULT_HOST, port: int = 0, served_model: str | None = None,
                device: str | None = None, dtype: str = "bfloat16", mtp: int = 0, dispatch: str | None = None,
                max_batch_size: int = 16, batch_invariant: bool | None = None, prefill_tokens: int | None = None,
                limits: ServeLimits = DEFAULT_LIMITS, api_key: str | None = None, announce: Log = print,
                log: Log | None = None, warn: Log = print_to_stderr,
                shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Load the model folder `path` and serve it until interrupted (Ctrl-C, SIGTERM). `announce` gets one line
    naming the URL once the socket is bound (with port 0, the port the system chose), and the shutdown's lines;
    `warn` a warning when the address is reachable beyond loopback, and the details of internal errors; `log` one
    line per request. batch_invariant: every answer the one its request gets alone (each row generated in a call
    of its own, batch-invariant steps); None: off, the engine's default for the steps."""
    runner = RuntimeCompletions.load(path, device=device, dtype=dtype, batch_size=max_batch_size, mtp=mtp,
                                     dispatch=dispatch, invariant=batch_invariant)
    name, aliases = served_names(path, served_model)
    server = make_server(runner, name, host, port, log, limits=limits, api_key=api_key, report=warn,
                         aliases=aliases, invariant=bool(batch_invariant), prefill_tokens=prefill_tokens)
    freeze_startup_heap()
    warning = exposure_warning(server.server_address[0], key_required=api_key is not None)
    if warning is not None:
        warn(warning)
    world = runner.model.parallel.world
    devices = f"{runner.model.device} x {world}" if world > 1 else f"{runner.model.device}"
    rows = ("one row per call, batch-invariant" if batch_invariant
            else f"continuous batching of up to {max_batch_size} rows, "
                 f"{server.service.batcher.prefill_tokens} prompt tokens prefilled per step")
    announce(f"serving {path} as model {name!r} on {server.url}/v1 (device {devices}, {dtype}, MTP k={mtp}, {rows}); "
             f"Prometheus metrics on {server.url}/metrics; Ctrl-C stops it")
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM / SIGHUP as the command line raises them
        pass
    finally:
        server.stop(shutdown_timeout_s, announce)
