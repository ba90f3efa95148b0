"""`npuport serve` in its own process keeps its memory and threads flat over 200 clients that go away in the middle
of a stream: its resident set size and thread count (from /proc) after them as before them, once a first round has
warmed it up (allocator pools, the batch's caches)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.test_serve import KIND, START_TIMEOUT_S
from tests.test_serve_limits import PROMPT, address

CLIENTS = 200
AT_ONCE = 10
RSS_GROWTH_LIMIT_KB = 24 * 1024  # 120 kB per client: far below a leaked stream's thread, buffers or batch rows


def status_of(pid: int) -> tuple[int, int]:
    """(VmRSS in kB, threads) of process `pid`."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]), int(fields["Threads"])


def leave_mid_stream(url: str) -> bool:
    """A streamed completion of many tokens, read until its first token's chunk, then the connection closed."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 512, "temperature": 0, "stream": True}).encode()
    with socket.create_connection(address(url), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        while b'"text_completion"' not in received:
            chunk = sock.recv(4096)
            if not chunk:
                return False
            received += chunk
    return True


def idle(url: str, within_s: float = 60) -> bool:
    """Whether the server reports no request waiting or running (its cancelled rows have ended), within within_s."""
    import urllib.request

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
            text = response.read().decode()
        counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith(("npuport:num_requests_running", "npuport:num_requests_waiting"))]
        if counts and not any(counts):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_rss_and_threads_stay_flat_over_200_clients_leaving_mid_stream(tiny_artifacts):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, "-m", "npuport.cli", "serve", str(tiny_artifacts[KIND]), "--port",
                                "0", "--device", "cpu", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, env=env)
    try:
        url = process.stdout.readline().split(" on ", 1)[1].split("/v1", 1)[0]
        with ThreadPoolExecutor(AT_ONCE) as pool:
            assert all(pool.map(lambda _: leave_mid_stream(url), range(2 * AT_ONCE)))  # warm-up
            assert idle(url)
            time.sleep(0.5)  # the last handlers' threads end
            before = status_of(process.pid)
            start = time.monotonic()
            assert all(pool.map(lambda _: leave_mid_stream(url), range(CLIENTS)))
            took = time.monotonic() - start
            assert idle(url)
            time.sleep(0.5)
            after = status_of(process.pid)
    finally:
        process.terminate()
        process.wait(START_TIMEOUT_S)
    print(f"{CLIENTS} clients in {took:.1f} s: RSS {before[0]} -> {after[0]} kB, threads {before[1]} -> {after[1]}")
    assert after[1] == before[1]
    assert after[0] - before[0] < RSS_GROWTH_LIMIT_KB
