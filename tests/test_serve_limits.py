"""`npuport serve` against a hostile client, over real sockets: what a request may ask for (max_tokens against
the limit and the model's context, prompt length, body size), how long a client may take, how many connections
it may hold, the API key, the warning when listening beyond loopback, and every error in the OpenAI shape with
none of the server's internals."""

from __future__ import annotations

import http.client
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from contextlib import closing

import pytest

from npuport.runtime.serving.http_handler import MAX_BODY_BYTES
from npuport.runtime.serving.limits import ServeLimits
from npuport.runtime.serving.serve import exposure_warning, make_server
from npuport.runtime.text_completions import RuntimeCompletions
from tests.test_serve import KIND, START_TIMEOUT_S, call, post, running

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}
PROMPT = "Question: 12 + 30 =\nAnswer:"


@pytest.fixture(scope="module")
def runner(tiny_artifacts) -> RuntimeCompletions:
    return RuntimeCompletions.load(tiny_artifacts[KIND], device="cpu", batch_size=4)


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def exchange(url: str, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request with http.client: status, headers, raw body."""
    with closing(http.client.HTTPConnection(*address(url), timeout=30)) as connection:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()


def openai_error(raw: bytes) -> dict:
    """The `error` object of an answer, after checking that the answer is the OpenAI error shape and nothing else."""
    data = json.loads(raw)
    assert set(data) == {"error"} and set(data["error"]) == OPENAI_ERROR_KEYS, data
    assert isinstance(data["error"]["message"], str) and "\n" not in data["error"]["message"]
    return data["error"]


def closed_by_server(sock: socket.socket, within_s: float) -> float | None:
    """Seconds until the server closed `sock` (EOF or reset), waiting at most within_s; None if it stayed open."""
    start = time.monotonic()
    while (left := within_s - (time.monotonic() - start)) > 0:
        readable, _, _ = select.select([sock], [], [], left)
        if readable:
            try:
                if sock.recv(4096) == b"":
                    return time.monotonic() - start
            except ConnectionError:
                return time.monotonic() - start
    return None


@pytest.mark.parametrize("max_tokens", [4_000_000, 1_000_000_000])
def test_max_tokens_over_the_limit_is_refused_before_anything_is_allocated(runner, max_tokens):
    with running(make_server(runner, "tiny")) as url:
        start = time.monotonic()
        status, answer = post(url, {"prompt": PROMPT, "max_tokens": max_tokens})
        elapsed = time.monotonic() - start
    assert status == 400 and elapsed < 5
    error = answer["error"]
    assert set(error) == OPENAI_ERROR_KEYS and error["param"] == "max_tokens"
    assert str(max_tokens) in error["message"] and "4096" in error["message"]


def test_max_tokens_up_to_the_limit_is_served_and_one_more_is_refused(runner):
    with running(make_server(runner, "tiny", limits=ServeLimits(max_tokens=6))) as url:
        ok, answer = post(url, {"prompt": PROMPT, "max_tokens": 6, "temperature": 0})
        refused, error = post(url, {"prompt": PROMPT, "max_tokens": 7, "temperature": 0})
    assert ok == 200 and answer["usage"]["completion_tokens"] <= 6
    assert refused == 400 and error["error"]["param"] == "max_tokens" and "6" in error["error"]["message"]


def test_prompt_and_max_tokens_are_bounded_by_the_models_context(tiny_artifacts, tmp_path):
    """The context is the model's own: a copy of the artifact whose config.json says 64 tokens is served with
    a max_tokens limit far above it, so only the context can refuse."""
    model = shutil.copytree(tiny_artifacts[KIND], tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (config.get("text_config") or config)["max_position_embeddings"] = context = 64
    (model / "config.json").write_text(json.dumps(config))
    small = RuntimeCompletions.load(model, device="cpu")
    prompt_tokens = len(small.tokenizer.encode(PROMPT))
    long_prompt = " 1" * context
    assert len(small.tokenizer.encode(long_prompt)) >= context
    with running(make_server(small, "tiny", limits=ServeLimits(max_tokens=10_000))) as url:
        fits, fits_answer = post(url, {"prompt": PROMPT, "max_tokens": context - prompt_tokens, "temperature": 0,
                                       "stop": ["never printed"]})
        over, over_answer = post(url, {"prompt": PROMPT, "max_tokens": context - prompt_tokens + 1})
        too_long, long_answer = post(url, {"prompt": long_prompt, "max_tokens": 1})
    assert fits == 200 and fits_answer["usage"]["prompt_tokens"] == prompt_tokens
    assert fits_answer["usage"]["prompt_tokens"] + fits_answer["usage"]["completion_tokens"] <= context
    assert over == 400 and over_answer["error"]["param"] == "max_tokens"
    assert over_answer["error"]["code"] == "context_length_exceeded" and str(context) in over_answer["error"]["message"]
    assert too_long == 400 and long_answer["error"]["param"] == "prompt"
    assert str(context) in long_answer["error"]["message"]


def test_a_body_over_the_size_limit_gets_413_in_the_openai_shape(runner):
    with running(make_server(runner, "tiny")) as url:
        with closing(http.client.HTTPConnection(*address(url), timeout=30)) as connection:
            connection.putrequest("POST", "/v1/completions")
            connection.putheader("Content-Type", "application/json")
            connection.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
            connection.endheaders(b'{"prompt": "')  # the server must answer without waiting for the rest
            response = connection.getresponse()
            status, raw = response.status, response.read()
    assert status == 413
    assert str(MAX_BODY_BYTES) in openai_error(raw)["message"]


@pytest.mark.parametrize(("body", "param"), [
    (b'{"prompt": "x", "seed": 1180591620717411303424}', "seed"),  # 2**70: torch's generator cannot take it
    (b'{"prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None),  # more digits than Python parses
    (b"[" * 100_000 + b"]" * 100_000, None),  # nesting deeper than the parser recurses
    (json.dumps({"prompt": ["x"] * 1000}).encode(), "prompt"),
    (json.dumps({"prompt": "x", "stop": [str(i) for i in range(1000)]}).encode(), "stop"),
], ids=["seed-2**70", "temperature-NaN", "5000-digits", "deep-nesting", "1000-prompts", "1000-stops"])
def test_malformed_fields_get_400_naming_the_field_never_a_500(runner, body, param):
    with running(make_server(runner, "tiny", report=lambda _: None)) as url:
        status, _, raw = exchange(url, "POST", "/v1/completions", body, {"Content-Type": "application/json"})
    assert status == 400, raw[:300]
    assert openai_error(raw)["param"] == param


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GET /v1/models extra HTTP/1.0\r\n\r\n", 400),  # http.server's own refusal of a malformed request line
    (b"GET /v1/models HTTP/1.0\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n", 431),  # a header line too long
    (b"PUT /v1/completions HTTP/1.0\r\nContent-Length: 0\r\n\r\n", 501),
    (b"GET /v1/nothing HTTP/1.0\r\n\r\n", 404),
], ids=["bad-request-line", "header-too-long", "unsupported-method", "no-such-path"])
def test_the_http_servers_own_refusals_are_in_the_openai_shape(runner, request_bytes, status):
    with running(make_server(runner, "tiny")) as url, socket.create_connection(address(url), timeout=10) as sock:
        sock.sendall(request_bytes)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert int(head.split()[1]) == status
    assert b"application/json" in head
    openai_error(body)


def test_an_internal_error_says_internal_error_and_the_details_go_to_the_log(runner):
    class OutOfMemory(RuntimeCompletions):
        """The loaded model, failing as an allocator does."""

        def prefill_slots(self, *args, **kwargs):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.40 GiB (/opt/models/secret/alloc.cpp:77)")

    failing = OutOfMemory(runner.model, runner.tokenizer, batch_size=1, context_tokens=runner.context_tokens)
    reported: list[str] = []
    with running(make_server(failing, "tiny", report=reported.append)) as url:
        status, _, raw = exchange(url, "POST", "/v1/completions", json.dumps({"prompt": PROMPT}).encode())
        still_up, _ = call(url + "/health")
    assert status == 500 and still_up == 200
    assert openai_error(raw)["message"] == "internal error"
    assert b"GiB" not in raw and b"/opt" not in raw and b"Traceback" not in raw
    assert len(reported) == 1 and "RuntimeError" in reported[0] and "2.40 GiB" in reported[0]


def test_a_client_that_sends_nothing_is_dropped_at_the_header_deadline(runner):
    """A second for the headers, a minute for the body: a client that sends nothing is dropped at the first."""
    limits = ServeLimits(header_timeout_s=1.0, request_timeout_s=60.0)
    with running(make_server(runner, "tiny", limits=limits)) as url:
        with socket.create_connection(address(url), timeout=10) as idle:
            closed_after = closed_by_server(idle, within_s=8)
    assert closed_after is not None and 0.8 <= closed_after < 4


@pytest.mark.parametrize(("phase", "limits"), [
    ("headers", ServeLimits(header_timeout_s=1.0, request_timeout_s=60.0)),
    ("body", ServeLimits(header_timeout_s=60.0, request_timeout_s=1.0)),
], ids=["headers", "body"])
def test_a_client_dripping_bytes_is_dropped_at_the_deadline_not_per_byte(runner, phase, limits):
    """A byte every 0.2 s never trips a per-read timeout of 1 s; the deadline of the part being sent (headers or
    body, each its own) must cut it anyway."""
    opening = b"POST /v1/completions HTTP/1.0\r\n"
    if phase == "body":
        opening += b"Content-Length: 100000\r\n\r\n"
    with running(make_server(runner, "tiny", limits=limits)) as url:
        with socket.create_connection(address(url), timeout=10) as sock:
            sock.sendall(opening)
            start, closed = time.monotonic(), False
            while not closed and time.monotonic() - start < 8:
                try:
                    sock.sendall(b"x" if phase == "body" else b"X")
                except OSError:
                    closed = True
                    break
                closed = closed_by_server(sock, within_s=0.2) is not None
            elapsed = time.monotonic() - start
    assert closed and elapsed < 4


def answer_status(sock: socket.socket, within_s: float) -> int | None:
    """The status of what the server wrote to `sock` before closing it (None: nothing within within_s)."""
    sock.settimeout(within_s)
    try:
        raw = sock.recv(4096)
    except OSError:
        return None
    return int(raw.split()[1]) if raw.startswith(b"HTTP/") else None


def test_connections_beyond_the_pending_limit_displace_the_oldest_idle_ones_and_hold_no_thread(runner):
    """12 idle connections against a limit of 2 still sending their requests: the gate holds them without a thread
    each; each newer one took the place of the oldest idle one, which was answered 503, and a real request
    (newest of all) is answered."""
    baseline = threading.active_count()
    limits = ServeLimits(max_pending_connections=2, header_timeout_s=20.0)
    with running(make_server(runner, "tiny", limits=limits)) as url:
        idle = []
        for _ in range(12):
            idle.append(socket.create_connection(address(url), timeout=10))
            time.sleep(0.02)  # in order of arrival
        try:
            time.sleep(0.5)  # let the server accept them all
            threads_while_flooded = threading.active_count()
            start = time.monotonic()
            status, _, raw = exchange(url, "GET", "/health")
            answered_in = time.monotonic() - start
            displaced = [answer_status(sock, within_s=2) for sock in idle]
        finally:
            for sock in idle:
                sock.close()
    # the serving thread, the batcher's worker and the gate: none per connection
    assert threads_while_flooded <= baseline + 1 + 1 + 1
    assert status == 200 and answered_in < 2, raw[:300]
    assert displaced == [503] * 11 + [None]  # the real request displaced the 11th; the 12th is still waiting


def test_with_an_api_key_requests_need_the_bearer_key(runner):
    key = "k-3f9a0c"
    with running(make_server(runner, "tiny", api_key=key)) as url:
        missing = exchange(url, "GET", "/v1/models")
        wrong = exchange(url, "GET", "/v1/models", headers={"Authorization": "Bearer k-3f9a0d"})
        not_bearer = exchange(url, "GET", "/v1/models", headers={"Authorization": key})
        refused_post = exchange(url, "POST", "/v1/completions", json.dumps({"prompt": PROMPT}).encode())
        right = exchange(url, "GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
        posted = exchange(url, "POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode(),
                          {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        health = exchange(url, "GET", "/health")
    for status, headers, raw in (missing, wrong, not_bearer, refused_post):
        assert status == 401 and headers.get("WWW-Authenticate") == "Bearer"
        assert openai_error(raw)["code"] == "invalid_api_key"
        assert key.encode() not in raw
    assert right[0] == 200 and json.loads(right[2])["data"][0]["id"] == "tiny"
    assert posted[0] == 200 and json.loads(posted[2])["object"] == "text_completion"
    assert health[0] == 200  # for load balancers, which hold no key


@pytest.mark.parametrize(("bound", "warned"), [("127.0.0.1", False), ("127.0.1.1", False), ("0.0.0.0", True),
                                                ("192.168.1.20", True)])
def test_only_addresses_beyond_loopback_are_warned_about(bound, warned):
    assert (exposure_warning(bound, key_required=False) is not None) == warned


def test_serve_on_every_network_warns_and_takes_its_key_from_the_environment(tiny_artifacts):
    """`npuport serve --host 0.0.0.0` as a user runs it: a warning on stderr, and NPUPORT_API_KEY enforced."""
    key = "env-key-51c2"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NPUPORT_API_KEY": key}
    process = subprocess.Popen([sys.executable, "-m", "npuport.cli", "serve", str(tiny_artifacts[KIND]), "--host",
                                "0.0.0.0", "--port", "0", "--device", "cpu", "--quiet"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        announced = process.stdout.readline()  # printed once the socket is bound, after any warning
        assert " on http://0.0.0.0:" in announced, announced + process.stderr.read()
        assert "(device cpu, float32, " in announced  # no --dtype: float32 on a CPU, and the line says so
        port = int(announced.split(" on http://0.0.0.0:", 1)[1].split("/", 1)[0])
        url = f"http://127.0.0.1:{port}"
        without = exchange(url, "GET", "/v1/models")
        with_key = exchange(url, "GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=START_TIMEOUT_S)
    warning = [line for line in stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "0.0.0.0" in warning[0] and "loopback" in warning[0]
    assert without[0] == 401 and with_key[0] == 200
    assert key not in stderr
