"""`GET /metrics` of `npuport serve`: what the server is doing, in Prometheus' text exposition format (version
0.0.4), named in the style of vLLM's and sglang's metrics under our own `npuport:` prefix, each labelled with the
served model's name:

- `npuport:num_requests_running` (gauge): requests whose generation has begun (a first token made), not answered
  yet; `npuport:num_requests_waiting` (gauge): requests handed to the model that have no token yet;
- `npuport:prompt_tokens_total`, `npuport:generation_tokens_total` (counters): the prompt and completion tokens of
  the requests answered in full, as their `usage` counts them;
- `npuport:request_success_total` (counter): requests answered in full;
- `npuport:e2e_request_latency_seconds`, `npuport:time_to_first_token_seconds` (histograms): from the request
  having arrived whole to its answer's end, and to its first token;
- `npuport:graph_captures_total`, `npuport:graph_capture_seconds_total` (counters): the device graphs captured
  since the server started (a decode batch size or MTP round met for the first time) and the seconds their
  captures took, the model's steps waiting meanwhile; `npuport:kernel_tunings_total`,
  `npuport:kernel_tuning_seconds_total` (counters): the same for the int8 GEMM's tile tunings (a shape class met
  for the first time);
- `npuport:prefill_chunk_tokens`, `npuport:decode_round_rows` (histograms): the prompt tokens of each prefill call
  of the continuous batch and the rows of each of its decode rounds (an MTP round with MTP) - how well requests
  batch: `_sum / _count` of the second is the mean rows a round; `npuport:prefill_seconds_total`,
  `npuport:decode_seconds_total` (counters): the seconds those calls took, to their tokens on the host - the rest
  of the worker's time is its own host work or waiting for requests. They stay at zero with `--batch-invariant`,
  which runs each request alone.

Written by hand rather than with the prometheus_client library: the format is a few lines of text, and the server
adds no dependency to every install for it (the tests read it with that library's parser)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence

from npuport.devices import PauseCount
from npuport.kernels.w8a8.gemm import TUNINGS
from npuport.runtime.graphs import CAPTURES

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "npuport:"
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
PREFILL_CHUNK_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DECODE_ROWS_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256)


def label_value(text: str) -> str:
    """A label's value as the text format quotes it."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Histogram:
    """Observations counted into cumulative buckets (upper bounds `bounds`, then +Inf), with their sum."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.sum += value * times
        self.counts[next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))] += times

    def lines(self, name: str, labels: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += count
            out.append(f'{name}_bucket{{{labels},le="{number(bound)}"}} {total}')
        return [*out, f"{name}_sum{{{labels}}} {number(self.sum)}", f"{name}_count{{{labels}}} {total}"]


class Request:
    """One request's passage through the model, as the metrics see it: `first_token` when its first token is made
    (from the model's worker thread), `done` once it is answered or given up."""

    def __init__(self, metrics: ServeMetrics, arrived: float) -> None:
        self.metrics, self.arrived = metrics, arrived
        self.running = self.finished = False

    def first_token(self) -> None:
        if self.running or self.finished:
            return
        with self.metrics.lock:
            if self.running or self.finished:
                return
            self.running = True
            self.metrics.waiting -= 1
            self.metrics.running += 1
            self.metrics.ttft.observe(time.monotonic() - self.arrived)

    def done(self, prompt_tokens: int = 0, completion_tokens: int = 0, success: bool = False) -> None:
        m = self.metrics
        with m.lock:
            if self.finished:
                return
            self.finished = True
            if self.running:
                m.running -= 1
            else:
                m.waiting -= 1
            m.prompt_tokens += prompt_tokens
            m.generation_tokens += completion_tokens
            if success:
                m.successes += 1
                m.latency.observe(time.monotonic() - self.arrived)


class ServeMetrics:
    """The counts behind /metrics for the model served as `model_name`; thread-safe."""

    def __init__(self, model_name: str) -> None:
        self.labels = f'model_name="{label_value(model_name)}"'
        self.lock = threading.Lock()
        self.running = self.waiting = 0
        self.prompt_tokens = self.generation_tokens = self.successes = 0
        self.ttft, self.latency = Histogram(TTFT_BUCKETS_S), Histogram(LATENCY_BUCKETS_S)
        self.chunk_tokens, self.round_rows = Histogram(PREFILL_CHUNK_BUCKETS), Histogram(DECODE_ROWS_BUCKETS)
        self.prefill_seconds = self.decode_seconds = 0.0

    # the continuous batcher's steps (its StepObserver)
    def prefilled(self, tokens: int, seconds: float) -> None:
        with self.lock:
            self.chunk_tokens.observe(tokens)
            self.prefill_seconds += seconds

    def decoded(self, rows: int, rounds: int, seconds: float) -> None:
        with self.lock:
            self.round_rows.observe(rows, rounds)
            self.decode_seconds += seconds

    def submitted(self, arrived: float) -> Request:
        """A request handed to the model (it waits until its first token), which arrived whole at `arrived`
        (time.monotonic())."""
        with self.lock:
            self.waiting += 1
        return Request(self, arrived)

    def exposition(self) -> str:
        """Every metric, in the text format."""
        labels = self.labels
        with self.lock:
            families = [
                ("num_requests_running", "gauge", "Requests whose generation has begun, not answered yet.",
                 [f"{PREFIX}num_requests_running{{{labels}}} {self.running}"]),
                ("num_requests_waiting", "gauge", "Requests handed to the model that have no token yet.",
                 [f"{PREFIX}num_requests_waiting{{{labels}}} {self.waiting}"]),
                ("prompt_tokens_total", "counter", "Prompt tokens of the requests answered (as their usage counts).",
                 [f"{PREFIX}prompt_tokens_total{{{labels}}} {self.prompt_tokens}"]),
                ("generation_tokens_total", "counter", "Tokens generated for the requests answered.",
                 [f"{PREFIX}generation_tokens_total{{{labels}}} {self.generation_tokens}"]),
                ("request_success_total", "counter", "Requests answered in full.",
                 [f"{PREFIX}request_success_total{{{labels}}} {self.successes}"]),
                ("e2e_request_latency_seconds", "histogram", "Seconds from a request arriving whole to its answer's "
                 "end.", self.latency.lines(f"{PREFIX}e2e_request_latency_seconds", labels)),
                ("time_to_first_token_seconds", "histogram", "Seconds from a request arriving whole to its first "
                 "token.", self.ttft.lines(f"{PREFIX}time_to_first_token_seconds", labels)),
                ("prefill_chunk_tokens", "histogram", "Prompt tokens of each prefill call of the batch.",
                 self.chunk_tokens.lines(f"{PREFIX}prefill_chunk_tokens", labels)),
                ("decode_round_rows", "histogram", "Rows of each decode round of the batch (an MTP round with MTP).",
                 self.round_rows.lines(f"{PREFIX}decode_round_rows", labels)),
                ("prefill_seconds_total", "counter", "Seconds the batch's prefill calls took, to their first tokens.",
                 [f"{PREFIX}prefill_seconds_total{{{labels}}} {number(self.prefill_seconds)}"]),
                ("decode_seconds_total", "counter", "Seconds the batch's decode calls took, to their tokens.",
                 [f"{PREFIX}decode_seconds_total{{{labels}}} {number(self.decode_seconds)}"]),
            ]
        families += pauses("graph_capture", "Device graphs captured", CAPTURES, labels)
        families += pauses("kernel_tuning", "int8 GEMM shape classes whose tiles were tuned", TUNINGS, labels)
        lines = []
        for name, kind, help_text, samples in families:
            lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}", *samples]
        return "\n".join(lines) + "\n"


def pauses(name: str, what: str, count: PauseCount, labels: str) -> list[tuple[str, str, str, list[str]]]:
    """The two counter families of one kind of one-off work: how many were done, and their seconds."""
    with count.lock:
        return [(f"{name}s_total", "counter", f"{what} (the model's steps wait meanwhile).",
                 [f"{PREFIX}{name}s_total{{{labels}}} {count.count}"]),
                (f"{name}_seconds_total", "counter", f"Seconds they took: {what[0].lower()}{what[1:]}.",
                 [f"{PREFIX}{name}_seconds_total{{{labels}}} {number(count.seconds)}"])]
