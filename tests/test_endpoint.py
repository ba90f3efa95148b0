"""The /v1/completions client against scripted HTTP servers on 127.0.0.1 (no other network)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from npuport.errors import EndpointError, NpuportError
from npuport.runtime.validation.endpoint import CompletionsEndpoint, completions_url
from npuport.runtime.validation.gsm8k import GSM8KRecord, SGLangProtocol

Reply = tuple[int, bytes]
FAST = {"timeout_s": 2.0, "backoff_s": 0.01}


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A real HTTP server with `handler` on 127.0.0.1 in a thread; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def scripted_server(respond: Callable[[dict, int], Reply]) -> Iterator[tuple[str, list[dict]]]:
    """An HTTP server on 127.0.0.1 answering POSTs with respond(request_json, request_number) -> (status, body).
    Yields its base URL and the list of requests it received."""
    received: list[dict] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                received.append({"path": self.path, **body})
                number = len(received)
            status, payload = respond(body, number)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    with serving(Handler) as url:
        yield url, received


def completion(text: str, tokens: int | None = None) -> bytes:
    data: dict = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": text,
                                                                       "finish_reason": "stop"}]}
    if tokens is not None:
        data["usage"] = {"prompt_tokens": 100, "completion_tokens": tokens, "total_tokens": 100 + tokens}
    return json.dumps(data).encode()


RECORDS = [
    GSM8KRecord("Q0?", "w\n#### 18"),
    GSM8KRecord("Q1?", "w\n#### 1,000"),
    GSM8KRecord("Q2?", "w\n#### -3"),
    GSM8KRecord("Q3?", "w\n#### 5"),
    GSM8KRecord("Q4?", "w\n#### 18"),
]
ANSWERS = {  # question -> (completion, completion tokens); judged by hand under the sglang rule
    "Q1": ("so 1,000 in all", 10),  # gold 1000 -> right
    "Q2": ("I think 4", 20),        # gold -3 -> wrong
    "Q3": ("no idea", 30),          # gold 5 -> invalid
    "Q4": ("#### 18", 40),          # gold 18 -> right
}


def test_endpoint_answers_score_as_computed_by_hand():
    def respond(body: dict, number: int) -> Reply:
        question = re.findall(r"Question: (Q\d)\?", body["prompt"])[-1]
        text, tokens = ANSWERS[question]
        time.sleep(0.01 * (5 - int(question[1])))  # answers arrive out of order
        return 200, completion(text, tokens)

    protocol = SGLangProtocol(RECORDS, shots=1)
    with scripted_server(respond) as (url, received):
        endpoint = CompletionsEndpoint(url, "qwen35-w8a8", parallel=3, **FAST)
        batch = endpoint.complete(protocol.prompts(4), max_tokens=protocol.max_new_tokens, stop=protocol.stop)
    result = protocol.score(batch.texts, latency_s=batch.latency_s, completion_tokens=batch.completion_tokens)

    assert batch.texts == ["so 1,000 in all", "I think 4", "no idea", "#### 18"]
    assert result.correct == [True, False, False, True]
    assert result.accuracy == 0.5
    assert result.invalid_rate == 0.25
    assert result.completion_tokens == 100
    assert batch.latency_s > 0 and result.output_throughput == pytest.approx(100 / batch.latency_s)
    assert len(received) == 4
    for request in received:
        assert request["path"] == "/v1/completions"
        assert request["model"] == "qwen35-w8a8"
        assert request["max_tokens"] == 512 and request["temperature"] == 0
        assert request["stop"] == ["Question", "Assistant:", "<|separator|>"]
    assert sorted(r["prompt"] for r in received) == sorted(protocol.prompts(4))


@pytest.mark.parametrize("status", [500, 503, 429])
def test_server_errors_are_retried_until_an_answer(status):
    def respond(body: dict, number: int) -> Reply:
        return (status, b'{"error": "busy"}') if number <= 2 else (200, completion("42", 3))

    with scripted_server(respond) as (url, received):
        answer = CompletionsEndpoint(url, "m", retries=3, **FAST).complete_one("p", max_tokens=8)
    assert answer.text == "42" and answer.completion_tokens == 3
    assert len(received) == 3


def test_retries_run_out_with_an_error_naming_the_url():
    with scripted_server(lambda body, n: (500, b"boom")) as (url, received):
        with pytest.raises(EndpointError, match=re.escape(url) + r".*3 attempt.*HTTP 500"):
            CompletionsEndpoint(url, "m", retries=2, **FAST).complete(["p"], max_tokens=8)
    assert len(received) == 3


def test_a_server_that_never_answers_times_out():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections in the kernel, never reads or answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        start = time.perf_counter()
        with pytest.raises(EndpointError, match=re.escape(url) + r".*2 attempt.*no answer within 0.2 s"):
            CompletionsEndpoint(url, "m", timeout_s=0.2, retries=1, backoff_s=0.01).complete_one("p", max_tokens=8)
        assert time.perf_counter() - start < 3
    finally:
        listener.close()


def test_a_closed_port_is_reported_as_unreachable():
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(EndpointError, match=re.escape(url) + r".*unreachable") as info:
        CompletionsEndpoint(url, "m", retries=1, **FAST).complete(["a", "b"], max_tokens=8)
    assert isinstance(info.value, NpuportError)


@pytest.mark.parametrize("body, message", [
    (b"<html>not json", "malformed JSON"),
    (b'{"choices": []}', "without choices"),
    (b'{"object": "error"}', "without choices"),
    (b'{"choices": [{"index": 0}]}', "without text"),
])
def test_unusable_answers_fail_at_once_naming_the_url(body, message):
    with scripted_server(lambda b, n: (200, body)) as (url, received):
        with pytest.raises(EndpointError, match=re.escape(url) + ".*" + message):
            CompletionsEndpoint(url, "m", retries=3, **FAST).complete_one("p", max_tokens=8)
    assert len(received) == 1


def test_a_client_error_is_not_retried():
    with scripted_server(lambda b, n: (400, b'{"error": "bad model"}')) as (url, received):
        with pytest.raises(EndpointError, match="HTTP 400.*bad model"):
            CompletionsEndpoint(url, "m", **FAST).complete_one("p", max_tokens=8)
    assert len(received) == 1


def test_missing_usage_leaves_the_token_count_unknown():
    with scripted_server(lambda b, n: (200, completion("7"))) as (url, _):
        batch = CompletionsEndpoint(url, "m", **FAST).complete(["a", "b"], max_tokens=8)
    assert batch.texts == ["7", "7"]
    assert batch.completion_tokens is None


@pytest.mark.parametrize("given, url", [
    ("http://127.0.0.1:30000", "http://127.0.0.1:30000/v1/completions"),
    ("http://127.0.0.1:30000/", "http://127.0.0.1:30000/v1/completions"),
    ("http://127.0.0.1:30000/v1", "http://127.0.0.1:30000/v1/completions"),
    ("http://127.0.0.1:30000/v1/completions", "http://127.0.0.1:30000/v1/completions"),
])
def test_completions_url_accepts_the_usual_forms(given, url):
    assert completions_url(given) == url


def test_a_url_without_scheme_is_refused():
    with pytest.raises(EndpointError, match="not an http"):
        completions_url("127.0.0.1:30000")
