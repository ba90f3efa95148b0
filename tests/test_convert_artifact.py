"""convert-qwen35 on tiny checkpoints of every kind: the artifact holds every source tensor (FLOAT ones
byte-identical, quantized ones equal to the reference math), the description matches the shards, and the
recipes select exactly the layers CONTRACT.md lists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from npuport.convert.converter import convert_qwen35
from tests.test_convert_math import reference_w8a8

PART_GB = 0.0004  # ~430 kB shards, so every tiny artifact is sharded
GLOBAL_KEYS = ["version", "model_quant_type", "metadata", "group_size", "optional"]


def load_all(folder: Path, index_name: str) -> dict[str, torch.Tensor]:
    index = json.loads((folder / index_name).read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / shard), "pt") as f:  # the reference reader, not ours
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


@pytest.fixture(scope="module")
def converted(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("artifacts")
    return {
        kind: convert_qwen35(src, root / kind, part_file_size_gb=PART_GB, show_progress=False, log=lambda m: None).out
        for kind, src in tiny_checkpoints.items()
    }


def expected_sources(name: str, src: dict[str, torch.Tensor]) -> torch.Tensor:
    """The source tensor an output tensor comes from (per-expert slices of fused experts)."""
    m = re.match(
        r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale|weight_offset)$", name
    )
    if m and f"{m[1]}.gate_up_proj" in src:
        e = int(m[2])
        if m[3] == "down_proj":
            return src[f"{m[1]}.down_proj"][e]
        gate_up = src[f"{m[1]}.gate_up_proj"][e]
        half = gate_up.shape[0] // 2
        return gate_up[:half] if m[3] == "gate_proj" else gate_up[half:]
    base = re.sub(r"\.(weight_scale|weight_offset)$", ".weight", name)
    return src[base]


def test_every_tensor_matches_its_source(tiny_checkpoints, converted):
    for kind, art in converted.items():
        src = load_all(tiny_checkpoints[kind], "model.safetensors.index.json")
        out = load_all(art, "quant_model_weights.safetensors.index.json")
        desc = json.loads((art / "quant_model_description.json").read_text())
        assert len(json.loads((art / "quant_model_weights.safetensors.index.json").read_text())["weight_map"]) == len(
            out
        )
        assert (
            len(
                {
                    v
                    for v in json.loads((art / "quant_model_weights.safetensors.index.json").read_text())[
                        "weight_map"
                    ].values()
                }
            )
            > 1
        ), "tiny artifacts are written in several shards"
        covered = set()
        for name, t in out.items():
            source = expected_sources(name, src)
            covered.add(id(source))
            if desc[name] == "FLOAT":
                assert t.dtype == source.dtype and torch.equal(
                    t.view(torch.uint8), source.contiguous().view(torch.uint8)
                ), name
            elif name.endswith(".weight"):
                q, scale = reference_w8a8(source)
                np.testing.assert_array_equal(t.numpy(), q, err_msg=name)
                np.testing.assert_array_equal(out[name + "_scale"].numpy(), scale, err_msg=name)
                assert not out[name[: -len("weight")] + "weight_offset"].any()
        # every source tensor went somewhere: names that survive unsplit, or expert slices
        for name in src:
            if name.endswith(("gate_up_proj", "experts.down_proj")):
                prefix = name.rsplit(".", 1)[0]
                assert any(k.startswith(prefix + ".0.") for k in out), name
            else:
                assert name in out, f"{kind}: {name} missing from the artifact"


def test_description_lists_exactly_the_written_tensors_in_model_order(converted):
    for kind, art in converted.items():
        desc = json.loads((art / "quant_model_description.json").read_text())
        out = load_all(art, "quant_model_weights.safetensors.index.json")
        keys = list(desc)
        assert keys[-5:] == GLOBAL_KEYS
        assert desc["model_quant_type"] == "W8A8_DYNAMIC" and desc["version"] == "1.0.0" and desc["group_size"] == 0
        assert set(keys[:-5]) == set(out), kind
        tensors = keys[:-5]
        first_mtp = next(i for i, k in enumerate(tensors) if k.startswith("mtp."))
        last_layer = max(i for i, k in enumerate(tensors) if ".layers." in k and not k.startswith("mtp."))
        assert last_layer < first_mtp, "decoder layers come before mtp.*"
        assert tensors[-1] == "lm_head.weight"
        if "multimodal" in kind:
            assert tensors[0].startswith("model.visual.")
        for name, t in out.items():
            if desc[name] == "W8A8_DYNAMIC":
                assert t.dtype == (torch.int8 if name.endswith(".weight") else torch.float32)
            if name.startswith("mtp."):
                assert desc[name] == "FLOAT" and t.dtype == torch.bfloat16


def quantized_modules(art: Path) -> set[str]:
    desc = json.loads((art / "quant_model_description.json").read_text())
    return {k[: -len(".weight")] for k, v in desc.items() if v == "W8A8_DYNAMIC" and k.endswith(".weight")}


def test_dense_recipe_quantizes_attention_and_mlp_only(converted):
    q = quantized_modules(converted["dense-multimodal"])
    p = "model.language_model.layers."
    expected = {f"{p}3.self_attn.{x}" for x in ("q_proj", "k_proj", "v_proj", "o_proj")}
    expected |= {f"{p}{i}.mlp.{x}" for i in range(4) for x in ("gate_proj", "up_proj", "down_proj")}
    assert q == expected


def test_moe_recipe_quantizes_qkv_and_routed_experts_only(converted):
    for kind, p in (("moe-multimodal-fused", "model.language_model.layers."), ("moe-text-per-expert", "model.layers.")):
        q = quantized_modules(converted[kind])
        expected = {f"{p}3.self_attn.{x}" for x in ("q_proj", "k_proj", "v_proj")}
        expected |= {
            f"{p}{i}.mlp.experts.{e}.{x}"
            for i in range(4)
            for e in range(8)
            for x in ("gate_proj", "up_proj", "down_proj")
        }
        assert q == expected, kind


def test_manifest_records_ignore_list_with_reasons(converted):
    manifest = json.loads((converted["moe-multimodal-fused"] / "npuport_manifest.json").read_text())
    reasons = {e["module"]: e["reason"] for e in manifest["ignore_list"]}
    assert "MTP head" in reasons["mtp.fc"]
    assert "o_proj" in reasons["model.language_model.layers.3.self_attn.o_proj"]
    assert "model.language_model.layers.0.mlp.shared_expert.gate_proj" in reasons
    assert len(manifest["source"]["checksums"]["fingerprint_sha256"]) == 64


def test_copied_files_and_config(tiny_checkpoints, converted):
    src, art = tiny_checkpoints["dense-multimodal"], converted["dense-multimodal"]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (art / name).read_bytes() == (src / name).read_bytes()
    assert not (art / "model.safetensors.index.json").exists()
    assert not list(art.glob("model-*.safetensors"))
    assert json.loads((art / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert (art / "dense-multimodal_best_practice.yaml").exists()
