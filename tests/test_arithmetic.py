"""The arithmetic word problems (fixtures/arithmetic.py, npuport/data/arithmetic): GSM8K's format, worked steps
whose arithmetic is right (checked here by Python's own operators), a test split unseen in training, the shipped
files what `npuport make-arithmetic` writes, and the shipped model solving the held-out problems."""

from __future__ import annotations

import operator
import re

import pytest
import torch
from click.testing import CliRunner

from npuport.cli import main
from npuport.fixtures.arithmetic import arithmetic_path, arithmetic_splits
from npuport.fixtures.train_tiny import trained_tiny_path
from npuport.runtime.generate import generate
from npuport.runtime.loader import load_model
from npuport.runtime.textgen import load_tokenizer, stop_token_ids
from npuport.runtime.validation.gsm8k import load_records, make_protocol

STEP = re.compile(r"(\d+)([-+*])(\d+)=<<(\d+)([-+*])(\d+)=(\d+)>>(\d+)")
OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
SOLVED_QUESTIONS = 24
MIN_SOLVED_SHARE = 0.75  # the shipped model solved 200 of 200 held-out problems on a GPU (tiny-trained/README.md)


@pytest.fixture(scope="module")
def shipped():
    return load_records(arithmetic_path(), "train"), load_records(arithmetic_path(), "test")


def test_every_worked_step_is_right_and_the_answer_is_the_last_result(shipped):
    for record in (r for split in shipped for r in split):
        steps = STEP.findall(record.answer)
        assert steps, record.answer
        for a, op, b, a2, op2, b2, result, shown in steps:
            assert (a, op, b) == (a2, op2, b2) and result == shown, record.answer
            assert OPERATORS[op](int(a), int(b)) == int(result) >= 0, record.answer
        assert record.gold == steps[-1][-1]
        first_operands = {steps[0][0], steps[0][2]}
        assert first_operands <= set(re.findall(r"\d+", record.question)), record  # the numbers come from the question


def test_the_test_split_is_unseen_in_training(shipped):
    train, test = shipped
    assert len(test) == len({r.question for r in test})
    assert not {r.question for r in test} & {r.question for r in train}


def test_the_shipped_files_are_make_arithmetic_with_its_defaults(tmp_path, shipped):
    result = CliRunner().invoke(main, ["make-arithmetic", str(tmp_path / "set")])
    assert result.exit_code == 0, result.output
    for split in ("train", "test"):
        assert (tmp_path / "set" / f"{split}.jsonl").read_bytes() == (arithmetic_path() / f"{split}.jsonl").read_bytes()
    again = CliRunner().invoke(main, ["make-arithmetic", str(tmp_path / "set")])
    assert again.exit_code != 0 and "already exists" in again.output


def test_another_seed_draws_other_problems():
    assert arithmetic_splits(1, 50, 10)[0] != arithmetic_splits(0, 50, 10)[0]


@pytest.mark.usefixtures("one_cpu_thread")
def test_the_shipped_model_solves_held_out_problems():
    """sglang's 5-shot prompts on the test split, greedy, float32 on CPU, scored by the protocol's own rule."""
    protocol = make_protocol("sglang", arithmetic_path())
    tokenizer = load_tokenizer(trained_tiny_path())
    prompts = [tokenizer.encode(p) for p in protocol.prompts(SOLVED_QUESTIONS)]
    model = load_model(trained_tiny_path(), "cpu", torch.float32)
    out = generate(model, prompts, 64, stop_tokens=stop_token_ids(trained_tiny_path()))
    result = protocol.score([tokenizer.decode(t) for t in out.tokens])
    assert result.accuracy >= MIN_SOLVED_SHARE
