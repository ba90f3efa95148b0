"""The accuracy floor that needs no reference (validate --min-accuracy): by default a model must answer above
chance - the accuracy of always giving the most common gold answer of the questions run - so one answering every
question wrong, or always the same most common answer, fails validate (exit 1, the gate named in the report)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from click.testing import CliRunner

from npuport.cli import main
from npuport.runtime.validation.gates import CHANCE, chance_accuracy, min_accuracy_gate
from npuport.runtime.validation.gsm8k import AISBenchProtocol, GSM8KRecord
from tests.test_endpoint import completion, scripted_server
from tests.test_endpoint_faults import NUM_QUESTIONS, gold, question_of, served_model, validate_args, write_gsm8k

__all__ = ["served_model"]  # a fixture, used by name

GOLDS = ["3", "5", "3", "8", "3", "5", "9", "1"]  # "3" is the most common: 3 of 8
RECORDS = [GSM8KRecord(f"Q{i}?", f"w\n#### {g}") for i, g in enumerate(GOLDS)]


def scored(answers: list[str]):
    return AISBenchProtocol(RECORDS).score([f"answer: {a}" for a in answers])


def test_chance_is_always_answering_the_most_common_gold_answer() -> None:
    counts = Counter(GOLDS)
    answer, count = counts.most_common(1)[0]
    assert chance_accuracy(GOLDS) == (count / len(GOLDS), answer, count) == (3 / 8, "3", 3)


@pytest.mark.parametrize(("answers", "passed"), [
    (["0"] * 8, False),  # every question wrong
    (["3"] * 8, False),  # at chance: always the most common answer
    (["3", "5", "0", "8", "0", "0", "0", "0"], False),  # 3 of 8 right: at chance, not above
    (["3", "5", "3", "8", "0", "0", "0", "0"], True),  # 4 of 8: above chance
])
def test_the_default_floor_fails_a_model_at_chance(answers: list[str], passed: bool) -> None:
    result = scored(answers)
    gate = min_accuracy_gate(result, CHANCE, "W8A8")
    assert gate.passed is passed and gate.passed is (result.accuracy > 3 / 8)
    assert gate.name == "min-accuracy above chance (37.50 %)"
    assert "always answering 3, the most common gold answer (3 of 8 questions)" in gate.detail


def test_a_given_floor_is_a_percentage() -> None:
    result = scored(["3", "5", "3", "8", "0", "0", "0", "0"])  # 50 %
    assert min_accuracy_gate(result, 50.0).passed and not min_accuracy_gate(result, 50.1).passed
    assert min_accuracy_gate(result, 50.0).name == "min-accuracy 50 %"
    with pytest.raises(ValueError, match="percentage"):
        min_accuracy_gate(result, 150.0)


def test_an_endpoint_answering_every_question_wrong_fails_validate(served_model, tmp_path) -> None:
    def wrong(body: dict, number: int) -> tuple[int, bytes]:
        return 200, completion(f"so #### {int(gold(question_of(body['prompt']))) + 1}", 4)

    data, out = write_gsm8k(tmp_path / "gsm8k.jsonl"), tmp_path / "report"
    with scripted_server(wrong) as (url, _):
        result = CliRunner().invoke(main, validate_args(served_model, url, data, out))
    assert result.exit_code == 1, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["gsm8k"][0]["candidate"]["accuracy"] == 0.0
    gates = {g["name"]: g for g in report["gates"]}
    chance = 1 / NUM_QUESTIONS * 100  # every gold differs: the most common answer is right once
    name = f"min-accuracy above chance ({chance:.2f} %)"
    assert not gates[name]["passed"] and gates["every question answered"]["passed"], gates
    assert f"gate FAILED: {name}" in result.output and "error: 1 gate(s) failed" in result.output
    markdown = (out / "report.md").read_text()
    assert "1 of 2 gate(s) FAILED." in markdown and f"| {name} | FAIL |" in markdown
    assert "--min-accuracy" not in report["settings"]["command"]  # the default: not written out



@pytest.mark.parametrize(("given", "passed"), [("off", None), ("0", True), ("chance", False)])
def test_min_accuracy_option(served_model, tmp_path, given: str, passed: bool | None) -> None:
    def wrong(body: dict, number: int) -> tuple[int, bytes]:
        return 200, completion("so #### 0", 4)

    data, out = write_gsm8k(tmp_path / "gsm8k.jsonl"), tmp_path / "report"
    with scripted_server(wrong) as (url, _):
        result = CliRunner().invoke(main, [*validate_args(served_model, url, data, out, questions=2),
                                           "--min-accuracy", given])
    assert result.exit_code == (1 if passed is False else 0), result.output
    report = json.loads((out / "report.json").read_text())
    floors = [g for g in report["gates"] if g["name"].startswith("min-accuracy")]
    assert [g["passed"] for g in floors] == ([] if passed is None else [passed])
    if given != "chance":
        assert f"--min-accuracy {given}" in report["settings"]["command"]


def test_min_accuracy_refuses_a_value_out_of_range(tmp_path) -> None:
    result = CliRunner().invoke(main, ["validate", "--gsm8k", str(tmp_path), "--min-accuracy", "101"])
    assert result.exit_code == 2 and "'101': give 'chance', a number from 0 to 100, or 'off'" in result.output
