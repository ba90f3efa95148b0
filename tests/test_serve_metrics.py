"""`GET /metrics` of `npuport serve`, read with prometheus_client's own parser of the text format: requests
waiting and running while a request is held at each stage, then the token counters, successes and the latency
and time-to-first-token histograms against the requests sent; and the startup line naming where it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from npuport.kernels.w8a8.gemm import TUNINGS
from npuport.runtime.graphs import CAPTURES
from npuport.runtime.serving.metrics import CONTENT_TYPE
from npuport.runtime.serving.serve import make_server
from npuport.runtime.text_completions import RuntimeCompletions
from tests.test_serve import KIND, START_TIMEOUT_S, post, running

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

PROMPT = "Question: 12 + 30 =\nAnswer:"


@pytest.fixture(scope="module")
def runner(tiny_artifacts) -> RuntimeCompletions:
    return RuntimeCompletions.load(tiny_artifacts[KIND], device="cpu", batch_size=4)


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics by name (+ its `le` for buckets), after checking the answer's content type and
    the model label."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        assert response.headers["Content-Type"] == CONTENT_TYPE
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("npuport:"), family.name
        for sample in family.samples:
            assert sample.labels.get("model_name") == "tiny"
            key = sample.name + (f"[{sample.labels['le']}]" if "le" in sample.labels else "")
            samples[key] = sample.value
    return samples


class Held(RuntimeCompletions):
    """The loaded model, stopping twice: before its first prefill (the request waits), and before its first decode
    step, once the prefill's first token is handed on (the request runs); the test lets it go on each time."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.waiting, self.running = threading.Event(), threading.Event()
        self.go_on = [threading.Event(), threading.Event()]

    def prefill_slots(self, *args, **kwargs):
        if not self.waiting.is_set():
            self.waiting.set()
            self.go_on[0].wait(60)
        return super().prefill_slots(*args, **kwargs)

    def decode_slots(self, *args, **kwargs):
        if not self.running.is_set():
            self.running.set()
            self.go_on[1].wait(60)
        return super().decode_slots(*args, **kwargs)


def test_metrics_count_what_was_sent_during_and_after_requests(runner):
    held = Held(runner.model, runner.tokenizer, runner.stop_tokens, batch_size=4,
                context_tokens=runner.context_tokens)
    with running(make_server(held, "tiny")) as url:
        before = scrape(url)
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(post, url, {"prompt": PROMPT, "max_tokens": 5, "temperature": 0})
            try:
                assert held.waiting.wait(60)
                waiting = scrape(url)
                held.go_on[0].set()
                assert held.running.wait(60)
                generating = scrape(url)
            finally:
                for event in held.go_on:
                    event.set()
            answers = [first.result()]
        answers += [post(url, {"prompt": [PROMPT, PROMPT + " 4"], "max_tokens": 3, "temperature": 0}),
                    post(url, {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "n": 2})]
        after = scrape(url)
    assert all(status == 200 for status, _ in answers), answers
    prompt_tokens = sum(a["usage"]["prompt_tokens"] for _, a in answers)
    completion_tokens = sum(a["usage"]["completion_tokens"] for _, a in answers)
    model = "npuport:"
    assert before[model + "num_requests_running"] == before[model + "num_requests_waiting"] == 0
    assert before[model + "prompt_tokens_total"] == before[model + "request_success_total"] == 0
    assert (waiting[model + "num_requests_waiting"], waiting[model + "num_requests_running"]) == (1, 0)
    assert waiting[model + "time_to_first_token_seconds_count"] == 0
    assert (generating[model + "num_requests_waiting"], generating[model + "num_requests_running"]) == (0, 1)
    assert generating[model + "time_to_first_token_seconds_count"] == 1
    assert after[model + "num_requests_running"] == after[model + "num_requests_waiting"] == 0
    assert after[model + "prompt_tokens_total"] == prompt_tokens
    assert after[model + "generation_tokens_total"] == completion_tokens == 5 + 2 * 3 + 2 * 2
    assert after[model + "request_success_total"] == 3
    for histogram in ("e2e_request_latency_seconds", "time_to_first_token_seconds"):
        assert after[f"{model}{histogram}_count"] == after[f"{model}{histogram}_bucket[+Inf]"] == 3
        assert after[f"{model}{histogram}_sum"] > 0
    assert after[model + "time_to_first_token_seconds_sum"] < after[model + "e2e_request_latency_seconds_sum"]


def test_a_streamed_request_is_counted_as_its_usage_says(runner):
    with running(make_server(runner, "tiny")) as url:
        request = urllib.request.Request(url + "/v1/completions", data=json.dumps({
            "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            events = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
        after = scrape(url)
    usage = json.loads(events[-2])["usage"]
    assert after["npuport:prompt_tokens_total"] == usage["prompt_tokens"]
    assert after["npuport:generation_tokens_total"] == usage["completion_tokens"] == 4
    assert after["npuport:time_to_first_token_seconds_count"] == after["npuport:request_success_total"] == 1


def test_the_startup_line_says_where_the_metrics_are(tiny_artifacts):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, "-m", "npuport.cli", "serve", str(tiny_artifacts[KIND]), "--port",
                                "0", "--device", "cpu", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, env=env)
    try:
        announced = process.stdout.readline()
        url = announced.split(" on ", 1)[1].split("/v1", 1)[0]
        assert f"Prometheus metrics on {url}/metrics;" in announced, announced
        with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
            assert b"npuport:num_requests_running" in response.read()
    finally:
        process.terminate()
        process.wait(START_TIMEOUT_S)


@pytest.mark.parametrize(("count", "name"), [(CAPTURES, "graph_capture"), (TUNINGS, "kernel_tuning")])
def test_graph_captures_and_kernel_tunings_and_their_seconds_are_counted(runner, count, name):
    """The counters read the one PauseCount every CapturedStep (or GEMM tuning) adds to (neither happens on a CPU:
    added here)."""
    with running(make_server(runner, "tiny")) as url:
        before = scrape(url)
        count.add(1.25)
        count.add(0.5)
        after = scrape(url)
    assert after[f"npuport:{name}s_total"] - before[f"npuport:{name}s_total"] == 2
    assert after[f"npuport:{name}_seconds_total"] - before[f"npuport:{name}_seconds_total"] == pytest.approx(1.75)


def test_prefill_chunks_and_decode_rounds_are_counted_as_decoding_one_token_a_round_implies(runner):
    """A lone request of P prompt tokens making N tokens (ignore_eos) prefills once, P tokens, and decodes N - 1
    rounds of one row (its first token comes from the prefill); one of n = 2 prefills its two rows together and
    decodes N - 1 rounds of two rows."""
    new = 6
    with running(make_server(runner, "tiny")) as url:
        before = scrape(url)
        status, alone = post(url, {"prompt": PROMPT, "max_tokens": new, "temperature": 0, "ignore_eos": True})
        assert status == 200, alone
        lone = scrape(url)
        status, pair = post(url, {"prompt": PROMPT, "max_tokens": new, "temperature": 0, "ignore_eos": True, "n": 2})
        assert status == 200, pair
        after = scrape(url)
    p = alone["usage"]["prompt_tokens"]
    assert alone["usage"]["completion_tokens"] == new

    def grew(name: str, since: dict, now: dict) -> float:
        return now[f"npuport:{name}"] - since.get(f"npuport:{name}", 0)

    assert grew("prefill_chunk_tokens_count", before, lone) == 1
    assert grew("prefill_chunk_tokens_sum", before, lone) == p
    assert grew("decode_round_rows_count", before, lone) == new - 1
    assert grew("decode_round_rows_sum", before, lone) == new - 1
    assert grew("decode_round_rows_bucket[1]", before, lone) == new - 1
    assert grew("prefill_chunk_tokens_count", lone, after) == 1
    assert grew("prefill_chunk_tokens_sum", lone, after) == 2 * p
    assert grew("decode_round_rows_count", lone, after) == new - 1
    assert grew("decode_round_rows_sum", lone, after) == 2 * (new - 1)
    assert grew("decode_round_rows_bucket[1]", lone, after) == 0
    for calls in ("prefill_seconds_total", "decode_seconds_total"):  # within the requests' own time, not nothing
        assert 0 < grew(calls, before, after) < after["npuport:e2e_request_latency_seconds_sum"]
