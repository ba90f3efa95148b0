"""report.json / report.md / plots: every figure passed in comes back, absent sections stay absent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import npuport
from npuport.runtime.validation.gsm8k import AISBenchProtocol, GSM8KRecord, SGLangProtocol
from npuport.runtime.validation.report import (
    AccuracyRow,
    Fidelity,
    MTPAcceptance,
    ThroughputRun,
    ValidationReport,
)
from npuport.runtime.validation.report_files import write_report

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
                                  decode_tokens_per_s=20.0, time_per_output_token_ms=50.0),
                    ThroughputRun("MTP k=3", mtp=True, batch_size=1, prefill_tokens_per_s=880.0,
                                  decode_tokens_per_s=45.0, time_per_output_token_ms=22.2,
                                  num_speculative_tokens=3)],
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
    assert "prefill" not in md and "speed-up" not in md and "GSM8K" not in md


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
        throughput=[ThroughputRun("no MTP", mtp=False, batch_size=1, decode_tokens_per_s=50.0),
                    ThroughputRun("MTP k=2", mtp=True, batch_size=1, decode_tokens_per_s=40.0,
                                  num_speculative_tokens=2)],
        mtp=MTPAcceptance(num_speculative_tokens=2, mean_acceptance_length=2.24, per_position=[0.8, 0.44]))
    md = write_report(report, tmp_path).markdown.read_text(encoding="utf-8")
    assert "Decode speed-up with MTP (MTP k=2 over no MTP): 0.80x" in md
    assert "took the time of 2.80 plain decode steps and yielded 2.24 tokens" in md
    faster = ValidationReport(artifact="a", device="cpu", seed=0, throughput=[
        ThroughputRun("no MTP", mtp=False, batch_size=1, decode_tokens_per_s=50.0),
        ThroughputRun("MTP k=2", mtp=True, batch_size=1, decode_tokens_per_s=60.0)], mtp=report.mtp)
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
