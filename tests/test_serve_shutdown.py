"""`npuport serve` as a real process stops promptly on SIGTERM or Ctrl-C (SIGINT): it says how many requests are in
flight, gives them --shutdown-timeout to finish, cancels the rest (a stream then ends with finish reason
"cancelled"), says "stopped" and exits within a few seconds. The served name is the model folder's own, and a
request naming the model by its path as given is served too."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from npuport.fixtures.train_tiny import trained_tiny_path

START_TIMEOUT_S = 120.0
EXIT_WITHIN_S = 10.0  # 1 s of --shutdown-timeout, the cancelled row's next stop check, the interpreter's exit


def started(model: str) -> tuple[subprocess.Popen, queue.Queue, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, "-m", "npuport.cli", "serve", model, "--port", "0", "--device", "cpu",
                                "--dtype", "float32", "--shutdown-timeout", "1"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            assert process.poll() is None, f"npuport serve exited with {process.returncode}"
            continue
        if " on http://" in line:
            return process, lines, line.split(" on ", 1)[1].split("/v1", 1)[0]
    process.kill()
    pytest.fail(f"npuport serve printed no URL within {START_TIMEOUT_S} s")


def request(url: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    with urllib.request.urlopen(urllib.request.Request(url + path, data=data, headers={
            "Content-Type": "application/json"}), timeout=60) as response:
        return json.loads(response.read())


@pytest.mark.parametrize(("signum", "busy"), [(signal.SIGTERM, True), (signal.SIGINT, False)])
def test_serve_stops_within_seconds_and_says_so(signum, busy):
    model = os.path.relpath(trained_tiny_path())
    process, lines, url = started(model)
    try:
        listed = [m["id"] for m in request(url, "/v1/models")["data"]]
        by_path = request(url, "/v1/completions", {"model": model, "prompt": "1 + 1 =", "max_tokens": 2})
        streamed: list[bytes] = []
        reader = None
        if busy:  # a stream of thousands of tokens, begun
            body = json.dumps({"prompt": "Question: 1 + 1 =", "max_tokens": 4000, "temperature": 0, "stream": True})
            answer = urllib.request.urlopen(urllib.request.Request(
                url + "/v1/completions", data=body.encode(), headers={"Content-Type": "application/json"}), timeout=60)
            streamed.append(answer.readline())
            reader = threading.Thread(target=lambda: streamed.append(answer.read()), daemon=True)
            reader.start()
        signalled = time.monotonic()
        process.send_signal(signum)
        process.wait(timeout=EXIT_WITHIN_S + 20)
        took = time.monotonic() - signalled
        if reader is not None:  # the stream's rest, read to its end: the server has exited, so it has ended
            reader.join(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = []
    while not lines.empty():
        output.append(lines.get())
    said = [line.strip() for line in output if line.startswith(("shutting down", "stopped"))]
    assert listed == ["tiny-trained"] and by_path["model"] == "tiny-trained"
    assert len(said) == 2, output
    assert said[0].startswith(f"shutting down: {int(busy)} requests in flight")
    assert said[1] == ("stopped (1 requests cancelled)" if busy else "stopped")
    assert took < EXIT_WITHIN_S, f"exited {took:.1f} s after {signal.Signals(signum).name}"
    if busy:
        time.sleep(0.5)
        assert b'"finish_reason": "cancelled"' in b"".join(streamed)
