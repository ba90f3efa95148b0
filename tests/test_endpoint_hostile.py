"""validate --endpoint against servers that answer hostile bodies (real HTTP on 127.0.0.1): JSON that Python's
parser refuses past its limits, answers far larger than the request could need, fields of the wrong type, and
log-probabilities that are not numbers. Each costs one question (or ends the run with one line), never a traceback,
and the good answers are kept."""

from __future__ import annotations

import json
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

import pytest
from click.testing import CliRunner

from npuport.cli import main
from npuport.errors import EndpointError
from npuport.runtime.validation.endpoint import CompletionsEndpoint, QuestionFailed, served_models
from npuport.runtime.validation.endpoint_fidelity import EndpointLogprobs, logprob_fidelity
from tests.test_endpoint import FAST, completion, scripted_server, serving
from tests.test_endpoint_faults import (
    NUM_QUESTIONS,
    answer_text,
    question_of,
    raw_server,
    read_jsonl,
    served_model,  # noqa: F401 - a fixture
    validate_args,
    write_gsm8k,
)

DEEP = b"[" * 100_000 + b"]" * 100_000  # Python's json: RecursionError
LONG_INT = b'{"choices": [{"index": ' + b"9" * 5000 + b', "text": "7"}]}'  # int(): ValueError past 4300 digits
MiB = 1 << 20

# ---------------------------------------------------------------------------------------------------------
# Bodies Python's json refuses past its limits


@pytest.mark.parametrize("body", [DEEP, LONG_INT], ids=["nested-100000-deep", "int-of-5000-digits"])
def test_a_body_json_refuses_fails_that_question_and_the_others_are_kept(served_model, tmp_path, body):  # noqa: F811
    def respond(request: dict, number: int) -> tuple[int, bytes]:
        k = question_of(request["prompt"])
        return (200, body) if k == 3 else (200, completion(answer_text(k), 4))

    data, out = write_gsm8k(tmp_path / "gsm8k.jsonl"), tmp_path / "report"
    with scripted_server(respond) as (url, received):
        result = CliRunner().invoke(main, validate_args(served_model, url, data, out))
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    rows = {r["question"]: r for r in read_jsonl(out / "answers.jsonl")}
    assert sorted(rows) == list(range(NUM_QUESTIONS))
    assert "malformed JSON" in rows[3]["error"]
    assert all(rows[k]["text"] == answer_text(k) for k in rows if k != 3)
    report = json.loads((out / "report.json").read_text())
    assert report["failed_questions"][0]["questions"] == [3]
    assert "gate FAILED: every question answered" in result.output


@pytest.mark.parametrize("body", [DEEP, LONG_INT], ids=["nested-100000-deep", "int-of-5000-digits"])
def test_a_body_json_refuses_is_one_line_naming_the_url_and_not_retried(body):
    with scripted_server(lambda request, number: (200, body)) as (url, received):
        with pytest.raises(QuestionFailed, match=f"^{url}.*malformed JSON") as info:
            CompletionsEndpoint(url, "m", retries=3, **FAST).complete_one("p", max_tokens=8)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400
    assert len(received) == 1


# ---------------------------------------------------------------------------------------------------------
# Answers far larger than the request asked for


def stream_answer(handler: BaseHTTPRequestHandler, size: int, framing: str, sent: list[int],
                  every_s: float = 0.0) -> None:
    """A completion whose text makes the body `size` bytes, written 64 KiB at a time; `sent[0]` counts the bytes
    the socket took. framing: "length" (a Content-Length), "chunked", or "close" (the body ends at EOF)."""
    head = {"length": f"Content-Length: {size}\r\n", "chunked": "Transfer-Encoding: chunked\r\n",
            "close": "Connection: close\r\n"}[framing]
    handler.wfile.write(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{head}\r\n".encode())

    def write(data: bytes) -> None:
        handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if framing == "chunked" else data)
        sent[0] += len(data)

    opening, closing, block = b'{"choices": [{"index": 0, "text": "', b'"}]}', b"a" * (64 << 10)
    write(opening)
    remaining = size - len(opening) - len(closing)
    while remaining > 0:
        write(block[:remaining])
        remaining -= min(remaining, len(block))
        if every_s:
            time.sleep(every_s)
    write(closing)
    if framing == "chunked":
        handler.wfile.write(b"0\r\n\r\n")


@pytest.mark.parametrize("framing, size, every_s", [
    ("length", 1_500_000_000, 0.05),  # 1.5 GB declared, sent slowly: refused from the header alone
    ("chunked", 256 * MiB, 0.0),      # no length, sent as fast as the client reads
    ("close", 256 * MiB, 0.0),
])
@pytest.mark.parametrize("call", ["complete_one", "request"])
def test_an_answer_over_the_cap_fails_the_question_and_is_not_read_to_its_end(framing, size, every_s, call):
    sent, ended = [0], threading.Event()

    def respond(handler: BaseHTTPRequestHandler, request: dict, number: int) -> None:
        try:
            stream_answer(handler, size, framing, sent, every_s)
        finally:
            ended.set()

    with raw_server(respond) as (url, arrivals):
        endpoint = CompletionsEndpoint(url, "m", timeout_s=5, retries=2, backoff_s=0.01)
        tracemalloc.start()
        try:
            with pytest.raises(QuestionFailed, match=f"^{url}/v1/completions: answered more than .* bytes") as info:
                if call == "complete_one":
                    endpoint.complete_one("p", max_tokens=8)
                else:
                    endpoint.request({"prompt": [1, 2], "max_tokens": 8, "logprobs": 5})
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert ended.wait(30), "the server was never told the client hung up"
    assert "\n" not in str(info.value) and not info.value.unreachable
    assert len(arrivals) == 1  # a server that answers too much would again: not retried
    assert sent[0] < 64 * MiB < size  # the cap is about 1 MiB; the rest is what the sockets buffered
    assert peak < 64 * MiB


def test_validate_records_an_oversized_answer_as_that_questions_failure(served_model, tmp_path):  # noqa: F811
    """Question 3's answer is 64 MiB: it fails the 'every question answered' gate instead of passing it, and
    neither answers file holds it."""
    sent = [0]

    def respond(handler: BaseHTTPRequestHandler, request: dict, number: int) -> None:
        k = question_of(request["prompt"])
        if k == 3:
            stream_answer(handler, 64 * MiB, "chunked", sent)
        else:
            body = completion(answer_text(k), 4)
            handler.wfile.write(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)

    data, out = write_gsm8k(tmp_path / "gsm8k.jsonl"), tmp_path / "report"
    with raw_server(respond) as (url, arrivals):
        result = CliRunner().invoke(main, validate_args(served_model, url, data, out))
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), repr(result.exception)
    assert "gate FAILED: every question answered" in result.output
    rows = {r["question"]: r for r in read_jsonl(out / "answers.jsonl")}
    assert sorted(rows) == list(range(NUM_QUESTIONS)) and "answered more than" in rows[3]["error"]
    assert all(rows[k]["text"] == answer_text(k) for k in rows if k != 3)
    assert (out / "answers.jsonl").stat().st_size < MiB and (out / "completions.jsonl").stat().st_size < MiB


def test_the_cap_leaves_room_for_every_token_the_request_asked_for():
    """A long answer of max_tokens tokens, each of many escaped characters, with its top-5 log-probabilities
    listed by text, is read whole."""
    token = "\u4e2d" * 16  # \u4e2d sixteen times: 96 bytes of JSON a token
    tokens = 2048

    def respond(request: dict, number: int) -> tuple[int, bytes]:
        top = {f"{token}{j}": -1.0 - j for j in range(5)}
        logprobs = {"tokens": [token] * tokens, "token_logprobs": [-1.0] * tokens, "top_logprobs": [top] * tokens,
                    "text_offset": list(range(tokens))}
        return 200, json.dumps({"choices": [{"index": 0, "text": token * tokens, "logprobs": logprobs}]}).encode()

    with scripted_server(respond) as (url, _):
        answer = CompletionsEndpoint(url, "m", **FAST).request({"prompt": [1], "max_tokens": tokens, "logprobs": 5})
    assert len(answer["choices"][0]["logprobs"]["tokens"]) == tokens


# ---------------------------------------------------------------------------------------------------------
# Fields of the wrong type


@pytest.mark.parametrize("body, message", [
    (b'{"choices": "abc"}', "without choices"),
    (b'{"choices": ["abc"]}', "without choices"),
    (b'["choices"]', "without choices"),
    (b'{"choices": [{"text": 7}]}', "without text"),
    (b'{"choices": [{"text": null}]}', "without text"),
    (b'{"choices": [{"text": "\xff\xfe not utf-8"}]}', "malformed JSON"),
    (b"\xff\xfe\x00", "malformed JSON"),
    (b"", "malformed JSON"),
])
def test_an_answer_of_the_wrong_shape_fails_that_question_naming_the_url(body, message):
    def respond(request: dict, number: int) -> tuple[int, bytes]:
        return (200, body) if request["prompt"] == "p1" else (200, completion(request["prompt"], 2))

    with scripted_server(respond) as (url, received):
        batch = CompletionsEndpoint(url, "m", retries=3, **FAST).complete(["p0", "p1", "p2"], max_tokens=8)
    assert list(batch.failures) == [1] and message in batch.failures[1]
    assert batch.texts == ["p0", "", "p2"] and len(received) == 3


@pytest.mark.parametrize("usage", [
    {"completion_tokens": True}, {"completion_tokens": -3}, {"completion_tokens": 2.5},
    {"completion_tokens": "4"}, "4", [4],
])
def test_a_token_count_that_is_not_a_count_is_unknown(usage):
    body = json.dumps({"choices": [{"text": "42", "finish_reason": "stop"}], "usage": usage}).encode()
    with scripted_server(lambda request, number: (200, body)) as (url, _):
        batch = CompletionsEndpoint(url, "m", **FAST).complete(["p"], max_tokens=8)
    assert batch.texts == ["42"] and batch.failures == {}
    assert batch.completions[0].completion_tokens is None and batch.completion_tokens is None


# ---------------------------------------------------------------------------------------------------------
# Redirects


@contextmanager
def listener() -> Iterator[tuple[str, socket.socket]]:
    """A socket on 127.0.0.1 that accepts connections in the kernel and never answers; yields its host:port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}", sock
    finally:
        sock.close()


def was_connected(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        sock.accept()[0].close()
        return True
    except BlockingIOError:
        return False


def redirecting(status: int, location: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(status)
            self.send_header("Location", location)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_POST = answer  # noqa: N815 - http.server's names

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@pytest.mark.parametrize("status", [301, 302, 303, 307])
@pytest.mark.parametrize("scheme", ["ftp", "http"])
def test_a_redirect_fails_the_question_naming_where_it_points_and_is_not_followed(status, scheme):
    """urllib would follow a POST's 301-303 as a GET without its body, and to ftp:// outside the deadline."""
    with listener() as (elsewhere, sock), serving(redirecting(status, f"{scheme}://{elsewhere}/v1/x")) as url:
        with pytest.raises(QuestionFailed, match=f"^{url}/v1/completions: answered HTTP {status} .*redirect.*"
                                                 f"{scheme}://{elsewhere}/v1/x"):
            CompletionsEndpoint(url, "m", timeout_s=2, retries=1, backoff_s=0.01).complete_one("p", max_tokens=8)
        with pytest.raises(EndpointError, match=f"^{url}/v1/models: answered HTTP {status} .*redirect"):
            served_models(url, timeout_s=2)
        assert not was_connected(sock)


# ---------------------------------------------------------------------------------------------------------
# The model list


@pytest.mark.parametrize("body, message", [
    (DEEP, "no model list"),
    (b'{"data": [{"id": "' + b"m" * (4 * MiB) + b'"}]}', "more than"),
])
def test_a_hostile_model_list_is_one_line_naming_the_url(body, message):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except OSError:  # the client hung up
                pass

        def log_message(self, *args: object) -> None:
            pass

    with serving(Handler) as url:
        with pytest.raises(EndpointError, match=f"^{url}/v1/models: .*{message}"):
            served_models(url, timeout_s=5)


# ---------------------------------------------------------------------------------------------------------
# Log-probabilities (fidelity against a server)

PROMPT = [1, 2, 3]


def good_top(token: int) -> dict[str, float]:
    return {f"token_id:{token}": -0.25, "token_id:99": -2.0}


def logprobs_answer(request: dict, spoil=None) -> tuple[int, bytes]:
    """Greedy tokens 7, 8 after the prompt; with echo, the prompt's tokens and one new token, each with its top-2."""
    tokens = [*request["prompt"], 7][:len(request["prompt"]) + 1] if request.get("echo") else [7, 8]
    tops = [None if request.get("echo") and i == 0 else good_top(t) for i, t in enumerate(tokens)]
    logprobs = {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": [-0.25] * len(tokens),
                "top_logprobs": tops}
    if spoil is not None:
        spoil(logprobs)
    return 200, json.dumps({"choices": [{"index": 0, "text": "x", "logprobs": logprobs}]}).encode()


def set_top(value):
    def spoil(logprobs: dict) -> None:
        logprobs["top_logprobs"][1] = value
    return spoil


def set_field(name, value):
    def spoil(logprobs: dict) -> None:
        logprobs[name] = value
    return spoil


@pytest.mark.parametrize("spoil", [
    set_field("top_logprobs", "abc"),
    set_field("top_logprobs", [good_top(7)]),  # fewer than the tokens
    set_field("top_logprobs", None),
    set_top(["token_id:7", -0.1]),
    set_top({"token_id:7": "x"}),
    set_top({"token_id:7": None}),
    set_top({"token_id:7": True}),
    set_top({"token_id:7": 1000.0}),  # exp() overflows
    set_top({"token_id:7": float("nan")}),
    set_top({"token_id:7": float("-inf")}),
    set_top({"token_id:abc": -0.1}),
    set_top({"token_id:" + "9" * 5000: -0.1}),
    set_field("tokens", [7, 8]),
    set_field("tokens", ["token_id:7", None]),
], ids=["top-a-string", "top-too-short", "top-null", "top-a-list", "lp-a-string", "lp-null", "lp-a-bool",
        "lp-1000", "lp-nan", "lp-minus-inf", "id-not-a-number", "id-of-5000-digits", "tokens-numbers",
        "token-null"])
@pytest.mark.parametrize("request_kind", ["generate", "score"])
def test_log_probabilities_that_are_not_numbers_end_fidelity_with_one_line_naming_the_server(spoil, request_kind):
    def hostile(request: dict, number: int) -> tuple[int, bytes]:
        return logprobs_answer(request, spoil if bool(request.get("echo")) == (request_kind == "score") else None)

    with scripted_server(lambda request, number: logprobs_answer(request)) as (ref_url, _), \
            scripted_server(hostile) as (url, _):
        def side(u: str) -> EndpointLogprobs:
            return EndpointLogprobs(CompletionsEndpoint(u, "m", retries=0, **FAST))

        assert logprob_fidelity(side(ref_url), side(ref_url), [PROMPT], 2, (), 2).fidelity.mean_kl == 0.0
        with pytest.raises(EndpointError, match=f"^{url}/v1/completions: answered unusable log-probabilities") as e:
            logprob_fidelity(side(url), side(ref_url), [PROMPT], 2, (), 2)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400
