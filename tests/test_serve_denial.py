"""No client of `npuport serve` can deny service to another: the audit's case over real loopback sockets - 800
reconnecting sockets dripping a header line a second and 500 idle ones, all from one address (127.0.0.2, which
Linux routes to the loopback like 127.0.0.1), while a client holding the API key sends 24 requests from 127.0.0.1:
all 24 are answered 200. The attacker runs in a process of its own (tests/serve_attacker.py) for a bounded time.
Also: the per-client limit on requests served at once (429), and its options on the command line."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from npuport.runtime.serving.limits import ServeLimits
from npuport.runtime.serving.serve import make_server
from npuport.runtime.text_completions import RuntimeCompletions
from tests.test_serve import KIND, running
from tests.test_serve_hostile_http import second_request_while_the_first_generates
from tests.test_serve_limits import PROMPT, address, exchange, openai_error

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

KEY = "k-41d05"
AUTHORIZED = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
ATTACKER = Path(__file__).with_name("serve_attacker.py")
ATTACK_SECONDS = 120  # the attacker stops by itself after this, whatever happens to the test


@pytest.fixture(scope="module")
def runner(tiny_artifacts) -> RuntimeCompletions:
    return RuntimeCompletions.load(tiny_artifacts[KIND], device="cpu", batch_size=4)


def second_loopback_usable() -> bool:
    import socket

    try:
        with socket.socket() as probe:
            probe.bind(("127.0.0.2", 0))
    except OSError:
        return False
    return True


def keyed_requests(url: str, count: int) -> list[tuple[int, float]]:
    """`count` completions with the key, one after another: (status, seconds) each."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2, "temperature": 0}).encode()
    done = []
    for _ in range(count):
        start = time.monotonic()
        try:
            status = exchange(url, "POST", "/v1/completions", body, AUTHORIZED)[0]
        except OSError as e:
            status = type(e).__name__
        done.append((status, time.monotonic() - start))
    return done


@pytest.mark.skipif(not sys.platform.startswith("linux") or not second_loopback_usable(),
                    reason="needs a second loopback address (127.0.0.2), as Linux has")
def test_800_dripping_and_500_idle_sockets_from_one_address_leave_every_keyed_request_answered(runner):
    limits = ServeLimits()  # the defaults, as `npuport serve` starts
    with running(make_server(runner, "tiny", limits=limits, api_key=KEY)) as url:
        quiet = keyed_requests(url, 8)  # the same requests without the attack, for the figures below
        host, port = address(url)
        attacker = subprocess.Popen([sys.executable, str(ATTACKER), "--source", "127.0.0.2", "--host", host,
                                     "--port", str(port), "--drippers", "800", "--idle", "500", "--seconds",
                                     str(ATTACK_SECONDS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert attacker.stdout.readline().strip() == "ready"
            time.sleep(2)  # two drips of every socket, and the churn of those displaced
            under_attack = keyed_requests(url, 24)
            attacker.stdin.close()  # it stops
            counts = json.loads(attacker.stdout.readline())
            attacker.wait(30)
        finally:
            if attacker.poll() is None:
                attacker.kill()
                attacker.wait()
    statuses = [status for status, _ in under_attack]
    attacked_s = [s for _, s in under_attack]
    print(f"quiet: median {statistics.median(s for _, s in quiet) * 1000:.1f} ms; under attack: median "
          f"{statistics.median(attacked_s) * 1000:.1f} ms, max {max(attacked_s) * 1000:.1f} ms; attacker: {counts}")
    assert statuses == [200] * 24, statuses
    assert counts["connections"] >= 1300 and counts["answered_503"] > 0  # it did connect, and was held back
    assert all(status == 200 for status, _ in quiet)


def test_a_client_over_its_requests_limit_gets_429_while_another_is_served(runner):
    """max_client_requests=1: a second request from the same address while its first is generating gets 429 at
    once, and the first is answered in full."""
    status, headers, raw, first_status = second_request_while_the_first_generates(
        runner, ServeLimits(max_client_requests=1), batch_size=4)
    assert status == 429 and headers.get("Retry-After") == "1"
    error = openai_error(raw)
    assert error["code"] == "client_busy" and "--max-client-requests" in error["message"]
    assert first_status == 200
