"""Benchmark: where the time of `npuport serve`'s continuous batch goes - the same clients as
bench/serve_engine_ratio.py, driving the batcher in this process, every call the worker makes to the
model timed - against the engine's batch of the same prompts, in the same run, for the batcher as it is, as it was
before, and both behind serve's HTTP server in this process with the clients asking over HTTP (--variants).

    python -P bench/serve_trace.py --model ARTIFACT --out DIR [--clients 32] [--prompt-tokens 512]
                                   [--new-tokens 64] [--requests-per-client 2] [--mtp 0,1]
                                   [--variants before,serve,http-before,http]

For the timed bursts (after one warm-up burst of every client once) it writes DIR/serve_trace-mtpK-VARIANT.json:
each call (open_slots, capture_decode_steps, prefill_slots, decode_slots, move_slots) with its start, seconds,
arguments (rows, width, slots, rounds) and the Triton kernels compiled and device graphs captured during it (a
fresh TRITON_CACHE_DIR counts compiles), and a summary: per call, its count, seconds in all, the slowest, and the
seconds of calls that compiled or captured; the int8 GEMM shapes tuned during the bursts; the worker's time
outside the model's calls (the host's own work); the seconds the batcher took to start (its prefill warm-up);
output tok/s of the bursts and of the engine's batch (measure_throughput).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="serve-trace-triton-"))

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve_engine_ratio import client_prompts, completion_tokens  # noqa: E402
from npuport.runtime.serving.limits import DEFAULT_LIMITS  # noqa: E402

TRACED = ("open_slots", "capture_decode_steps", "prefill_slots", "decode_slots", "move_slots")


def compiled_kernels() -> int:
    """Kernels Triton has compiled into its (fresh) cache folder so far."""
    root = Path(os.environ["TRITON_CACHE_DIR"])
    return sum(1 for entry in os.scandir(root) if entry.is_dir()) if root.exists() else 0


def call_arguments(name: str, args: tuple) -> dict:
    if name == "prefill_slots":
        first, chunk, width = args[:3]
        return {"first": first, "rows": len(chunk), "width": width, "tokens": sum(len(c.tokens) for c in chunk)}
    if name == "decode_slots":
        return {"n": args[0], "rounds": args[1]}
    if name == "move_slots":
        return {"slots": len(args[0])}
    return {}


class CallTrace:
    """Wraps the runner's slot calls: each one's seconds, arguments, compiles and captures, while `recording`."""

    def __init__(self, runner) -> None:
        from npuport.runtime.graphs import CAPTURES

        self.captures, self.calls, self.recording = CAPTURES, [], False
        self.origin = time.perf_counter()
        for name in TRACED:
            setattr(runner, name, self._timed(name, getattr(runner, name)))

    def _timed(self, name: str, call):
        def timed(*args, **kwargs):
            kernels, captures, start = compiled_kernels(), self.captures.count, time.perf_counter()
            result = call(*args, **kwargs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            if self.recording:
                self.calls.append({"call": name, "start": start - self.origin, "seconds": seconds,
                                   "compiled": compiled_kernels() - kernels,
                                   "captured": self.captures.count - captures, **call_arguments(name, args)})
            return result
        return timed


def summary(calls: list[dict], wall: float) -> dict:
    per_call = {}
    for name in TRACED:
        mine = [c for c in calls if c["call"] == name]
        if not mine:
            continue
        slow = [c for c in mine if c["compiled"] or c["captured"]]
        per_call[name] = {"count": len(mine), "seconds": sum(c["seconds"] for c in mine),
                          "slowest": max(mine, key=lambda c: c["seconds"]),
                          "compiling_or_capturing": len(slow), "their_seconds": sum(c["seconds"] for c in slow)}
    decodes = [c for c in calls if c["call"] == "decode_slots"]
    if decodes:
        per_call["decode_slots"]["mean_rows"] = sum(c["n"] * c["rounds"] for c in decodes) / sum(
            c["rounds"] for c in decodes)
        per_call["decode_slots"]["rounds"] = sum(c["rounds"] for c in decodes)
    in_calls = sum(c["seconds"] for c in calls)
    return {"wall_s": wall, "in_model_calls_s": in_calls, "outside_calls_s": wall - in_calls, "calls": per_call}


def in_process(batcher, new_tokens: int) -> Callable[[list[int]], int]:
    """A client's request straight to the batcher: the completion tokens it got."""
    from npuport.runtime.sampling import SamplingParams
    from npuport.runtime.serving.batching import Job
    from npuport.runtime.text_completions import TextRequest

    def ask(prompt: list[int]) -> int:
        job = Job([TextRequest(prompt, new_tokens, ignore_eos=True)], SamplingParams())
        return batcher.submit(job).result()[0].result.completion.completion_tokens
    return ask


def over_http(url: str, new_tokens: int) -> Callable[[list[int]], int]:
    """A client's request to serve's /v1/completions: the completion tokens it got."""
    return lambda prompt: completion_tokens(url, prompt, new_tokens)


def run_clients(ask: Callable[[list[int]], int], prompts: list[list[int]], per_client: int) -> int:
    """One client thread per prompt, each asking per_client times in turn; the tokens made in all."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return sum(pool.map(lambda prompt: sum(ask(prompt) for _ in range(per_client)), prompts))


@contextlib.contextmanager
def batch_of(runner, clients: int, http: bool, new_tokens: int) -> Iterator[Callable[[list[int]], int]]:
    """The batcher of `clients` rows over `runner` and how a client asks it: directly, or (http) through
    `npuport serve`'s server in this process, on a port of its own."""
    from npuport.runtime.serving.continuous import ContinuousBatcher
    from npuport.runtime.serving.serve import make_server

    if not http:
        batcher = ContinuousBatcher(runner, clients)
        try:
            yield in_process(batcher, new_tokens)
        finally:
            batcher.close()
        return
    limits = replace(DEFAULT_LIMITS, max_connections=clients, max_client_requests=clients,
                     max_client_connections=max(DEFAULT_LIMITS.max_client_connections, 2 * clients))
    server = make_server(runner, "trace", "127.0.0.1", 0, limits=limits)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield over_http(server.url, new_tokens)
    finally:
        server.shutdown()
        server.stop(5.0, lambda line: None)


def sync_every_rounds(left, prefilling: bool) -> int:
    """The batcher's decode rounds before they dropped to one while a group prefills."""
    from npuport.runtime.generate import SYNC_EVERY

    return min(SYNC_EVERY, min(left))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--mtp", default="0")
    parser.add_argument("--device", default=None)
    parser.add_argument("--variants", default="before,serve",
                        help="The batchers timed, in this order, comma-separated: 'serve' (as it is), 'before' (its "
                             "decode rounds SYNC_EVERY even while a group prefills, no prefill warm-up when it "
                             "starts, no new group waiting for more rows), 'http' and 'http-before' (the same behind "
                             "serve's HTTP server in this process, asked over HTTP: requests arrive as real clients "
                             "send them). GEMM tunings are kept for the process: time the 'before' ones first.")
    parser.add_argument("--gather-iterations", type=int, default=None,
                        help="The iterations a new group may wait for more rows in the 'serve' and 'http' variants "
                             "(default: the batcher's GATHER_ITERATIONS).")
    parser.add_argument("--settle-s", type=float, default=None,
                        help="How long apart requests to an idle batcher may arrive and still be taken together "
                             "(default: the batcher's SETTLE_S; 0: the first goes alone).")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from npuport.kernels.w8a8 import gemm
    from npuport.runtime.serving import continuous
    from npuport.runtime.text_completions import RuntimeCompletions
    from npuport.runtime.validation.throughput import measure_throughput

    prompts = client_prompts(args.clients, args.prompt_tokens)
    decode_rounds, gather_iterations = continuous.decode_rounds, continuous.GATHER_ITERATIONS  # as the batcher is
    gather = gather_iterations if args.gather_iterations is None else args.gather_iterations
    # variant -> (the batcher's decode rounds rule, whether it warms its prefill up, the iterations a new group may
    # wait for more rows, whether clients ask over HTTP)
    variants = {"serve": (decode_rounds, True, gather, False), "before": (sync_every_rounds, False, 0, False),
                "http": (decode_rounds, True, gather, True), "http-before": (sync_every_rounds, False, 0, True)}
    runs_triton = continuous.runs_triton
    if args.settle_s is not None:
        continuous.SETTLE_S = args.settle_s
    for k in [int(x) for x in args.mtp.split(",")]:
        runner = RuntimeCompletions.load(args.model, device=args.device, batch_size=args.clients, mtp=k)
        engine = measure_throughput(runner.model, prompts, args.new_tokens, mtp=k, label=f"mtp {k}", repeats=2)
        trace = CallTrace(runner)
        for variant in args.variants.split(","):
            continuous.decode_rounds, warm, continuous.GATHER_ITERATIONS, http = variants[variant]
            continuous.runs_triton = runs_triton if warm else (lambda device: False)
            made = time.perf_counter()
            with batch_of(runner, args.clients, http, args.new_tokens) as ask:
                warm_up_s = time.perf_counter() - made
                run_clients(ask, prompts, 1)
                trace.calls, trace.recording = [], True
                warm_captures, warm_kernels, warm_tuned = trace.captures.count, compiled_kernels(), gemm.TUNINGS.count
                start = time.perf_counter()
                tokens = run_clients(ask, prompts, args.requests_per_client)
                wall = time.perf_counter() - start
                trace.recording = False
            report = {"mtp": k, "variant": variant, "gather_iterations": continuous.GATHER_ITERATIONS,
                      "settle_s": continuous.SETTLE_S,
                      "batcher_start_s": warm_up_s,
                      "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                      "engine_output_tokens_per_s": engine.output_tokens_per_s,
                      "serve_output_tokens_per_s": tokens / wall,
                      "serve_vs_engine": tokens / wall / engine.output_tokens_per_s,
                      "captures_timed": trace.captures.count - warm_captures,
                      "kernels_compiled_timed": compiled_kernels() - warm_kernels,
                      "gemm_tunings_timed": gemm.TUNINGS.count - warm_tuned,
                      **summary(trace.calls, wall)}
            print(json.dumps(report, indent=1), flush=True)
            (args.out / f"serve_trace-mtp{k}-{variant}.json").write_text(
                json.dumps({**report, "trace": trace.calls}) + "\n")
        continuous.decode_rounds, continuous.GATHER_ITERATIONS = decode_rounds, gather_iterations
        continuous.runs_triton = runs_triton
        del runner, trace
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
