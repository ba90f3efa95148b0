"""`npuport demo` runs end to end from the command line and leaves a checked artifact and its validation
report against the source."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from npuport.cli import main
from npuport.convert.check import check_artifact
from npuport.demo import DEMO_QUESTIONS


@pytest.mark.usefixtures("one_cpu_thread")
def test_demo_end_to_end(tmp_path):
    workdir = tmp_path / "demo"
    result = CliRunner().invoke(main, ["demo", "--workdir", str(workdir)])
    assert result.exit_code == 0, result.output
    assert "npuport check" in result.output and "OK" in result.output
    assert check_artifact(workdir / "artifact-w8a8") == []
    report_md = workdir / "validation" / "report.md"
    assert f"report: {report_md}" in result.output
    report = json.loads((workdir / "validation" / "report.json").read_text())
    assert report["artifact"] == str(workdir / "artifact-w8a8") and report["device"].startswith("cpu")
    assert report["gsm8k"][0]["reference"]["num_questions"] == DEMO_QUESTIONS
    assert report["fidelity"]["num_prompts"] == DEMO_QUESTIONS and report["mtp"] is not None
    rerun = CliRunner().invoke(main, ["demo", "--workdir", str(workdir)])
    assert rerun.exit_code == 0, rerun.output


def test_demo_refuses_a_folder_it_did_not_make(tmp_path):
    (tmp_path / "mine").mkdir()
    result = CliRunner().invoke(main, ["demo", "--workdir", str(tmp_path / "mine")])
    assert result.exit_code == 1 and "not made by `npuport demo`" in result.output
