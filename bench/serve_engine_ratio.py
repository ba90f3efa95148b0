"""Benchmark: `npuport serve` under concurrent clients against the engine's own batch, same model, same prompts,
in the same run (issue 41's GPU acceptance: output tok/s of 32 clients >= 0.75x the engine's batch of 32).

    python -P bench/serve_engine_ratio.py --out DIR [--like 35B-A3B] [--layers 8] [--clients 32]
                                          [--prompt-tokens 512] [--new-tokens 64] [--requests-per-client 3]
                                          [--mtp 0,1] [--prefill-tokens default,16384] [--model ARTIFACT]

make-tiny --like at reduced depth (random weights), converted to W8A8 (or --model: an artifact), on the first
accelerator. For each MTP setting, one runtime:
- engine: measure_throughput of the --clients prompts as one generate call (greedy, new tokens each, ignore EOS):
  output tok/s of the whole call (its prefill included) and decode tok/s (the call without its prefill);
- serve: `npuport serve` of the same model and settings as a process of its own (`--max-batch-size` --clients);
  --clients client threads here, each sending --requests-per-client requests one after another (its own prompt,
  ignore_eos, the same new tokens), after one warm-up burst of every client once: output tokens over the wall time
  of the timed bursts. (Clients in the server's own process would share its interpreter lock with the worker that
  drives the model: on a CPU that cost a third of the throughput.) Also from serve's /metrics: the device graphs
  captured during the warm-up burst and during the timed ones, and the seconds the latter took; the mean seconds
  of a timed request as its client saw it and as the server measured it (from the request read whole to its
  answer): what lies between is HTTP and the clients; and what the batch did during the timed bursts: kernel
  tunings, prefill calls and their mean tokens, decode rounds and their mean rows, and the seconds those calls
  took (the rest of the timed wall time the worker spent on its own host work or waiting for requests).
  With several --prefill-tokens (serve's budget of prompt tokens per step; `default`: serve's own), one serve run
  each, against the same engine figure.
Prints and writes (DIR/serve_engine_ratio.json) every figure and the ratios serve / engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engines.engine_servers import free_port, get_text, post_json, serving  # noqa: E402


def artifact(args) -> Path:
    from npuport.convert.converter import convert_qwen35
    from npuport.fixtures.tiny_checkpoint import like_spec, make_tiny

    if args.model is not None:
        return args.model
    source = make_tiny(args.out / "source", like_spec(args.like, args.layers))
    return convert_qwen35(source, args.out / "w8a8", show_progress=False, log=lambda m: None, workers=4).out


def serve_command(path: Path, port: int, args, mtp: int, prefill_tokens: int | None) -> list[str]:
    command = [sys.executable, "-m", "npuport.cli", "serve", str(path), "--host", "127.0.0.1", "--port", str(port),
               "--max-batch-size", str(args.clients), "--max-client-requests", str(args.clients),
               "--max-connections", str(args.clients), "--mtp", str(mtp), "--dtype", args.dtype, "--quiet"]
    command += ["--prefill-tokens", str(prefill_tokens)] if prefill_tokens else []
    return command + (["--device", args.device] if args.device else [])


def prefill_budgets(text: str) -> list[int | None]:
    """--prefill-tokens' comma list: serve's budgets of prompt tokens per step (None for `default`, serve's own)."""
    return [None if item.strip() == "default" else int(item) for item in text.split(",")]


def client_prompts(clients: int, prompt_tokens: int) -> list[list[int]]:
    """Each client's prompt: `prompt_tokens` random token ids (seed 0)."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, 2000, (clients, prompt_tokens), generator=g).tolist()


def completion_tokens(url: str, prompt: list[int], new_tokens: int) -> int:
    """One client request to serve's /v1/completions (greedy, `new_tokens` whatever EOS says): the completion tokens
    it got."""
    body = {"prompt": [prompt], "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    return post_json(url + "/v1/completions", body)["usage"]["completion_tokens"]


def serve_throughput(command: list[str], port: int, log: Path, prompts: list[list[int]], new_tokens: int,
                     per_client: int) -> dict:
    with serving(command, port, log) as url:
        def client(prompt: list[int], requests: int) -> tuple[int, float]:
            made, waited = 0, 0.0
            for _ in range(requests):
                sent = time.perf_counter()
                made += completion_tokens(url, prompt, new_tokens)
                waited += time.perf_counter() - sent
            return made, waited

        with ThreadPoolExecutor(len(prompts)) as pool:
            list(pool.map(lambda p: client(p, 1), prompts))  # warm-up: graphs of the batch sizes met
            warm = served_counters(url)
            start = time.perf_counter()
            answers = list(pool.map(lambda p: client(p, per_client), prompts))
            seconds = time.perf_counter() - start
            timed = served_counters(url)
    tokens = sum(made for made, _ in answers)
    requests = timed["e2e_request_latency_seconds_count"] - warm["e2e_request_latency_seconds_count"]
    return {"output_tokens": tokens, "seconds": seconds, "output_tokens_per_s": tokens / seconds,
            "graph_captures_warm_up": warm["graph_captures_total"],
            "graph_captures_timed": timed["graph_captures_total"] - warm["graph_captures_total"],
            "graph_capture_seconds_timed": timed["graph_capture_seconds_total"] - warm["graph_capture_seconds_total"],
            "client_request_s_mean": sum(waited for _, waited in answers) / (len(prompts) * per_client),
            "server_request_s_mean": (timed["e2e_request_latency_seconds_sum"]
                                      - warm["e2e_request_latency_seconds_sum"]) / requests,
            **batch_shape(warm, timed)}


def batch_shape(warm: dict[str, float], timed: dict[str, float]) -> dict:
    """What serve's batch did between the two readings of its /metrics: kernel tunings, prefill calls and their
    mean tokens, decode rounds and their mean rows, and the seconds the prefill and the decode calls took."""
    def grew(name: str) -> float:
        return timed[name] - warm[name]

    chunks, rounds = grew("prefill_chunk_tokens_count"), grew("decode_round_rows_count")
    return {"kernel_tunings_timed": grew("kernel_tunings_total"), "prefill_calls_timed": chunks,
            "prefill_tokens_mean": grew("prefill_chunk_tokens_sum") / chunks if chunks else None,
            "decode_rounds_timed": rounds,
            "decode_rows_mean": grew("decode_round_rows_sum") / rounds if rounds else None,
            "prefill_seconds_timed": grew("prefill_seconds_total"),
            "decode_seconds_timed": grew("decode_seconds_total")}


COUNTERS = ("graph_captures_total", "graph_capture_seconds_total", "e2e_request_latency_seconds_sum",
            "e2e_request_latency_seconds_count", "kernel_tunings_total", "prefill_chunk_tokens_sum",
            "prefill_chunk_tokens_count", "decode_round_rows_sum", "decode_round_rows_count", "prefill_seconds_total",
            "decode_seconds_total")


def served_counters(url: str) -> dict[str, float]:
    """serve's /metrics so far: the COUNTERS samples (graph captures and kernel tunings, the requests answered and
    their latencies, the batch's prefill calls and decode rounds and their seconds) by name."""
    values = {}
    for line in get_text(url + "/metrics", timeout_s=30.0).splitlines():
        for name in COUNTERS:
            if line.startswith(f"npuport:{name}{{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--like", default="35B-A3B")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--mtp", default="0,1")
    parser.add_argument("--prefill-tokens", default="default",
                        help="serve's --prefill-tokens, a comma list, one serve run each (`default`: serve's own).")
    parser.add_argument("--device", default=None, help="Default: the first accelerator, else the CPU.")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from npuport.runtime.text_completions import RuntimeCompletions
    from npuport.runtime.validation.throughput import measure_throughput

    path = artifact(args)
    prompts = client_prompts(args.clients, args.prompt_tokens)
    summary: dict = {"like": args.like, "layers": args.layers, "clients": args.clients,
                     "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                     "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "runs": []}
    for k in [int(x) for x in args.mtp.split(",")]:
        runner = RuntimeCompletions.load(path, device=args.device, dtype=args.dtype, batch_size=args.clients, mtp=k)
        engine = measure_throughput(runner.model, prompts, args.new_tokens, mtp=k, label=f"mtp {k}", repeats=2)
        del runner  # the server loads its own
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        for budget in prefill_budgets(args.prefill_tokens):
            port = free_port()
            log = args.out / f"serve-mtp{k}-prefill{budget or 'default'}.log"
            served = serve_throughput(serve_command(path, port, args, k, budget), port, log, prompts,
                                      args.new_tokens, args.requests_per_client)
            run = {"mtp": k, "prefill_tokens": budget, "engine_output_tokens_per_s": engine.output_tokens_per_s,
                   "engine_decode_tokens_per_s": engine.decode_tokens_per_s, "serve": served,
                   "serve_vs_engine_output": served["output_tokens_per_s"] / engine.output_tokens_per_s,
                   "serve_vs_engine_decode": served["output_tokens_per_s"] / engine.decode_tokens_per_s}
            summary["runs"].append(run)
            print(json.dumps(run), flush=True)
            (args.out / "serve_engine_ratio.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
