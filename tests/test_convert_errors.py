"""Bad inputs give a clear error naming the file and tensor, a non-zero exit, and leave nothing behind;
recipes in msModelSlim's schema load; output bytes do not depend on --workers or on the run."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from npuport.cli import main
from npuport.convert.safetensors_io import read_header


def copy_source(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(src, dst)
    return dst


def run_convert(src: Path, out: Path, *extra: str):
    return CliRunner().invoke(main, ["convert-qwen35", "--a8w8", str(src), str(out), "--quiet", *extra])


def assert_failed_cleanly(result, out: Path, *needles: str) -> None:
    assert result.exit_code != 0, result.output
    for needle in needles:
        assert needle in result.output, (needle, result.output)
    assert "Traceback" not in result.output
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")], "partial output left behind"


@pytest.fixture
def dense_src(tiny_checkpoints, tmp_path) -> Path:
    return copy_source(tiny_checkpoints["dense-multimodal"], tmp_path)


def shard_of(src: Path, tensor: str) -> Path:
    index = json.loads((src / "model.safetensors.index.json").read_text())
    return src / index["weight_map"][tensor]


MLP = "model.language_model.layers.1.mlp.up_proj.weight"


def test_missing_shard(dense_src, tmp_path):
    shard = shard_of(dense_src, MLP)
    shard.unlink()
    assert_failed_cleanly(run_convert(dense_src, tmp_path / "out"), tmp_path / "out", shard.name, "missing")


def test_truncated_shard(dense_src, tmp_path):
    shard = shard_of(dense_src, MLP)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    assert_failed_cleanly(run_convert(dense_src, tmp_path / "out"), tmp_path / "out", shard.name, "truncated")


def test_corrupt_header(dense_src, tmp_path):
    shard = shard_of(dense_src, MLP)
    data = bytearray(shard.read_bytes())
    data[8:12] = b"#!@%"
    shard.write_bytes(bytes(data))
    assert_failed_cleanly(run_convert(dense_src, tmp_path / "out"), tmp_path / "out", shard.name, "corrupt")


def test_index_names_missing_tensor(dense_src, tmp_path):
    index_path = dense_src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.language_model.layers.9.mlp.up_proj.weight"] = index["weight_map"][MLP]
    index_path.write_text(json.dumps(index))
    assert_failed_cleanly(run_convert(dense_src, tmp_path / "out"), tmp_path / "out",
                          "model.language_model.layers.9.mlp.up_proj.weight")


def test_unknown_model_type(dense_src, tmp_path):
    cfg = json.loads((dense_src / "config.json").read_text())
    cfg["model_type"] = "llama"
    (dense_src / "config.json").write_text(json.dumps(cfg))
    assert_failed_cleanly(run_convert(dense_src, tmp_path / "out"), tmp_path / "out", "unknown model_type", "llama")


def test_nan_in_weight_to_quantize(dense_src, tmp_path):
    shard = shard_of(dense_src, MLP)
    entry = read_header(shard)[0][MLP]
    data = bytearray(shard.read_bytes())
    nan = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.int16).item()
    data[entry.begin + 2 * 70 : entry.begin + 2 * 71] = struct.pack("<h", nan)
    shard.write_bytes(bytes(data))
    assert_failed_cleanly(run_convert(dense_src, tmp_path / "out"), tmp_path / "out", shard.name, MLP, "NaN")


def test_not_enough_disk_space(dense_src, tmp_path, monkeypatch):
    import shutil as sh

    real = sh.disk_usage
    monkeypatch.setattr(sh, "disk_usage", lambda p: real(p)._replace(free=1000))
    assert_failed_cleanly(run_convert(dense_src, tmp_path / "out"), tmp_path / "out", "not enough disk space")


def test_refuses_to_overwrite_without_force(dense_src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run_convert(dense_src, out)
    assert result.exit_code != 0 and "--force" in result.output
    assert (out / "keep.txt").read_text() == "mine"
    forced = run_convert(dense_src, out, "--force")  # --force replaces only what npuport wrote
    assert forced.exit_code != 0 and (out / "keep.txt").read_text() == "mine"


MSMODELSLIM_STYLE_MOE = """
apiversion: multimodal_vlm_modelslim_v1
metadata:
  config_id: my_moe_recipe
  label: {w_bit: 8, a_bit: 8}
shared_qconfig: &dyn
  act: {scope: "per_token", dtype: "int8", symmetric: True, method: "minmax"}
  weight: {scope: "per_channel", dtype: "int8", symmetric: True, method: "minmax"}
spec:
  process:
    - type: "group"
      configs:
        - type: "linear_quant"
          qconfig: *dyn
          include: ["*self_attn*"]
          exclude: ["*self_attn.o_proj*"]
        - type: "linear_quant"
          qconfig: *dyn
          include: ["*mlp.experts*"]
  save:
    - type: "ascendv1_saver"
      part_file_size: 4
  dataset: "calibImages"
"""


def test_msmodelslim_recipe_without_mtp_exclusion_still_keeps_mtp_bf16(tiny_checkpoints, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(MSMODELSLIM_STYLE_MOE)
    out = tmp_path / "out"
    result = run_convert(tiny_checkpoints["moe-multimodal-fused"], out, "--recipe", str(recipe))
    assert result.exit_code == 0, result.output
    assert "spec.dataset ignored" in result.output
    desc = json.loads((out / "quant_model_description.json").read_text())
    assert all(v == "FLOAT" for k, v in desc.items() if k.startswith("mtp."))
    assert desc["model.language_model.layers.0.mlp.experts.5.up_proj.weight"] == "W8A8_DYNAMIC"
    manifest = json.loads((out / "npuport_manifest.json").read_text())
    mtp = [e for e in manifest["ignore_list"] if e["module"] == "mtp.layers.0.self_attn.q_proj"][0]
    assert "asked to quantize it" in mtp["reason"]


def test_recipe_with_smoothing_is_refused_unless_skipped(dense_src, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(MSMODELSLIM_STYLE_MOE.replace("  process:\n", "  process:\n    - type: \"iter_smooth\"\n"
                                                                    "      include: [\"*\"]\n"))
    out = tmp_path / "out"
    assert_failed_cleanly(run_convert(dense_src, out, "--recipe", str(recipe)), out, "iter_smooth", "not implemented")
    result = run_convert(dense_src, out, "--recipe", str(recipe), "--skip-unsupported")
    assert result.exit_code == 0 and "skipped" in result.output


def test_static_scheme_is_refused(dense_src, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(MSMODELSLIM_STYLE_MOE.replace('act: {scope: "per_token"', 'act: {scope: "per_tensor"'))
    out = tmp_path / "out"
    assert_failed_cleanly(run_convert(dense_src, out, "--recipe", str(recipe)), out, "per_tensor", "W8A8_DYNAMIC")


def test_fused_pieces_share_a_label(dense_src, tmp_path):
    recipe = tmp_path / "r.yaml"
    # the dense MLP quantized too: a recipe that would quantize nothing is refused
    recipe.write_text(MSMODELSLIM_STYLE_MOE.replace('exclude: ["*self_attn.o_proj*"]',
                                                    'exclude: ["*self_attn.o_proj*", "*k_proj*"]')
                      .replace('include: ["*mlp.experts*"]', 'include: ["*mlp*"]'))
    out = tmp_path / "out"
    assert run_convert(dense_src, out, "--recipe", str(recipe)).exit_code == 0
    desc = json.loads((out / "quant_model_description.json").read_text())
    p = "model.language_model.layers.3.self_attn."
    assert {desc[p + x + ".weight"] for x in ("q_proj", "k_proj", "v_proj")} == {"FLOAT"}
    assert desc["model.language_model.layers.3.mlp.up_proj.weight"] == "W8A8_DYNAMIC"


def artifact_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_output_is_deterministic_and_independent_of_workers(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["moe-multimodal-fused"]
    outs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    for out, workers in zip(outs, ["1", "1", "3"], strict=True):
        assert run_convert(src, out, "--workers", workers, "--part-file-size", "0.0004").exit_code == 0
    a, b, c = (artifact_bytes(o) for o in outs)
    assert len([n for n in a if n.endswith(".safetensors")]) > 2
    assert a == b == c


def test_quantization_config_is_removed_everywhere(dense_src, tmp_path):
    cfg = json.loads((dense_src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8"}
    cfg["text_config"]["quantization_config"] = {"quant_method": "fp8"}
    (dense_src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    assert run_convert(dense_src, out).exit_code == 0
    written = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in written and "quantization_config" not in written["text_config"]
