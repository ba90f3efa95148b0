"""`npuport demo` runs end to end from the command line on the shipped trained tiny model: a checked artifact,
its validation report against the source with accuracy well above zero and real MTP acceptance, and a release that
verifies."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from npuport import demo
from npuport.cli import main
from npuport.convert.check import check_artifact
from npuport.demo import DEMO_MIN_ACCEPTANCE, DEMO_QUESTIONS
from npuport.fixtures.arithmetic import arithmetic_path
from npuport.release.verify import verify_release

MIN_DEMO_ACCURACY = 0.75  # the shipped model solved 200 of 200 held-out problems on a GPU (tiny-trained/README.md)


@pytest.mark.usefixtures("one_cpu_thread")
def test_demo_end_to_end(tmp_path, monkeypatch):
    workdir = tmp_path / "demo"
    result = CliRunner().invoke(main, ["demo", "--workdir", str(workdir)])
    assert result.exit_code == 0, result.output
    assert "npuport check" in result.output and "[5/5]" in result.output
    assert check_artifact(workdir / "artifact-w8a8") == []
    report_md = workdir / "validation" / "report.md"
    assert f"report: {report_md}" in result.output
    report = json.loads((workdir / "validation" / "report.json").read_text())
    assert report["artifact"] == str(workdir / "artifact-w8a8") and report["device"].startswith("cpu")
    assert report["gsm8k"][0]["reference"]["num_questions"] == DEMO_QUESTIONS
    assert report["fidelity"]["num_prompts"] == DEMO_QUESTIONS
    # the trained model's drafts are accepted; random weights would give a mean length of 1.0
    assert report["mtp"]["mean_acceptance_length"] > DEMO_MIN_ACCEPTANCE
    gates = [g["name"].split(" ")[0] for g in report["gates"] if g["passed"]]
    assert gates == ["min-accuracy", "max-accuracy-drop", "min-acceptance"], report["gates"]  # all three passed
    # the questions are the held-out arithmetic problems, which the trained model solves in BF16 and W8A8 alike
    assert report["settings"]["data"] == str(arithmetic_path())
    row = report["gsm8k"][0]
    assert row["candidate"]["accuracy"] >= MIN_DEMO_ACCURACY and row["reference"]["accuracy"] >= MIN_DEMO_ACCURACY
    assert verify_release(workdir / "release") == []
    # the card names the arithmetic set, never GSM8K, and every speed figure in it is marked as measured on a CPU
    card = (workdir / "release" / "README.md").read_text(encoding="utf-8")
    name = report["settings"]["questions_name"]
    assert name.startswith("arithmetic") and f"| {name} accuracy % (" in card
    rows = [line.split(" | ")[0].lstrip("| ") for line in card.split("## Measured results", 1)[1].split("\n## ")[0]
            .splitlines() if line.startswith("| ")]
    assert not any(row.startswith("GSM8K") for row in rows), rows  # "arithmetic (GSM8K format) ...", never "GSM8K ..."
    speed = [row for row in rows if "tok/s" in row or " ms" in row]
    assert speed and all(row.endswith("on CPU") for row in speed), rows
    assert "Speed figures marked 'on CPU' were measured on a CPU" in card and " timing noise" in card
    assert card.split("---\n", 2)[2].lstrip("\n").startswith(f"# {demo.DEMO_BASE_MODEL}trained, ")
    assert "npuport validate --gsm8k artifact-w8a8 " in card and "--data arithmetic" in card
    # random weights never stop early: a few questions and tokens show their acceptance as well as 32 x 64 would
    monkeypatch.setattr(demo, "DEMO_QUESTIONS", 4)
    monkeypatch.setattr(demo, "DEMO_NEW_TOKENS", 16)
    rerun = CliRunner().invoke(main, ["demo", "--workdir", str(workdir), "--model", "random-moe"])
    assert rerun.exit_code == 0, rerun.output
    report = json.loads((workdir / "validation" / "report.json").read_text())
    assert report["mtp"]["mean_acceptance_length"] < 1.1 and "gates" not in report


def test_demo_refuses_a_folder_it_did_not_make(tmp_path):
    (tmp_path / "mine").mkdir()
    result = CliRunner().invoke(main, ["demo", "--workdir", str(tmp_path / "mine")])
    assert result.exit_code == 1 and "not made by `npuport demo`" in result.output
