"""make-tiny writes real Qwen3.5 checkpoints: transformers loads every tensor (none missing, none
unexpected but mtp.*), the tokenizer loads through AutoTokenizer, and the bytes are deterministic."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from npuport.cli import main
from npuport.fixtures.tiny_checkpoint import PRESETS, TinySpec, tensor_shapes


@pytest.mark.parametrize("kind", ["dense-multimodal", "dense-text", "moe-multimodal-fused", "moe-text-per-expert"])
def test_transformers_loads_every_tensor(tiny_checkpoints, kind):
    path = tiny_checkpoints[kind]
    cls = AutoModelForImageTextToText if "multimodal" in kind else AutoModelForCausalLM
    model, info = cls.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(model.state_dict()) <= set(index), "every model parameter comes from the checkpoint"
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"])
    assert any(k.startswith("mtp.") for k in index), "the MTP head is in the checkpoint"
    total = sum(p.stat().st_size for p in path.iterdir())
    assert total < 5 * 1024 * 1024


def test_tokenizer_and_chat_template(tiny_checkpoints):
    tok = AutoTokenizer.from_pretrained(tiny_checkpoints["dense-text"])
    text = "Natalia sold clips to 48 of her friends in April."
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and len(ids) < len(text) / 2
    chat = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"


def test_same_seed_gives_identical_bytes(tmp_path):
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        assert CliRunner().invoke(main, ["make-tiny", str(out), "--arch", "moe"]).exit_code == 0
    files = sorted(p.name for p in outs[0].iterdir())
    assert files == sorted(p.name for p in outs[1].iterdir())
    for name in files:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    other = tmp_path / "c"
    assert CliRunner().invoke(main, ["make-tiny", str(other), "--arch", "moe", "--seed", "1"]).exit_code == 0
    assert (other / "model-00002-of-00003.safetensors").read_bytes() != (
        outs[0] / "model-00002-of-00003.safetensors"
    ).read_bytes()


def test_mid_preset_is_a_few_gigabytes_with_real_proportions():
    for arch in ("dense", "moe"):
        n = sum(math.prod(s) for _, s in tensor_shapes(TinySpec(arch=arch, size="mid"), PRESETS["mid"].vocab_size))
        assert 2e9 < 2 * n < 8e9, (arch, 2 * n)
    cfg_sizes = PRESETS["mid"]
    assert cfg_sizes.linear_key_head_dim == cfg_sizes.linear_value_head_dim == 128


def test_config_loads_as_qwen35(tiny_checkpoints):
    cfg = AutoConfig.from_pretrained(tiny_checkpoints["moe-multimodal-fused"])
    assert cfg.model_type == "qwen3_5_moe"
    assert cfg.text_config.layer_types == ["linear_attention"] * 3 + ["full_attention"]


@pytest.mark.parametrize("size", sorted(PRESETS))
def test_mrope_sections_sum_to_the_rotated_frequencies_at_every_preset(size):
    """What vLLM asserts of a Qwen3.5 config: sum(mrope_section) == rotary_dim // 2, the frequencies a head rotates
    (head_dim x partial_rotary_factor / 2); the published widths keep the published [11, 11, 10]. A text-only
    release has no M-RoPE keys."""
    from npuport.fixtures.tiny_checkpoint import text_config

    arch = "moe" if PRESETS[size].num_experts else "dense"
    rope = text_config(TinySpec(arch=arch, size=size), 2048, 1, 0)["rope_parameters"]
    if PRESETS[size].text_only:
        assert "mrope_section" not in rope and "mrope_interleaved" not in rope
        return
    rotary_dim = int(PRESETS[size].head_dim * rope["partial_rotary_factor"])
    assert sum(rope["mrope_section"]) == rotary_dim // 2 and min(rope["mrope_section"]) >= 0
    if PRESETS[size].head_dim == 256:
        assert rope["mrope_section"] == [11, 11, 10]


def test_the_shipped_models_mrope_sections_sum_to_its_rotated_frequencies():
    from npuport.fixtures.train_tiny import trained_tiny_path

    config = json.loads((trained_tiny_path() / "config.json").read_text())["text_config"]
    rope = config["rope_parameters"]
    assert sum(rope["mrope_section"]) == int(config["head_dim"] * rope["partial_rotary_factor"]) // 2


def test_vision_tokens_follow_the_text_tokens_without_moving_one(tiny_checkpoints, tmp_path):
    """The four vision tokens Qwen's processor writes are appended as special tokens: every text token keeps the id
    the plain trained tokenizer gives it, and config.json names the appended ids."""
    from npuport.fixtures.tiny_checkpoint import TOKENIZER_VOCAB
    from npuport.fixtures.tiny_tokenizer import write_tokenizer

    write_tokenizer(tmp_path, TOKENIZER_VOCAB)
    plain = AutoTokenizer.from_pretrained(tmp_path).get_vocab()
    path = tiny_checkpoints["dense-multimodal"]
    written = AutoTokenizer.from_pretrained(path).get_vocab()
    config = json.loads((path / "config.json").read_text())
    vision = {config[k]: t for k, t in [("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                                         ("vision_start_token_id", "<|vision_start|>"),
                                         ("vision_end_token_id", "<|vision_end|>")]}
    assert {t: i for t, i in written.items() if i not in vision} == plain
    assert {i: t for t, i in written.items() if i in vision} == vision
    assert sorted(vision) == list(range(len(plain), len(plain) + 4))
    assert config["text_config"]["vocab_size"] == len(written)
