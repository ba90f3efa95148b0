"""validate --endpoint against servers that misbehave on purpose (real HTTP on 127.0.0.1): a bad answer costs
one question, not the run; answers are on disk as they arrive; a request has a wall-clock deadline;
Retry-After is honoured; once the endpoint is given up nothing more is sent."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from click.testing import CliRunner

from npuport.cli import main
from npuport.errors import EndpointError
from npuport.runtime.validation.endpoint import CompletionsEndpoint, EndpointGivenUp
from npuport.runtime.validation.endpoint_http import retry_after_seconds
from tests.test_endpoint import FAST, completion, scripted_server, serving

# ---------------------------------------------------------------------------------------------------------
# A server whose handler writes raw bytes, and the GSM8K questions it answers


@contextmanager
def raw_server(handle: Callable[[BaseHTTPRequestHandler, dict, int], None]) -> Iterator[tuple[str, list[float]]]:
    """An HTTP server on 127.0.0.1 calling handle(handler, request_json, request_number) for each POST, which
    writes whatever it likes to handler.wfile. Yields the base URL and the arrival time of each request."""
    arrivals: list[float] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                arrivals.append(time.monotonic())
                number = len(arrivals)
            try:
                handle(self, body, number)
            except OSError:  # the client hung up: what a cut connection looks like from here
                pass

        def log_message(self, *args: object) -> None:
            pass

    with serving(Handler) as url:
        yield url, arrivals


def send(handler: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
    handler.send_response(status)
    for name, value in {"Content-Type": "application/json", "Content-Length": str(len(body)),
                        **(headers or {})}.items():
        handler.send_header(name, value)
    handler.end_headers()
    handler.wfile.write(body)


NUM_QUESTIONS = 8


def gold(k: int) -> str:
    return str(10 * k + 7)


def write_gsm8k(path: Path, questions: int = NUM_QUESTIONS) -> Path:
    """One shot record, then question Qk? with gold gold(k) for each k (sglang scores records[1:])."""
    rows = [{"question": "Shot?", "answer": "s\n#### 1"}]
    rows += [{"question": f"Q{k}?", "answer": f"w\n#### {gold(k)}"} for k in range(questions)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def question_of(prompt: str) -> int:
    return int(re.findall(r"Question: Q(\d+)\?", prompt)[-1])


def answer_text(k: int) -> str:
    """Right for even questions, wrong for odd ones (sglang takes the last number)."""
    return f"so #### {gold(k) if k % 2 == 0 else 999}"


@pytest.fixture
def served_model(tmp_path: Path) -> Path:
    """The folder validate is told the server serves; with --endpoint only its checksum is read."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def validate_args(model: Path, url: str, data: Path, out: Path, questions: int = NUM_QUESTIONS,
                  parallel: int = 16) -> list[str]:
    return ["validate", "--gsm8k", str(model), "--endpoint", url, "--data", str(data), "--shots", "1",
            "--num-questions", str(questions), "--parallel", str(parallel), "--timeout", "30", "--retries", "0",
            "--out", str(out)]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------------------
# One malformed answer among 8


def test_one_malformed_answer_among_8_fails_that_question_only():
    def respond(body: dict, number: int) -> tuple[int, bytes]:
        return (200, b"<html>oops") if body["prompt"] == "p3" else (200, completion(f"t{body['prompt']}", 5))

    with scripted_server(respond) as (url, received):
        batch = CompletionsEndpoint(url, "m", parallel=3, retries=2, **FAST).complete(
            [f"p{k}" for k in range(8)], max_tokens=8)
    assert list(batch.failures) == [3] and "malformed JSON" in batch.failures[3]
    assert batch.texts == [f"tp{k}" if k != 3 else "" for k in range(8)]
    assert batch.completion_tokens == 7 * 5  # the answered ones
    assert len(received) == 8  # a malformed answer is not retried


def test_validate_records_the_failed_question_reports_it_and_fails_the_gate(served_model, tmp_path):
    def respond(body: dict, number: int) -> tuple[int, bytes]:
        k = question_of(body["prompt"])
        return (200, b'{"choices": [') if k == 3 else (200, completion(answer_text(k), 4))

    data, out = write_gsm8k(tmp_path / "gsm8k.jsonl"), tmp_path / "report"
    with scripted_server(respond) as (url, received):
        result = CliRunner().invoke(main, validate_args(served_model, url, data, out))
    assert result.exit_code == 1, result.output
    assert len(received) == NUM_QUESTIONS

    report = json.loads((out / "report.json").read_text())
    failed = report["failed_questions"][0]
    assert failed["questions"] == [3] and failed["failed"] == 1 and "malformed JSON" in failed["errors"]["3"]
    gate = next(g for g in report["gates"] if g["name"] == "every question answered")
    assert not gate["passed"] and "1 of 8 questions failed" in gate["detail"]
    # right: questions 0, 2, 4, 6; question 3 failed and scores as wrong
    assert report["gsm8k"][0]["candidate"]["scores"][0]["correct"] == [k % 2 == 0 for k in range(NUM_QUESTIONS)]
    assert report["gsm8k"][0]["candidate"]["accuracy"] == 4 / 8

    markdown = (out / "report.md").read_text()
    assert "1 of 8 questions FAILED" in markdown and "questions 3." in markdown and "answers.jsonl" in markdown
    rows = {r["question"]: r for r in read_jsonl(out / "answers.jsonl")}
    assert sorted(rows) == list(range(NUM_QUESTIONS)) and "malformed JSON" in rows[3]["error"]
    assert all(rows[k]["text"] == answer_text(k) for k in rows if k != 3)
    completions = read_jsonl(out / "completions.jsonl")
    assert [bool(r.get("error")) for r in completions] == [k == 3 for k in range(NUM_QUESTIONS)]
    assert "gate FAILED: every question answered" in result.output


def test_a_crash_loses_no_answer_already_received(served_model, tmp_path):
    """validate in a subprocess, killed with SIGKILL while the last question hangs: the 7 answers it got are
    on disk."""
    release = threading.Event()

    def respond(body: dict, number: int) -> tuple[int, bytes]:
        k = question_of(body["prompt"])
        if k == 7:
            release.wait(60)
        return 200, completion(answer_text(k), 3)

    data, out = write_gsm8k(tmp_path / "gsm8k.jsonl"), tmp_path / "report"
    answers = out / "answers.jsonl"
    with scripted_server(respond) as (url, _):
        process = subprocess.Popen([sys.executable, "-m", "npuport.cli", *validate_args(served_model, url, data, out)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and process.poll() is None:
                if answers.exists() and answers.read_text().count("\n") >= NUM_QUESTIONS - 1:
                    break
                time.sleep(0.1)
            assert process.poll() is None, process.stderr.read().decode()
            os.kill(process.pid, signal.SIGKILL)
            process.wait(10)
        finally:
            release.set()
            if process.poll() is None:
                process.kill()
            process.stderr.close()
    rows = read_jsonl(answers)
    assert sorted(r["question"] for r in rows) == list(range(NUM_QUESTIONS - 1))
    assert all(r["text"] == answer_text(r["question"]) and r["completion_tokens"] == 3 for r in rows)
    assert not (out / "report.json").exists()  # it did die before the end


# ---------------------------------------------------------------------------------------------------------
# A wall-clock deadline per request


def drip(handler: BaseHTTPRequestHandler, data: bytes, every_s: float = 0.1) -> None:
    for i in range(len(data)):
        handler.wfile.write(data[i:i + 1])
        handler.wfile.flush()
        time.sleep(every_s)


@pytest.mark.parametrize("part", ["headers", "body"])
def test_a_server_that_drips_bytes_is_cut_at_the_deadline(part):
    body = completion("42", 1)  # ~100 bytes: 10 s at 10 bytes a second

    def respond(handler: BaseHTTPRequestHandler, request: dict, number: int) -> None:
        head = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "\r\n").encode()
        if part == "headers":
            drip(handler, head + body)
        else:
            handler.wfile.write(head)
            drip(handler, body)

    with raw_server(respond) as (url, arrivals):
        endpoint = CompletionsEndpoint(url, "m", timeout_s=0.6, retries=1, backoff_s=0.01)
        start = time.monotonic()
        with pytest.raises(EndpointError, match=r"2 attempt.*no answer within 0.6 s"):
            endpoint.complete_one("p", max_tokens=8)
        elapsed = time.monotonic() - start
    assert len(arrivals) == 2
    assert 1.1 < elapsed < 2.5  # two attempts of 0.6 s, each cut at its deadline


# ---------------------------------------------------------------------------------------------------------
# Retry-After


@pytest.mark.parametrize("status", [429, 503])
def test_retry_after_seconds_is_honoured(status):
    def respond(handler: BaseHTTPRequestHandler, request: dict, number: int) -> None:
        if number == 1:
            send(handler, status, b'{"error": "busy"}', {"Retry-After": "1"})
        else:
            send(handler, 200, completion("42", 2))

    with raw_server(respond) as (url, arrivals):
        answer = CompletionsEndpoint(url, "m", retries=2, **FAST).complete_one("p", max_tokens=8)
    assert answer.text == "42"
    assert len(arrivals) == 2 and 0.95 <= arrivals[1] - arrivals[0] < 2.0  # not the 0.01 s backoff


def test_a_long_retry_after_is_capped():
    def respond(handler: BaseHTTPRequestHandler, request: dict, number: int) -> None:
        if number == 1:
            send(handler, 503, b"{}", {"Retry-After": "3600"})
        else:
            send(handler, 200, completion("42", 2))

    with raw_server(respond) as (url, arrivals):
        CompletionsEndpoint(url, "m", retries=1, max_retry_after_s=0.3, **FAST).complete_one("p", max_tokens=8)
    assert 0.28 <= arrivals[1] - arrivals[0] < 1.5


def test_retry_after_values_as_rfc_9110_writes_them():
    assert retry_after_seconds("7", cap=60) == 7
    assert retry_after_seconds("120", cap=60) == 60
    assert retry_after_seconds(formatdate(time.time() + 3600, usegmt=True), cap=5) == 5
    assert retry_after_seconds(formatdate(time.time() - 3600, usegmt=True), cap=5) == 0
    assert retry_after_seconds("soon", cap=5) is None and retry_after_seconds(None, cap=5) is None


# ---------------------------------------------------------------------------------------------------------
# Giving up


def test_nothing_is_sent_after_giving_up():
    """Question 0 fails for good at once; the others are waiting to retry 503s. Once given up (after one
    failure here), the waits end, requests in flight are cut and no request follows."""

    def respond(handler: BaseHTTPRequestHandler, request: dict, number: int) -> None:
        if request["prompt"] == "p0":
            time.sleep(0.3)  # the others are into their retries by then
            send(handler, 400, b'{"error": "bad request"}')
        else:
            send(handler, 503, b'{"error": "busy"}')

    with raw_server(respond) as (url, arrivals):
        endpoint = CompletionsEndpoint(url, "m", parallel=4, timeout_s=5, retries=6, backoff_s=0.1,
                                       failures_to_give_up=1)
        start = time.monotonic()
        with pytest.raises(EndpointGivenUp, match="in a row failed.*HTTP 400") as info:
            endpoint.complete([f"p{k}" for k in range(20)], max_tokens=8)
        ended = time.monotonic()
        sent = len(arrivals)
        time.sleep(1.0)  # the old backoffs (0.1 .. 3.2 s) would have sent more by now
        assert len(arrivals) == sent
    assert ended - start < 1.0
    assert list(info.value.answered) == [0]
    assert all(t <= ended for t in arrivals)


def test_a_server_failing_every_question_is_given_up_after_a_few():
    def respond(handler: BaseHTTPRequestHandler, request: dict, number: int) -> None:
        time.sleep(0.05)
        send(handler, 500, b'{"error": "down"}')

    with raw_server(respond) as (url, arrivals):
        endpoint = CompletionsEndpoint(url, "m", parallel=2, timeout_s=5, retries=0, failures_to_give_up=3)
        with pytest.raises(EndpointGivenUp, match=r"3 question\(s\) in a row failed.*HTTP 500") as info:
            endpoint.complete([f"p{k}" for k in range(40)], max_tokens=8)
        time.sleep(0.3)
        assert len(arrivals) <= 3 + 1  # the three failures and at most the one in flight beside them
    assert len(info.value.answered) == 3 and all(a.error for a in info.value.answered.values())


def test_validate_against_a_lost_server_ends_with_one_line_and_keeps_the_answers(served_model, tmp_path):
    """Questions 0-3 are answered, then the server answers 500 to everything: validate gives up after the
    default 8 failures in a row, exits 1 with one line naming the answers file, and keeps what it got."""

    def respond(body: dict, number: int) -> tuple[int, bytes]:
        k = question_of(body["prompt"])
        return (200, completion(answer_text(k), 2)) if k < 4 else (500, b"down")

    data, out = write_gsm8k(tmp_path / "gsm8k.jsonl", questions=20), tmp_path / "report"
    with scripted_server(respond) as (url, received):
        result = CliRunner().invoke(main, validate_args(served_model, url, data, out, questions=20, parallel=1))
    assert result.exit_code == 1 and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "stopped sending requests" in errors[0] and str(out / "answers.jsonl") in errors[0]
    rows = read_jsonl(out / "answers.jsonl")
    assert [r["question"] for r in rows] == list(range(12))  # one at a time: 4 answers, then 8 failures
    assert [r.get("text") for r in rows[:4]] == [answer_text(k) for k in range(4)]
    assert all("HTTP 500" in r["error"] for r in rows[4:])
    assert len(received) == 12  # questions 12-19 never sent
