"""A client that means harm, for tests/test_serve_denial.py, in a process of its own (so that its work does not
share the server's interpreter): from one source address, `--drippers` sockets that send a request line and then
one header line a second, never finishing, and `--idle` sockets that send nothing; a socket the server closes is
opened again at once. One thread over a selector; standard library only. It prints one line, "ready", once every
socket has been opened, and one line of JSON with its counts when it stops: after `--seconds`, or when its
standard input closes (the test ends)."""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import sys
import time

DRIP_EVERY_S = 1.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", required=True, help="the address to send from, e.g. 127.0.0.2")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--drippers", type=int, default=800)
    parser.add_argument("--idle", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()

    selector = selectors.DefaultSelector()
    selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    counts = {"connections": 0, "closed_by_server": 0, "answered_503": 0, "answered_other": 0, "connect_failed": 0}
    kinds: dict[socket.socket, str] = {}
    next_drip: dict[socket.socket, float] = {}

    def open_one(kind: str) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((args.source, 0))
            sock.settimeout(5)
            sock.connect((args.host, args.port))
            if kind == "drip":
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        except OSError:
            counts["connect_failed"] += 1
            sock.close()
            return
        sock.setblocking(False)
        counts["connections"] += 1
        kinds[sock] = kind
        next_drip[sock] = time.monotonic() + DRIP_EVERY_S
        selector.register(sock, selectors.EVENT_READ, "server")

    def lost(sock: socket.socket) -> None:
        kind = kinds.pop(sock)
        next_drip.pop(sock, None)
        selector.unregister(sock)
        sock.close()
        counts["closed_by_server"] += 1
        open_one(kind)

    for _ in range(args.idle):
        open_one("idle")
    for _ in range(args.drippers):
        open_one("drip")
    print("ready", flush=True)
    end = time.monotonic() + args.seconds
    while (now := time.monotonic()) < end:
        for key, _ in selector.select(timeout=0.05):
            if key.data == "stdin":
                if not sys.stdin.readline():
                    end = 0
                continue
            sock = key.fileobj
            try:
                data = sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if data.startswith(b"HTTP/"):
                counts["answered_503" if data.split()[1] == b"503" else "answered_other"] += 1
            if not data:
                lost(sock)
        now = time.monotonic()
        for sock in [s for s, due in next_drip.items() if due <= now and kinds.get(s) == "drip"]:
            next_drip[sock] = now + DRIP_EVERY_S
            try:
                sock.send(b"X-Drip: 1\r\n")
            except OSError:
                lost(sock)
    print(json.dumps({**counts, "open_at_end": len(kinds)}), flush=True)
    for sock in kinds:
        sock.close()


if __name__ == "__main__":
    main()
