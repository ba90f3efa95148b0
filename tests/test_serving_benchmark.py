"""bench/engines/serving_benchmark.py without servers or the vLLM venv: the client's arguments for a workload, and
hand-written results of vLLM's serving benchmark client (the keys its JSON has) made into the table, with
npuport/vLLM ratios, and into the problems that say a run did not do the work asked."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.engines.serving_benchmark import Workload, concurrency_list, engine_list, problems, table


def client_result(completed: int = 4, output_tokens: int = 256, failed: int = 0, throughput: float = 100.0,
                  ttft: float = 50.0, input_lens: tuple[int, ...] = (256,) * 4, errors: tuple[str, ...] = ()
                  ) -> dict:
    """The part of `vllm bench serve --save-result --save-detailed`'s JSON the table and the checks read."""
    return {"completed": completed, "failed": failed, "total_input_tokens": sum(input_lens),
            "total_output_tokens": output_tokens, "duration": 2.0, "request_throughput": completed / 2.0,
            "output_throughput": throughput, "mean_ttft_ms": ttft, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft,
            "mean_tpot_ms": 6.0, "median_tpot_ms": 6.0, "p99_tpot_ms": 7.0, "mean_itl_ms": 6.0,
            "median_itl_ms": 0.1, "p99_itl_ms": 60.0, "median_e2el_ms": 400.0, "input_lens": list(input_lens),
            "errors": list(errors)}


def rows(markdown: str) -> dict[str, list[str]]:
    """The table's rows by their measure, each row's cells after the first."""
    lines = markdown.splitlines()
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines)}


def test_table_puts_engines_side_by_side_with_npuport_over_vllm():
    results = {1: {"npuport": client_result(throughput=150.0, ttft=40.0), "vllm": client_result(ttft=80.0)},
               8: {"npuport": client_result(throughput=300.0), "vllm": client_result(throughput=600.0)}}
    by_measure = rows(table(results))
    assert by_measure["measure"] == ["npuport c=1", "vLLM c=1", "npuport/vLLM",
                                     "npuport c=8", "vLLM c=8", "npuport/vLLM"]
    assert by_measure["output throughput (tok/s)"] == ["150.0", "100.0", "1.50x", "300.0", "600.0", "0.50x"]
    assert by_measure["mean TTFT (ms)"][:3] == ["40.0", "80.0", "0.50x"]
    assert by_measure["p99 TTFT (ms)"][:3] == ["80.0", "160.0", "0.50x"]
    assert by_measure["input tokens"] == ["1,024", "1,024", "", "1,024", "1,024", ""]  # counts: no ratio


def test_table_of_one_engine_has_no_ratio_column():
    by_measure = rows(table({1: {"npuport": client_result()}, 8: {"npuport": client_result()}}))
    assert by_measure["measure"] == ["npuport c=1", "npuport c=8"]
    assert by_measure["request throughput (req/s)"] == ["2.000", "2.000"]


def test_missing_figure_shows_as_dash():
    result = client_result()
    del result["p99_itl_ms"]
    assert rows(table({1: {"npuport": result, "vllm": client_result()}}))["p99 ITL (ms)"] == ["-", "60.00", ""]


def test_runs_that_did_the_work_asked_have_no_problems():
    results = {1: {"npuport": client_result(), "vllm": client_result()}}
    assert problems(results, {1: Workload(256, 64, 4, 1)}) == []


def test_problems_name_failures_short_outputs_and_different_prompts():
    error = "Traceback (most recent call last):\n  ...\naiohttp.ClientResponseError: 400, message='Bad Request'\n"
    results = {8: {"npuport": client_result(completed=3, output_tokens=192, failed=1, errors=("", error),
                                            input_lens=(256, 256, 256)),
                   "vllm": client_result(output_tokens=250)}}
    found = problems(results, {8: Workload(256, 64, 4, 8)})
    assert found == ["npuport c=8: 1 requests failed; first error: aiohttp.ClientResponseError: 400, "
                     "message='Bad Request'",
                     "vLLM c=8: 250 output tokens for 4 requests of 64",
                     "c=8: the engines counted different prompt lengths (npuport: 768, vllm: 1024 tokens in all)"]


def test_client_arguments_fix_lengths_ignore_eos_and_keep_details():
    arguments = Workload(256, 64, 32, 8).client_arguments("http://127.0.0.1:1234", Path("model"), "npuport",
                                                          Path("out") / "npuport-c8.json")
    pairs = dict(zip(arguments[::2], arguments[1::2], strict=False))
    assert "--ignore-eos" in arguments and "--save-detailed" in arguments
    assert pairs["--endpoint"] == "/v1/completions" and pairs["--served-model-name"] == "npuport"
    for option, value in [("--random-input-len", "256"), ("--random-output-len", "64"), ("--num-prompts", "32"),
                          ("--max-concurrency", "8"), ("--random-range-ratio", "0.0"), ("--temperature", "0")]:
        assert arguments[arguments.index(option) + 1] == value
    assert arguments[arguments.index("--result-filename") + 1] == "npuport-c8.json"


def test_option_lists():
    assert concurrency_list("1,8,32") == [1, 8, 32]
    assert engine_list("vllm,npuport") == ["npuport", "vllm"]
    for bad in ("0", "1,x", "4,4", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            concurrency_list(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="--engines"):
        engine_list("sglang")
