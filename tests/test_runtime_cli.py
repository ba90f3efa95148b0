"""`npuport generate`: a thin command over the runtime - its JSON carries what the library produces."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from npuport.cli import main
from npuport.runtime.generate import generate
from npuport.runtime.loader import load_model
from npuport.runtime.textgen import load_tokenizer, stop_token_ids

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_generate_json_reports_what_the_library_generates(tiny_checkpoints):
    path = tiny_checkpoints["dense-text"]
    args = ["generate", str(path), "--prompt", "Question: what is 2+2?", "--prompt-ids", "5,6,7",
            "--max-new-tokens", "8", "--mtp", "2", "--dtype", "float32", "--device", "cpu", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    tokenizer = load_tokenizer(path)
    prompts = [tokenizer.encode("Question: what is 2+2?"), [5, 6, 7]]
    want = generate(load_model(path, "cpu", torch.float32), prompts, 8, mtp=2, stop_tokens=stop_token_ids(path))
    assert [r["prompt_ids"] for r in report["requests"]] == prompts
    assert [r["token_ids"] for r in report["requests"]] == want.tokens
    assert [r["text"] for r in report["requests"]] == [tokenizer.decode(t) for t in want.tokens]
    assert report["acceptance"] == want.stats.to_dict()


def test_generate_runs_a_w8a8_artifact_with_its_bf16_mtp_head(tiny_artifacts):
    args = ["generate", str(tiny_artifacts["moe-multimodal-fused"]), "--prompt-ids", "9,8,7,6", "--mtp", "3",
            "--max-new-tokens", "6", "--temperature", "0.7", "--top-p", "0.9", "--seed", "3"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "(6 tokens" in result.output and "MTP k=3" in result.output


@pytest.mark.parametrize(("extra", "message"), [
    (["--prompt-ids", "1,x"], "expected comma-separated integers"),
    ([], "give at least one --prompt"),
])
def test_generate_reports_user_errors_in_one_line(tiny_checkpoints, extra, message):
    result = CliRunner().invoke(main, ["generate", str(tiny_checkpoints["dense-text"]), *extra])
    assert result.exit_code == 1 and message in result.output
