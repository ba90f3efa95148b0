"""`make-tiny --like` for the Qwen3.6 and Qwen3.8 releases: config.json has every key of the published one, and a
checkpoint of each at 2 layers (widths shrunk) goes through convert-qwen35 --a8w8 and check, and the artifact
generates with MTP k = 1, 2, 3 exactly the tokens of plain greedy decoding. Sizes and parameter counts are
tests/test_make_tiny_like.py's, which runs every REAL_MODELS name."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

from npuport.cli import main
from npuport.fixtures import tiny_checkpoint as tc
from npuport.fixtures.tiny_checkpoint import REAL_MODELS
from npuport.runtime.generate import generate
from npuport.runtime.loader import load_model

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

NEW_MODELS = ["Qwen3.6-27B", "Qwen3.6-35B-A3B", "Qwen3.8-27B", "Qwen3.8-2.4T-A95B"]
# Widths divided by 16 (hidden 128-320, K = V = 8, head_dim 16); the 2.4T's by 32 (hidden 256, head_dim 8, the least
# that rotates a pair), which its 512 experts of hidden x 64 still make 50 MB a MoE layer.
SHRINK = {"Qwen3.8-2.4T-A95B": 32}

# The keys of the hub configs (sources in tiny_checkpoint.REAL_MODELS): the text model's (text_config, or the whole
# file of a text-only release) and, for a multimodal release, the top level's.
TEXT_KEYS = {"attention_bias", "attention_dropout", "attn_output_gate", "bos_token_id", "dtype", "eos_token_id",
             "full_attention_interval", "head_dim", "hidden_act", "hidden_size", "initializer_range", "layer_types",
             "linear_conv_kernel_dim", "linear_key_head_dim", "linear_num_key_heads", "linear_num_value_heads",
             "linear_value_head_dim", "mamba_ssm_dtype", "max_position_embeddings", "model_type",
             "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "num_attention_heads", "num_hidden_layers",
             "num_key_value_heads", "pad_token_id", "partial_rotary_factor", "rms_norm_eps", "rope_parameters",
             "tie_word_embeddings", "use_cache", "vocab_size"}
MOE_KEYS = {"moe_intermediate_size", "num_experts", "num_experts_per_tok", "output_router_logits",
            "router_aux_loss_coef", "shared_expert_intermediate_size"}
DENSE_27B_KEYS = TEXT_KEYS | {"intermediate_size", "output_gate_type"}
PUBLISHED_TEXT_KEYS = {
    "Qwen3.6-27B": DENSE_27B_KEYS,
    "Qwen3.6-35B-A3B": TEXT_KEYS | MOE_KEYS,
    "Qwen3.8-27B": DENSE_27B_KEYS,
    "Qwen3.8-2.4T-A95B": TEXT_KEYS | MOE_KEYS | {"output_gate_type", "architectures", "transformers_version"},
}
MULTIMODAL_TOP_KEYS = {"architectures", "image_token_id", "model_type", "text_config", "tie_word_embeddings",
                       "transformers_version", "video_token_id", "vision_config", "vision_end_token_id",
                       "vision_start_token_id"}
MROPE_KEYS = {"mrope_interleaved", "mrope_section"}
# Values of the keys the published configs have beyond the sizes (the 2.4T's from its config.json, the others' from
# their text_config); make-tiny's token ids are its own tokenizer's.
PUBLISHED_VALUES = {"attn_output_gate": True, "mamba_ssm_dtype": "float32", "partial_rotary_factor": 0.25,
                    "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "rms_norm_eps": 1e-6,
                    "max_position_embeddings": 262144, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
                    "tie_word_embeddings": False, "vocab_size": 248320, "head_dim": 256}
GATE_TYPE = {"Qwen3.6-27B": "swish", "Qwen3.8-27B": "swish", "Qwen3.8-2.4T-A95B": "swish"}

PROMPTS = [[31, 7, 1500, 42, 9, 1000, 3, 77], [400, 401, 402]]
MAX_NEW = 12


@pytest.mark.parametrize("model", NEW_MODELS)
def test_config_has_every_key_of_the_published_one(model):
    """Every key of the hub config is written, at full widths, with the published value where the value is not a
    size; a text-only release is a flat Qwen3_5MoeForCausalLM config without M-RoPE keys."""
    spec = tc.like_spec(model)
    config = tc.full_config(spec, tc.spec_sizes(spec).vocab_size, eos_id=1, pad_id=2)
    text_only = REAL_MODELS[model].text_only
    assert spec.layout == ("text" if text_only else "multimodal")
    text = config if text_only else config["text_config"]
    assert PUBLISHED_TEXT_KEYS[model] - text.keys() == set()
    if not text_only:
        assert MULTIMODAL_TOP_KEYS - config.keys() == set()
    assert {k: text[k] for k in PUBLISHED_VALUES} == PUBLISHED_VALUES
    assert text.get("output_gate_type") == GATE_TYPE.get(model)
    rope = text["rope_parameters"]
    assert (rope["rope_theta"], rope["partial_rotary_factor"], rope["rope_type"]) == (10000000, 0.25, "default")
    assert MROPE_KEYS.isdisjoint(rope) if text_only else rope["mrope_section"] == [11, 11, 10]
    moe = REAL_MODELS[model].num_experts > 0
    want = ("Qwen3_5MoeForCausalLM" if text_only else "Qwen3_5MoeForConditionalGeneration") if moe else \
        "Qwen3_5ForConditionalGeneration"
    assert config["architectures"] == [want]
    assert config["model_type"] == ("qwen3_5_moe" if moe else "qwen3_5") + ("_text" if text_only else "")


def test_the_text_only_release_has_no_multimodal_layout(tmp_path):
    out = tmp_path / "x"
    result = CliRunner().invoke(main, ["make-tiny", str(out), "--like", "qwen3.8-2.4t-a95b", "--layout",
                                       "multimodal"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == ["error: Qwen3.8-2.4T-A95B is published as a text model alone (no "
                                                  "vision tower); leave out --layout multimodal"]
    assert not out.exists()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """model -> (source, W8A8 artifact): `make-tiny --like MODEL --layers 2` at shrunk widths, converted."""
    root = tmp_path_factory.mktemp("new-models")
    real_like_spec = tc.like_spec
    made = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tc, "like_spec", lambda model, *a, **k: replace(real_like_spec(model, *a, **k),
                                                                      shrink_widths=SHRINK.get(model, 16)))
        for model in NEW_MODELS:
            src, out = root / f"{model}-bf16", root / f"{model}-w8a8"
            for args in (["make-tiny", str(src), "--like", model.lower(), "--layers", "2", "--quiet"],
                         ["convert-qwen35", "--a8w8", str(src), str(out), "--quiet"]):
                result = CliRunner().invoke(main, args)
                assert result.exit_code == 0, (args[0], result.output)
            made[model] = src, out
    return made


@pytest.mark.parametrize("model", NEW_MODELS)
def test_make_tiny_convert_and_check_pass(artifacts, model):
    src, out = artifacts[model]
    config = json.loads((src / "config.json").read_text())
    text = config.get("text_config", config)
    assert text["num_hidden_layers"] == 2 and text["hidden_size"] == REAL_MODELS[model].hidden_size // SHRINK.get(
        model, 16)
    for folder in (src, out):
        result = CliRunner().invoke(main, ["check", str(folder)])
        assert result.exit_code == 0, result.output
        assert result.output.strip().endswith(": OK")


@torch.no_grad()
@pytest.mark.parametrize("model", NEW_MODELS)
def test_artifact_generates_with_mtp_the_tokens_of_greedy(artifacts, model):
    """The W8A8 artifact in float64 (where a verify of k + 1 tokens and single-token decodes agree to ~1e-12):
    greedy with MTP k = 1, 2, 3 drafts is plain greedy, token for token."""
    runtime = load_model(artifacts[model][1], "cpu", torch.float64)
    assert runtime.mtp is not None
    plain = generate(runtime, PROMPTS, MAX_NEW).tokens
    assert all(len(tokens) == MAX_NEW for tokens in plain) and len({t for row in plain for t in row}) > 3
    for k in (1, 2, 3):
        speculative = generate(runtime, PROMPTS, MAX_NEW, mtp=k)
        assert speculative.tokens == plain, k
        assert all(rounds > 0 for rounds in speculative.stats.rounds)
