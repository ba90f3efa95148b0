"""The trained tiny checkpoint shipped with the package (npuport/data/tiny-trained, `npuport train-tiny`): its
MTP head drafts what the target then says, greedy speculative output is plain greedy output, the W8A8
artifact keeps the acceptance, the trained weights land in make-tiny's layout, and training is deterministic.

Acceptance is measured as `npuport generate` does (BF16, greedy) on the first PROMPTS GSM8K test questions as
0-shot sglang prompts, MAX_NEW_TOKENS new tokens each (kept modest for CI time)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from npuport.convert.converter import convert_qwen35
from npuport.fixtures import train_tiny as train_tiny_module
from npuport.fixtures.tiny_checkpoint import TinySpec, full_config, make_tiny, tensor_shapes, write_metadata
from npuport.fixtures.train_tiny import (
    RECIPES,
    TrainSpec,
    checkpoint_values,
    new_model,
    train_tiny,
    trained_tiny_path,
)
from npuport.runtime.config import ModelConfig
from npuport.runtime.generate import generate
from npuport.runtime.loader import load_model
from npuport.runtime.textgen import load_tokenizer, stop_token_ids
from npuport.runtime.validation.gsm8k import make_protocol

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

PROMPTS = 50
MAX_NEW_TOKENS = 48
MIN_ACCEPTANCE = 0.5  # issue 7: greedy k = 1 acceptance on 50 GSM8K test prompts
MAX_W8A8_ACCEPTANCE_CHANGE = 0.1


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = load_tokenizer(trained_tiny_path())
    return [tokenizer.encode(p) for p in make_protocol("sglang", shots=0).prompts(PROMPTS)]


def first_draft_acceptance(path, prompts, dtype=torch.bfloat16) -> tuple[float, list[list[int]]]:
    """Greedy MTP k = 1 on `prompts`: the acceptance rate of the draft and the tokens generated."""
    model = load_model(path, "cpu", dtype)
    out = generate(model, prompts, MAX_NEW_TOKENS, mtp=1, stop_tokens=stop_token_ids(path))
    return out.stats.acceptance_rate_per_position()[0], out.tokens


@pytest.fixture(scope="module")
def bf16_acceptance(prompts) -> tuple[float, list[list[int]]]:
    return first_draft_acceptance(trained_tiny_path(), prompts)


def test_mtp_head_drafts_are_accepted_at_least_half_the_time(bf16_acceptance):
    rate, _ = bf16_acceptance
    assert rate >= MIN_ACCEPTANCE


@pytest.fixture(scope="module")
def float64_case(prompts):
    """The checkpoint in float64, where a verify of k + 1 tokens and single-token decodes agree to ~1e-12 (no
    argmax ties can split them), and its plain greedy continuations."""
    path = trained_tiny_path()
    model = load_model(path, "cpu", torch.float64)
    return model, generate(model, prompts, MAX_NEW_TOKENS, stop_tokens=stop_token_ids(path)).tokens


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_mtp_output_is_plain_greedy_output(float64_case, prompts, k):
    model, plain = float64_case
    out = generate(model, prompts, MAX_NEW_TOKENS, mtp=k, stop_tokens=stop_token_ids(trained_tiny_path()))
    assert out.tokens == plain
    assert out.stats.acceptance_rate_per_position()[0] > 0


def test_w8a8_artifact_keeps_the_acceptance(bf16_acceptance, prompts, tmp_path):
    artifact = convert_qwen35(trained_tiny_path(), tmp_path / "w8a8", show_progress=False, log=lambda _: None).out
    rate, _ = first_draft_acceptance(artifact, prompts)
    assert abs(rate - bf16_acceptance[0]) <= MAX_W8A8_ACCEPTANCE_CHANGE


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_checkpoint_holds_the_trained_weights(arch, tmp_path):
    """What train-tiny writes (make-tiny's multimodal layout, experts fused) loads back as the model's own
    parameters rounded to BF16."""
    spec = TinySpec(arch=arch, size=TrainSpec().recipe.model_size)
    (tmp_path / "metadata").mkdir()
    vocab = write_metadata(tmp_path / "metadata", spec)["text_config"]["vocab_size"]  # vision tokens included
    model = new_model(ModelConfig.from_dict(full_config(spec, vocab, 2, 0)), seed=3, device=torch.device("cpu"))
    names = [name for name, _ in tensor_shapes(spec, vocab)]
    path = make_tiny(tmp_path / arch, spec, weights=checkpoint_values(model, names))
    loaded = dict(load_model(path, "cpu", torch.float32).named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(loaded[name], param.detach().to(torch.bfloat16).float()), name


def test_training_is_deterministic_by_seed(tmp_path, monkeypatch):
    # the recipe's shape does not bear on determinism: smaller batches keep the three runs short
    monkeypatch.setitem(train_tiny_module.RECIPES, "tiny", replace(RECIPES["tiny"], batch_size=4, seq_len=128))

    def shards(seed: int, name: str) -> dict[str, bytes]:
        out = train_tiny(tmp_path / name, TrainSpec(seed=seed, steps=2), device="cpu", show_progress=False).out
        return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}

    first = shards(0, "a")
    assert shards(0, "b") == first
    assert shards(1, "c") != first
