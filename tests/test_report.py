"""report.json / report.md / plots: every figure passed in comes back, absent sections stay absent."""

from __future__ import annotations

import fnmatch
import io
import json
import math
import re
import sys
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import npuport
from npuport.fixtures.train_tiny import trained_tiny_path
from npuport.runtime.validation import report_plots, throughput
from npuport.runtime.validation.gsm8k import (
    LM_EVAL_MAX_NEW_TOKENS,
    LM_EVAL_STOP,
    MAX_NEW_TOKENS,
    SGLANG_STOP,
    AISBenchProtocol,
    GSM8KRecord,
    SGLangProtocol,
)
from npuport.runtime.validation.labels import model_label, report_labels
from npuport.runtime.validation.report import (
    AccuracyRow,
    Fidelity,
    MTPAcceptance,
    ThroughputRun,
    ValidationReport,
)
from npuport.runtime.validation.report_files import write_report
from npuport.runtime.validation.validate import ValidateOptions, run_validation

RECORDS = [GSM8KRecord(f"Q{i}?", f"w\n#### {g}") for i, g in enumerate([18, 3, 70, 5, 12])]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _results():
    protocol = AISBenchProtocol(RECORDS)
    # candidate right on Q0, Q2, Q4 (3 of 5); reference right on Q0, Q1, Q2, Q4 (4 of 5)
    candidate = protocol.score(["answer: 18", "answer: 4", "answer: 70", "no idea", "answer: 12"],
                               latency_s=4.0, completion_tokens=200)
    reference = protocol.score(["answer: 18", "answer: 3", "answer: 70", "answer: 6", "answer: 12"])
    return candidate, reference


def _full_report() -> ValidationReport:
    candidate, reference = _results()
    return ValidationReport(
        artifact="Qwen3.5-tiny-w8a8", device="cpu (test)", seed=11, artifact_checksum="sha256:0123abcd",
        accuracy=[AccuracyRow.paired(candidate, reference, seed=11, resamples=300)],
        fidelity=Fidelity(greedy_token_agreement=0.97, top1_agreement=0.985, mean_kl=0.0123,
                          layer_cosine=[0.9991, 0.9987, 0.9995], num_prompts=8, num_tokens=512),
        throughput=[ThroughputRun("no MTP", mtp=False, batch_size=1, prefill_tokens_per_s=900.0,
                                  decode_tokens_per_s=20.0, time_per_output_token_ms=50.0, model="W8A8"),
                    ThroughputRun("MTP k=3", mtp=True, batch_size=1, prefill_tokens_per_s=880.0,
                                  decode_tokens_per_s=45.0, time_per_output_token_ms=22.2,
                                  num_speculative_tokens=3, model="W8A8")],
        mtp=MTPAcceptance(num_speculative_tokens=3, mean_acceptance_length=2.5, per_position=[0.85, 0.46, 0.19],
                          num_rounds=120),
        dtypes={"weights": "int8", "activations": "int8 per token", "mtp": "bfloat16"},
        settings={"max_new_tokens": 512},
    )


def test_full_report_json_holds_every_figure_and_the_environment(tmp_path):
    files = write_report(_full_report(), tmp_path)
    data = json.loads(files.json.read_text(encoding="utf-8"))
    assert data["artifact"] == "Qwen3.5-tiny-w8a8" and data["artifact_checksum"] == "sha256:0123abcd"
    assert data["device"] == "cpu (test)" and data["seed"] == 11
    assert data["versions"]["torch"] == torch.__version__
    assert data["versions"]["npuport"] == npuport.__version__
    assert "transformers" in data["versions"]
    assert data["dtypes"]["mtp"] == "bfloat16" and data["settings"] == {"max_new_tokens": 512}

    (row,) = data["gsm8k"]
    assert row["protocol"] == "aisbench"
    cand, ref = row["candidate"], row["reference"]
    assert cand["accuracy"] == 0.6 and cand["reported_accuracy"] == 60.0 and cand["invalid_rate"] == 0.2
    assert cand["scores"][0]["correct"] == [True, False, True, False, True]
    assert cand["latency_s"] == 4.0 and cand["completion_tokens"] == 200 and cand["output_throughput"] == 50.0
    # Wilson 95% for 3 of 5: (0.2307, 0.8824)
    assert cand["interval"] == [pytest.approx(0.2307, abs=1e-4), pytest.approx(0.8824, abs=1e-4)]
    assert ref["accuracy"] == 0.8 and ref["shots"] == 0
    comparison = row["comparison"]
    # one question only the reference got right, none only the candidate: p = 2 * 1/2 = 1
    assert (comparison["only_reference"], comparison["only_candidate"]) == (1, 0)
    assert comparison["mcnemar_p"] == 1.0
    assert comparison["difference"] == pytest.approx(-0.2)
    assert comparison["seed"] == 11 and comparison["resamples"] == 300

    assert data["fidelity"]["mean_kl"] == 0.0123 and data["fidelity"]["layer_cosine"] == [0.9991, 0.9987, 0.9995]
    assert [r["decode_tokens_per_s"] for r in data["throughput"]] == [20.0, 45.0]
    assert data["mtp"]["per_position"] == [0.85, 0.46, 0.19] and data["mtp"]["num_rounds"] == 120


def test_full_report_markdown_has_the_tables_a_person_reads(tmp_path):
    files = write_report(_full_report(), tmp_path)
    md = files.markdown.read_text(encoding="utf-8")
    assert "sha256:0123abcd" in md and "cpu (test)" in md
    assert "| aisbench | accuracy | 0 | 5 | 60.00 (23.07–88.24) | 20.00 | 80.00 (37.55–96.38) | 0.00 |" in md
    assert "| aisbench | W8A8 | 5 | 4.00 | 200 | 50.0 |" in md
    assert "## W8A8 against BF16" in md and "| -20.00 |" in md and "| 1 | 0 | 1 |" in md
    assert "| mean KL divergence | 0.0123 |" in md
    assert "0.99870 (layer 1)" in md
    assert "| MTP k=3 | yes | 1 | 880.0 | 45.0 | 22.20 |" in md
    assert "2.25x" in md
    assert "| 2 | 0.460 |" in md and "2.50" in md
    for name in ("accuracy.png", "mtp_acceptance.png", "throughput.png"):
        assert f"]({name})" in md


def test_plots_are_png_files(tmp_path):
    files = write_report(_full_report(), tmp_path)
    assert sorted(p.name for p in files.plots) == ["accuracy.png", "mtp_acceptance.png", "throughput.png"]
    for plot in files.plots:
        content = plot.read_bytes()
        assert content.startswith(PNG_MAGIC) and len(content) > 5000


def test_absent_sections_are_omitted_not_zeroed(tmp_path):
    candidate, _ = _results()
    report = ValidationReport(artifact="a", device="cpu", seed=0, accuracy=[AccuracyRow(candidate)])
    files = write_report(report, tmp_path)
    data = json.loads(files.json.read_text(encoding="utf-8"))
    assert not {"fidelity", "throughput", "mtp", "dtypes", "settings"} & data.keys()
    assert data["artifact_checksum"] is None
    assert not {"reference", "comparison"} & data["gsm8k"][0].keys()
    md = files.markdown.read_text(encoding="utf-8")
    for absent in ("BF16", "Fidelity", "Throughput", "MTP", "checksum", "McNemar"):
        assert absent not in md
    assert [p.name for p in files.plots] == ["accuracy.png"]
    assert not (tmp_path / "throughput.png").exists()


def test_throughput_columns_nobody_measured_are_left_out(tmp_path):
    report = ValidationReport(artifact="a", device="cpu", seed=0,
                              throughput=[ThroughputRun("MTP k=2", mtp=True, batch_size=4, decode_tokens_per_s=30.0)])
    md = write_report(report, tmp_path).markdown.read_text(encoding="utf-8")
    assert "| run | MTP | batch | decode tok/s |" in md
    assert "prefill" not in md and "GSM8K" not in md
    assert "- MTP k=2, MTP: not given: no run of MTP k=2 without MTP at batch 4 to compare with." in md


def test_reference_on_other_questions_is_refused():
    candidate, _ = _results()
    other = SGLangProtocol(RECORDS, shots=1).score(["18"] * 4)
    with pytest.raises(ValueError, match="not the same questions"):
        AccuracyRow(candidate, other)


def test_a_slower_mtp_run_says_why_in_round_costs(tmp_path: Path) -> None:
    """MTP at 0.8x plain with a mean acceptance length of 2.24: a round yields 2.24 tokens in the time of
    2.24 / 0.8 = 2.80 plain steps, and the report says so."""
    report = ValidationReport(
        artifact="a", device="cpu", seed=0,
        throughput=[ThroughputRun("no MTP", mtp=False, batch_size=1, decode_tokens_per_s=50.0, model="W8A8"),
                    ThroughputRun("MTP k=2", mtp=True, batch_size=1, decode_tokens_per_s=40.0,
                                  num_speculative_tokens=2, model="W8A8")],
        mtp=MTPAcceptance(num_speculative_tokens=2, mean_acceptance_length=2.24, per_position=[0.8, 0.44]))
    md = write_report(report, tmp_path).markdown.read_text(encoding="utf-8")
    assert "- W8A8, MTP k=2 over no MTP: 0.80x" in md
    assert "took the time of 2.80 plain decode steps and yielded 2.24 tokens" in md
    faster = ValidationReport(artifact="a", device="cpu", seed=0, throughput=[
        ThroughputRun("no MTP", mtp=False, batch_size=1, decode_tokens_per_s=50.0, model="W8A8"),
        ThroughputRun("MTP k=2", mtp=True, batch_size=1, decode_tokens_per_s=60.0, model="W8A8")], mtp=report.mtp)
    assert "MTP is slower here" not in write_report(faster, tmp_path / "faster").markdown.read_text(encoding="utf-8")


@pytest.mark.parametrize("answer", ["no idea", "answer: {gold}"], ids=["none-correct", "all-correct"])
def test_a_report_at_none_or_all_correct_is_written_with_its_plot(tmp_path, answer):
    """0 of N (an untrained model) and N of N: the interval's bound on that side is the accuracy itself, so the
    error bar is empty, not negative (matplotlib refuses a negative one and no report was written)."""
    records = RECORDS * 2  # at 10 questions the float Wilson bound missed 0
    protocol = AISBenchProtocol(records)
    golds = [record.answer.split("#### ")[1] for record in records]
    result = protocol.score([answer.format(gold=gold) for gold in golds])
    files = write_report(ValidationReport(artifact="a", device="cpu", seed=0, accuracy=[AccuracyRow(result)]),
                         tmp_path)
    interval = json.loads(files.json.read_text(encoding="utf-8"))["gsm8k"][0]["candidate"]["scores"][0]["interval"]
    assert interval[0] == 0.0 if answer == "no idea" else interval[1] == 1.0
    assert [p.name for p in files.plots] == ["accuracy.png"]


# ---------------------------------------------------------------------------------------------------------
# Throughput: one model per ratio, timing noise, one measure per plot axis, progress


def _run(label: str, model: str, mtp: bool, decode: float | None, **kwargs) -> ThroughputRun:
    return ThroughputRun(label, mtp=mtp, batch_size=8, decode_tokens_per_s=decode, model=model,
                         num_speculative_tokens=2 if mtp else None, **kwargs)


def test_the_mtp_speed_up_never_divides_one_models_decode_by_anothers(tmp_path: Path) -> None:
    """The W8A8 + MTP decode was not measurable: its speed-up is absent with the reason, and BF16's is BF16 + MTP
    over BF16 (60 / 20 = 3.00x) - never BF16 + MTP over W8A8 (60 / 50 = 1.20x), as report.md once printed."""
    runs = [_run("W8A8", "W8A8", False, 50.0), _run("W8A8 + MTP k=2", "W8A8", True, None),
            _run("BF16", "BF16", False, 20.0), _run("BF16 + MTP k=2", "BF16", True, 60.0)]
    files = write_report(ValidationReport(artifact="a", device="cpu", seed=0, throughput=runs), tmp_path)
    md = files.markdown.read_text(encoding="utf-8")
    assert "- BF16, MTP k=2 over no MTP: 3.00x" in md
    assert "- W8A8, MTP k=2: not given: the decode of W8A8 + MTP k=2 was not measurable" in md
    assert "1.20x" not in md
    speedups = json.loads(files.json.read_text(encoding="utf-8"))["mtp_decode_speedup"]
    by_label = {r.label: r.model for r in runs}
    assert [(s["run"], s["baseline"], s["ratio"]) for s in speedups] == [
        ("W8A8 + MTP k=2", "W8A8", None), ("BF16 + MTP k=2", "BF16", pytest.approx(3.0))]
    assert all(by_label[s["run"]] == by_label[s["baseline"]] == s["model"] for s in speedups)


def _fake_clock_run(monkeypatch, calls: list[float], *, new_tokens: int, prompts: list[list[int]],
                    label: str, model: str, mtp: int = 0) -> ThroughputRun:
    """measure_throughput on a fake clock: the warm-up and then each timed call take the next of `calls` seconds."""
    clock = [0.0]
    durations = iter([0.0] + calls)  # the warm-up call first

    def fake_generate(*args, **kwargs):
        clock[0] += next(durations)

    monkeypatch.setattr(throughput, "generate", fake_generate)
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: clock[0])
    return throughput.measure_throughput(SimpleNamespace(device=torch.device("cpu")), prompts, new_tokens,
                                         mtp=mtp, label=label, repeats=len(calls) // 2, model_label=model)


def test_throughput_figures_are_medians_with_their_range_over_the_repeats(monkeypatch) -> None:
    """Three repeats of (one-token call, full call) on a fake clock; batch 2, 20 prompt tokens, 11 new tokens, so
    10 decode steps of 2 tokens: decode tok/s = 20 / decode s."""
    calls = [0.5, 1.5, 0.4, 2.4, 0.6, 1.6]  # decode s per repeat: 1.0, 2.0, 1.0
    run = _fake_clock_run(monkeypatch, calls, new_tokens=11, prompts=[[1] * 12, [2] * 8], label="W8A8", model="W8A8")
    assert run.repeats == 3 and run.model == "W8A8"
    assert run.prefill_tokens_per_s == pytest.approx(20 / 0.5)
    assert run.ranges["prefill_tokens_per_s"] == [pytest.approx(20 / 0.6), pytest.approx(20 / 0.4)]
    assert run.decode_tokens_per_s == pytest.approx(20 / 1.0)
    assert run.ranges["decode_tokens_per_s"] == [pytest.approx(10.0), pytest.approx(20.0)]
    assert run.time_per_output_token_ms == pytest.approx(100.0)
    assert run.output_tokens_per_s == pytest.approx(22 / 1.6)
    assert run.spread("decode_tokens_per_s") == pytest.approx(10.0)


def test_a_repeat_whose_decode_vanished_in_noise_leaves_the_spread_unbounded(monkeypatch) -> None:
    calls = [0.5, 1.5, 0.9, 0.8, 0.5, 1.5]  # the second repeat's full call was faster than its one-token call
    run = _fake_clock_run(monkeypatch, calls, new_tokens=11, prompts=[[1] * 10], label="x", model="x")
    assert run.decode_tokens_per_s == pytest.approx(10 / 1.0)  # the median decode time, 1.0 s
    assert run.ranges["decode_tokens_per_s"] == [pytest.approx(10.0), None]
    assert run.spread("decode_tokens_per_s") == math.inf


def _noise_report(monkeypatch, mtp_calls: list[float]) -> ValidationReport:
    plain = _fake_clock_run(monkeypatch, [1.0, 2.0, 1.0, 3.0, 1.0, 2.5], new_tokens=11, prompts=[[1] * 10],
                            label="W8A8", model="W8A8")
    spec = _fake_clock_run(monkeypatch, mtp_calls, new_tokens=11, prompts=[[1] * 10], label="W8A8 + MTP k=2",
                           model="W8A8", mtp=2)
    return ValidationReport(artifact="a", device="cuda (test)", seed=0, throughput=[plain, spec])


def test_a_difference_smaller_than_the_spread_is_called_noise_in_the_report_and_the_plot(monkeypatch, tmp_path):
    """Without MTP the decode took 1.0, 2.0 and 1.5 s (10 tokens: 10, 5 and 6.67 tok/s, spread 5); with MTP 1.2 s
    each time (8.33 tok/s, spread 0): the difference, 8.33 - 6.67 = +1.67, is within the spread of 5."""
    report = _noise_report(monkeypatch, [1.0, 2.2] * 3)
    md = write_report(report, tmp_path).markdown.read_text(encoding="utf-8")
    assert "- W8A8, MTP k=2 over no MTP: 1.25x (within noise: spread 5.0, difference +1.7 tok/s)" in md
    assert "| decode tok/s | W8A8 + MTP k=2 | W8A8 | 8.3 | 6.7 | +1.7 | 5.0 | within noise |" in md
    figure = report_plots.throughput_figure(report.throughput)
    decode_axes = next(a for a in figure.axes if a.get_ylabel() == "decode tok/s")
    assert "W8A8 + MTP k=2 vs W8A8: within noise: spread 5.0, difference +1.7" in " ".join(
        decode_axes.get_xlabel().split())


def test_a_difference_beyond_the_spread_is_not_called_noise(monkeypatch, tmp_path):
    """With MTP the decode took 0.5 s each time (20 tok/s): +13.3 over 6.67, beyond the spread of 5."""
    report = _noise_report(monkeypatch, [1.0, 1.5] * 3)
    md = write_report(report, tmp_path).markdown.read_text(encoding="utf-8")
    assert "- W8A8, MTP k=2 over no MTP: 3.00x (beyond noise: spread 5.0, difference +13.3 tok/s)" in md
    figure = report_plots.throughput_figure(report.throughput)
    assert "noise" not in next(a for a in figure.axes if a.get_ylabel() == "decode tok/s").get_xlabel()


def test_each_throughput_plot_axis_holds_one_measure(tmp_path):
    """A run with prefill, decode and output tok/s: three axes, each labelled with its own measure, never one
    axis holding decode for one run and output for another."""
    runs = [ThroughputRun("A", mtp=False, batch_size=1, prefill_tokens_per_s=900.0, decode_tokens_per_s=20.0,
                          output_tokens_per_s=18.0, model="A"),
            ThroughputRun("A + MTP k=2", mtp=True, batch_size=1, output_tokens_per_s=30.0, model="A")]
    figure = report_plots.throughput_figure(runs)
    assert [a.get_ylabel() for a in figure.axes] == ["prefill tok/s", "decode tok/s", "output tok/s"]
    heights = {a.get_ylabel(): [p.get_height() for p in a.patches] for a in figure.axes}
    assert heights == {"prefill tok/s": [900.0], "decode tok/s": [20.0], "output tok/s": [18.0, 30.0]}


def test_a_cpu_report_says_w8a8_and_mtp_gains_belong_to_accelerators(tmp_path):
    runs = [ThroughputRun("W8A8", mtp=False, batch_size=1, decode_tokens_per_s=20.0, model="W8A8")]
    cpu = write_report(ValidationReport(artifact="a", device="cpu (x86_64, 2 threads)", seed=0, throughput=runs),
                       tmp_path / "cpu").markdown.read_text(encoding="utf-8")
    gpu = write_report(ValidationReport(artifact="a", device="cuda (NVIDIA H100)", seed=0, throughput=runs),
                       tmp_path / "gpu").markdown.read_text(encoding="utf-8")
    for words in ("properties of accelerators", "int8 matrix units", "memory-bound decode", "compute-bound",
                  "bench/RESULTS.md"):
        assert words in cpu and words not in gpu
    assert (Path(__file__).parents[1] / "bench" / "RESULTS.md").is_file()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "not-a-terminal"])
def test_throughput_timing_shows_progress_on_a_terminal_only(monkeypatch, terminal):
    stderr = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    _fake_clock_run(monkeypatch, [0.5, 1.5] * 2, new_tokens=3, prompts=[[1] * 4], label="W8A8 + MTP k=2",
                    model="W8A8")
    assert ("timing W8A8 + MTP k=2" in stderr.getvalue()) is terminal


# ---------------------------------------------------------------------------------------------------------
# Labels: what ran


def _folder(path: Path, description: dict | None) -> Path:
    path.mkdir()
    if description is not None:
        (path / "quant_model_description.json").write_text(json.dumps(description), encoding="utf-8")
    return path


def test_labels_say_the_weights_and_the_compute_dtype(tmp_path):
    w8a8 = _folder(tmp_path / "w8a8", {"model.layers.0.mlp.up_proj.weight": "W8A8_DYNAMIC", "lm_head.weight": "FLOAT"})
    bf16 = _folder(tmp_path / "bf16", None)
    float_only = _folder(tmp_path / "described-float", {"lm_head.weight": "FLOAT"})
    assert model_label(w8a8, "bfloat16") == "W8A8"
    assert model_label(w8a8, "float32") == "W8A8 (float32 compute)"
    assert model_label(bf16, "float32") == "BF16 weights (float32 compute)"
    assert model_label(bf16, "bfloat16") == "BF16"
    assert model_label(float_only, "bfloat16") == "BF16"
    # through an endpoint: the weights from the local files, never "W8A8" for a BF16 model
    assert report_labels(bf16, None, dtype="float32", artifact_served=True, reference_served=True) == (
        "BF16", "the reference endpoint's model")
    assert report_labels(None, None, dtype="bfloat16", artifact_served=True, reference_served=False) == (
        "the endpoint's model", None)
    assert report_labels(bf16, bf16, dtype="bfloat16", artifact_served=False, reference_served=False) == (
        "BF16", "BF16 (reference)")


def test_a_bf16_model_validated_in_float32_is_labelled_so_in_console_and_report(tmp_path):
    """The shipped tiny model is a BF16 source (no quantization description): validated on the CPU in float32,
    neither the console nor the report may call it W8A8 or plain BF16."""
    lines: list[str] = []
    options = ValidateOptions(trained_tiny_path(), num_questions=1, max_new_tokens=4, batch_size=1, device="cpu",
                              dtype="float32", throughput=False)
    outcome = run_validation(options, tmp_path, log=lines.append)
    label = "BF16 weights (float32 compute)"
    assert outcome.report.candidate_label == label
    assert any(line.startswith(f"{label}: accuracy") for line in lines)
    md = outcome.files.markdown.read_text(encoding="utf-8")
    assert f"{label} accuracy %" in md and "W8A8" not in md
    assert "quantized linears" not in md
    assert json.loads(outcome.files.json.read_text(encoding="utf-8"))["labels"]["candidate"] == label


# ---------------------------------------------------------------------------------------------------------
# VALIDATION.md


def test_the_reports_validation_md_reference_resolves_in_the_package_and_the_repository(tmp_path):
    candidate, _ = _results()
    md = write_report(ValidationReport(artifact="a", device="cpu", seed=0, accuracy=[AccuracyRow(candidate)]),
                      tmp_path).markdown.read_text(encoding="utf-8")
    package_path = re.search(r"`npuport/([^`]+VALIDATION\.md)` in the installed npuport package", md).group(1)
    shipped = resources.files("npuport").joinpath(package_path)
    assert shipped.is_file()
    repository_path = re.search(r"`([^`]+VALIDATION\.md)` in its repository", md).group(1)
    linked = Path(__file__).parents[1] / repository_path
    assert linked.read_text(encoding="utf-8") == shipped.read_text(encoding="utf-8")
    assert linked.resolve() == Path(str(shipped)).resolve()  # a link to the one copy, not a second copy
    # the wheel carries it: pyproject's package data for npuport.data matches it
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    package_data = pyproject.split("[tool.setuptools.package-data]", 1)[1]
    patterns = re.findall(r'"([^"]+)"', re.search(r'^"npuport\.data" = \[(.*?)\]', package_data, re.M | re.S).group(1))
    assert any(fnmatch.fnmatch(package_path.removeprefix("data/"), p) for p in patterns)


def test_validation_md_states_the_protocols_as_the_code_runs_them():
    text = resources.files("npuport").joinpath("data/VALIDATION.md").read_text(encoding="utf-8")
    assert "## Tolerances in use elsewhere" in text  # gates.py cites it
    for stop in (*SGLANG_STOP, *LM_EVAL_STOP):
        assert f"`{stop}`" in text
    assert f"{MAX_NEW_TOKENS} new tokens" in text and f"{LM_EVAL_MAX_NEW_TOKENS} new tokens" in text
