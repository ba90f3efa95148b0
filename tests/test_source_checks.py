"""Sources are checked against their config.json before a byte is written: layer count, layer_types, the fields
the runtime needs, hidden and intermediate sizes, expert counts, fused gate_up_proj halves, per-expert shapes, no
empty or negative shapes. Convert, `npuport check` and the runtime's loader apply the same check and report a
problem in one line naming the tensor or the field."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from npuport.cli import main
from npuport.errors import NpuportError
from npuport.runtime.loader import load_model
from tests.test_input_paths import one_line_error

SOURCE_INDEX = "model.safetensors.index.json"
ARTIFACT_INDEX = "quant_model_weights.safetensors.index.json"


def copy_model(folder: Path, tmp_path: Path, name: str = "src") -> Path:
    dst = tmp_path / name
    shutil.copytree(folder, dst)
    return dst


def edit_text_config(model: Path, edit: Callable[[dict], None]) -> None:
    """Apply `edit` to the text model's config: `text_config` when there is one, else the top level."""
    config = json.loads((model / "config.json").read_text())
    edit(config.get("text_config") or config)
    (model / "config.json").write_text(json.dumps(config))


def rewrite_tensor(model: Path, index_name: str, name: str, value: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace tensor `name` in its shard by value(old tensor), through the safetensors library."""
    shard = model / json.loads((model / index_name).read_text())["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = value(tensors[name]).contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})


def convert_error(src: Path, tmp_path: Path, *needles: str) -> str:
    """convert-qwen35's one-line error for `src`, after checking it wrote nothing and named every needle."""
    out = tmp_path / "out"
    line = one_line_error(CliRunner().invoke(main, ["convert-qwen35", "--a8w8", str(src), str(out), "--quiet"]),
                          *needles)
    assert not out.exists() and not list(tmp_path.glob(".out*")), "convert wrote something"
    return line


def loader_error(model: Path, *needles: str) -> str:
    with pytest.raises(NpuportError) as refused:
        load_model(model, "cpu")
    message = str(refused.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


DENSE_LAYER = "model.layers.{i}."


@pytest.mark.parametrize("declared", [3, 5])
def test_num_hidden_layers_must_match_the_layers_present(tiny_checkpoints, tmp_path, declared):
    src = copy_model(tiny_checkpoints["dense-text"], tmp_path)

    def declare(cfg):
        cfg["num_hidden_layers"] = declared
        cfg["layer_types"] = (cfg["layer_types"] + ["linear_attention"])[:declared]

    edit_text_config(src, declare)
    convert_error(src, tmp_path, "num_hidden_layers is", str(declared), "layers 0..3")
    loader_error(src, "num_hidden_layers is", str(declared))


def test_check_convert_and_loader_report_the_same_config_problem(tiny_checkpoints, tiny_artifacts, tmp_path):
    def declare_three(cfg):
        cfg["num_hidden_layers"] = 3
        cfg["layer_types"] = cfg["layer_types"][:3]

    src = copy_model(tiny_checkpoints["moe-text-per-expert"], tmp_path, "src")
    art = copy_model(tiny_artifacts["moe-text-per-expert"], tmp_path, "art")
    edit_text_config(src, declare_three)
    edit_text_config(art, declare_three)
    problem = "num_hidden_layers is 3, the checkpoint has decoder layers 0..3 (4 of them)"
    convert_error(src, tmp_path, problem)
    checked = CliRunner().invoke(main, ["check", str(art)])
    assert checked.exit_code == 1 and f"FAIL config.json: {problem}" in checked.output, checked.output
    loader_error(art, problem)


@pytest.mark.parametrize("edit, needles", [
    (lambda c: c.update(layer_types=c["layer_types"][::-1]),
     ["layer_types[0] says full_attention", "linear_attn tensors"]),
    (lambda c: c.update(layer_types=["linear"] * len(c["layer_types"])), ["layer_types must list 4"]),
    (lambda c: c.update(layer_types=c["layer_types"][:3]), ["layer_types must list 4", "num_hidden_layers"]),
    (lambda c: c.pop("head_dim"), ["missing 'head_dim'"]),
    (lambda c: c.pop("linear_num_value_heads"), ["missing 'linear_num_value_heads'"]),
    (lambda c: c.update(hidden_size="64"), ["text_config.hidden_size must be a positive integer, is '64'"]),
    (lambda c: c.update(vocab_size=0), ["text_config.vocab_size must be a positive integer, is 0"]),
    (lambda c: c.update(intermediate_size=96), ["mlp.gate_proj.weight has shape [192, 64]", "intermediate_size=96"]),
    (lambda c: c.update(hidden_size=96), ["has shape", "hidden_size=96"]),
    (lambda c: c.update(vocab_size=4096), ["embed_tokens.weight has shape", "vocab_size=4096"]),
    (lambda c: c.update(mtp_num_hidden_layers=2), ["mtp_num_hidden_layers is 2, the MTP head has layers 0..0"]),
    (lambda c: c.update(tie_word_embeddings="no"), ["tie_word_embeddings must be true or false"]),
], ids=["kinds-swapped", "kind-misspelt", "types-short", "no-head_dim", "no-linear-heads", "hidden-string",
        "vocab-zero", "intermediate", "hidden", "vocab", "mtp-layers", "tie-string"])
def test_dense_config_fields_are_checked_against_the_tensors(tiny_checkpoints, tmp_path, edit, needles):
    src = copy_model(tiny_checkpoints["dense-multimodal"], tmp_path)
    edit_text_config(src, edit)
    convert_error(src, tmp_path, *needles)


@pytest.mark.parametrize("edit, needles", [
    (lambda c: c.update(num_experts=6), ["mlp.gate.weight has shape [8, 64]", "num_experts=6"]),
    (lambda c: c.update(moe_intermediate_size=16), ["experts.gate_up_proj has shape [8, 64, 64]",
                                                     "2*moe_intermediate_size=32"]),
    (lambda c: c.update(shared_expert_intermediate_size=48), ["shared_expert.gate_proj.weight",
                                                               "shared_expert_intermediate_size=48"]),
    (lambda c: c.update(num_experts_per_tok=9), ["num_experts_per_tok 9 exceeds text_config.num_experts 8"]),
    (lambda c: c.pop("num_experts"), ["missing 'num_experts'"]),
], ids=["experts", "moe-intermediate", "shared-intermediate", "top-k", "no-experts"])
def test_moe_config_fields_are_checked_against_the_tensors(tiny_checkpoints, tmp_path, edit, needles):
    src = copy_model(tiny_checkpoints["moe-multimodal-fused"], tmp_path)
    edit_text_config(src, edit)
    convert_error(src, tmp_path, *needles)


def test_fused_gate_up_proj_with_an_odd_row_count_is_refused(tiny_checkpoints, tmp_path):
    src = copy_model(tiny_checkpoints["moe-multimodal-fused"], tmp_path)
    name = "model.language_model.layers.2.mlp.experts.gate_up_proj"
    rewrite_tensor(src, SOURCE_INDEX, name, lambda t: torch.cat([t, t[:, :1]], dim=1))  # [8, 65, 64]
    convert_error(src, tmp_path, name, "[8, 65, 64]", "65 rows per expert is odd")
    loader_error(src, name, "odd")


def test_per_expert_tensors_must_all_have_the_same_shape(tiny_checkpoints, tmp_path):
    src = copy_model(tiny_checkpoints["moe-text-per-expert"], tmp_path)  # its MTP layer stores experts one by one
    name = "mtp.layers.0.mlp.experts.5.up_proj.weight"
    rewrite_tensor(src, SOURCE_INDEX, name, lambda t: t[:-1])
    convert_error(src, tmp_path, name, "has shape [31, 64]", "moe_intermediate_size=32")


def test_a_missing_expert_is_named(tiny_checkpoints, tmp_path):
    src = copy_model(tiny_checkpoints["moe-text-per-expert"], tmp_path)
    index = json.loads((src / SOURCE_INDEX).read_text())
    gone = [n for n in index["weight_map"] if n.startswith("mtp.layers.0.mlp.experts.7.")]
    shards = {index["weight_map"][n] for n in gone}
    for shard in shards:
        tensors = load_file(src / shard)
        save_file({k: v for k, v in tensors.items() if k not in gone}, src / shard, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in gone}
    (src / SOURCE_INDEX).write_text(json.dumps(index))
    convert_error(src, tmp_path, "mtp.layers.0.mlp.experts", "num_experts=8", "experts 0..6")


def test_a_tensor_with_an_empty_dimension_is_refused(tiny_checkpoints, tmp_path):
    src = copy_model(tiny_checkpoints["dense-text"], tmp_path)
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite_tensor(src, SOURCE_INDEX, name, lambda t: t[:0])  # [0, 64]
    convert_error(src, tmp_path, name, "[0, 64]", "empty dimension")
    loader_error(src, name, "empty dimension")


def test_a_negative_shape_is_refused(tiny_checkpoints, tmp_path):
    src = copy_model(tiny_checkpoints["dense-text"], tmp_path)
    name = "model.layers.1.mlp.up_proj.weight"
    shard = src / json.loads((src / SOURCE_INDEX).read_text())["weight_map"][name]
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    rows, cols = header[name]["shape"]
    header[name]["shape"] = [-rows, -cols]  # the same element count, so the same byte count
    text = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    convert_error(src, tmp_path, shard.name, name, "non-negative integers")
    loader_error(src, name, "non-negative integers")


@pytest.mark.parametrize(("key", "value"), [
    ("attn_output_gate", False),
    ("output_gate_type", "sigmoid"),
    ("mamba_ssm_dtype", "bfloat16"),
    ("mtp_use_dedicated_embeddings", True),
    ("mlp_only_layers", [1]),
    ("attn_output_gate", 1),  # not the published true, though equal to it in Python
])
def test_an_architecture_variant_npuport_does_not_compute_is_refused_by_name(tiny_checkpoints, tmp_path, key, value):
    """The published Qwen3.5/3.6/3.8 configs carry these keys with the one value the runtime computes; any other
    asks for another model, which convert, check and the loader refuse naming the key (not run wrongly)."""
    src = copy_model(tiny_checkpoints["dense-multimodal"], tmp_path)
    edit_text_config(src, lambda c: c.update({key: value}))
    for args in (["convert-qwen35", "--a8w8", str(src), str(tmp_path / "out")], ["check", str(src)]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1 and f"text_config.{key} is" in result.output, result.output
    with pytest.raises(NpuportError, match=f"text_config.{key} is"):
        load_model(src, "cpu")


def test_the_published_values_of_those_keys_are_taken(tiny_checkpoints, tmp_path):
    src = copy_model(tiny_checkpoints["dense-multimodal"], tmp_path)
    edit_text_config(src, lambda c: c.update(attn_output_gate=True, output_gate_type="swish", mamba_ssm_dtype="float32",
                                             mtp_use_dedicated_embeddings=False, mlp_only_layers=[]))
    result = CliRunner().invoke(main, ["check", str(src)])
    assert result.exit_code == 0, result.output
