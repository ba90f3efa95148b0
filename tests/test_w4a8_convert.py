"""`convert-qwen35 --w4a8`: msModelSlim's W4A8 recipe (int4 routed experts, W8A8 attention) written as msModelSlim
writes it (tests/test_msmodelslim_golden.py compares every tensor with msModelSlim's own output); here: the option,
its refusals, `npuport check` on the W4A8 layout (a planted fault in each W4A8 tensor fails it), and the model card's
quantization section."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from npuport.cli import main
from npuport.convert.check import check_artifact

SHARD = "quant_model_weights-00001-of-00001.safetensors"
DESCRIPTION = "quant_model_description.json"


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def w4a8_artifact(tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("w4a8") / "art"
    result = run("convert-qwen35", "--w4a8", tiny_checkpoints["moe-text-per-expert"], out, "--quiet")
    assert result.exit_code == 0, result.output
    return out


def test_w4a8_writes_int4_routed_experts_and_w8a8_attention(w4a8_artifact):
    labels = json.loads((w4a8_artifact / DESCRIPTION).read_text())
    tensors = load_file(w4a8_artifact / SHARD)
    experts = {n for n in labels if ".mlp.experts." in n and not n.startswith("mtp.")}
    assert experts and {labels[n] for n in experts} == {"W4A8_DYNAMIC"}
    assert {n.rsplit(".", 1)[1] for n in experts} == {"weight", "weight_scale", "weight_offset", "scale_bias"}
    assert {labels[n] for n in labels if ".self_attn.q_proj." in n and not n.startswith("mtp.")} == {"W8A8_DYNAMIC"}
    assert {labels[n] for n in labels if n.startswith("mtp.")} == {"FLOAT"}
    assert labels["model_quant_type"] == "W8A8_DYNAMIC"  # as msModelSlim 26.1 writes it
    up = next(n for n in experts if n.endswith("up_proj.weight"))
    down = next(n for n in experts if n.endswith("down_proj.weight"))
    assert tensors[up].dtype == torch.int8 and tensors[up.replace("weight", "scale_bias")].shape[1] == 1
    assert tensors[down.replace("weight", "scale_bias")].shape[1] == 16
    manifest = json.loads((w4a8_artifact / "npuport_manifest.json").read_text())
    assert manifest["scheme"] == "W4A8_DYNAMIC" and manifest["schemes"] == ["W4A8_DYNAMIC", "W8A8_DYNAMIC"]
    assert manifest["command"].startswith("convert-qwen35 --w4a8")


def test_w4a8_is_refused_where_it_would_write_no_int4(tiny_checkpoints, tmp_path):
    dense = run("convert-qwen35", "--w4a8", tiny_checkpoints["dense-text"], tmp_path / "d")
    assert dense.exit_code == 1 and "a dense model has no routed experts" in dense.output
    both = run("convert-qwen35", "--w4a8", "--a8w8", tiny_checkpoints["moe-text-per-expert"], tmp_path / "b")
    assert both.exit_code == 1 and "choose one scheme" in both.output
    assert not (tmp_path / "d").exists() and not (tmp_path / "b").exists()


def planted(artifact, tmp_path, change) -> list[str]:
    """check_artifact of a copy of `artifact` whose shard `change` edited in place (tensors, labels)."""
    copy = tmp_path / "copy"
    shutil.copytree(artifact, copy)
    tensors = load_file(copy / SHARD)
    labels = json.loads((copy / DESCRIPTION).read_text())
    change(tensors, labels)
    save_file(tensors, copy / SHARD, metadata={"format": "pt"})
    (copy / DESCRIPTION).write_text(json.dumps(labels))
    return check_artifact(copy)


def first(tensors, suffix: str) -> str:
    return next(n for n in sorted(tensors) if ".mlp.experts." in n and not n.startswith("mtp.") and n.endswith(suffix))


@pytest.mark.parametrize(("fault", "message"), [
    (lambda t, lab: t.__setitem__(first(t, "up_proj.scale_bias"), t[first(t, "up_proj.scale_bias")] * 2),
     "is not 8 x the sum of the dequantized weight"),
    (lambda t, lab: t.__setitem__(first(t, "down_proj.scale_bias"), t[first(t, "down_proj.scale_bias")][:, :1].clone()),
     "must be float32"),
    (lambda t, lab: lab.__setitem__(first(t, "gate_proj.scale_bias"), "W8A8_DYNAMIC"),
     "must be W4A8_DYNAMIC like"),
    (lambda t, lab: t.__setitem__(first(t, "up_proj.weight_offset"), t[first(t, "up_proj.weight_offset")] + 1),
     "must be all zeros"),
    (lambda t, lab: t.__setitem__(first(t, "down_proj.weight"),
                                  torch.cat([t[first(t, "down_proj.weight")]] * 2)),
     "config"),
])
def test_check_finds_a_fault_planted_in_a_w4a8_tensor(w4a8_artifact, tmp_path, fault, message):
    assert check_artifact(w4a8_artifact) == []
    problems = planted(w4a8_artifact, tmp_path, fault)
    assert any(message in p for p in problems), problems


def test_the_card_lists_the_int4_experts_apart(w4a8_artifact, tmp_path):
    result = run("package", w4a8_artifact, "--out", tmp_path / "release")
    assert result.exit_code == 0, result.output
    card = (tmp_path / "release" / "README.md").read_text()
    section = card.split("## What is quantized", 1)[1].split("## Kept in BF16", 1)[0]
    assert "linear layers are W4A8_DYNAMIC (int4 weight packed two to a byte" in section
    assert "`model.layers.*.mlp.experts.*.down_proj`" in section.split("W4A8_DYNAMIC", 1)[1]
    assert card.startswith("---") and "W4A8_DYNAMIC for Ascend NPUs" in card
