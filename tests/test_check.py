"""`npuport check` passes a converted artifact and a make-tiny source, names each contract violation planted in a
copy of the artifact, lists every problem of a broken source, and holds both to the engine rules."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from npuport.cli import main
from npuport.convert.check import check_artifact, check_folder, check_source
from npuport.convert.converter import convert_qwen35

DESC = "quant_model_description.json"
INDEX = "quant_model_weights.safetensors.index.json"
P = "model.language_model.layers.3.self_attn."


@pytest.fixture(scope="module")
def artifact(tiny_checkpoints, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("check") / "art"
    return convert_qwen35(
        tiny_checkpoints["moe-multimodal-fused"], out, part_file_size_gb=0.0004, show_progress=False, log=lambda m: None
    ).out


@pytest.fixture
def art(artifact, tmp_path) -> Path:
    dst = tmp_path / "art"
    shutil.copytree(artifact, dst)
    return dst


def edit_json(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def rewrite_tensor(art: Path, name: str, fn) -> None:
    shard = art / json.loads((art / INDEX).read_text())["weight_map"][name]
    with safe_open(str(shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[name] = fn(tensors[name])
    save_file(tensors, str(shard), metadata={"format": "pt"})


def test_converted_artifact_passes(artifact):
    assert check_artifact(artifact) == []
    result = CliRunner().invoke(main, ["check", str(artifact)])
    assert result.exit_code == 0 and "OK" in result.output


@pytest.mark.parametrize(
    "plant, needle",
    [
        (lambda a: rewrite_tensor(a, P + "q_proj.weight_offset", lambda t: t + 1), "must be all zeros"),
        (lambda a: edit_json(a / DESC, lambda d: d.pop(P + "v_proj.weight_scale")), "has no entry in the description"),
        (lambda a: edit_json(a / DESC, lambda d: d.update({"ghost.weight": "FLOAT"})), "ghost.weight"),
        (lambda a: (a / "model.safetensors.index.json").write_text("{}"), "model.safetensors.index.json"),
        (lambda a: edit_json(a / "config.json", lambda c: c.update(quantization_config={})), "quantization_config"),
        (
            lambda a: edit_json(a / "config.json", lambda c: c["text_config"].update(quantization_config={})),
            "text_config has quantization_config",
        ),
        (lambda a: edit_json(a / DESC, lambda d: d.update({"mtp.fc.weight": "W8A8_DYNAMIC"})), "mtp.fc.weight"),
        (lambda a: rewrite_tensor(a, "mtp.norm.weight", lambda t: t.float()), "mtp.norm.weight"),
        (
            lambda a: edit_json(a / DESC, lambda d: d.update({P + "k_proj.weight": "FLOAT"})),
            "int8 weight labelled FLOAT",
        ),
        (lambda a: rewrite_tensor(a, P + "k_proj.weight_scale", lambda t: t.to(torch.bfloat16)), "must be float32"),
        (lambda a: edit_json(a / DESC, lambda d: d.update({"version": "0.9"})), "version"),
        (lambda a: (a / "extra_quant_model_description.json").write_text("{}"), "exactly one"),
        (lambda a: edit_json(a / INDEX, lambda d: d["metadata"].update(total_size=1)), "total_size"),
    ],
    ids=[
        "offset",
        "missing-entry",
        "extra-entry",
        "bf16-index",
        "qconfig",
        "qconfig-text",
        "mtp-label",
        "mtp-dtype",
        "int8-float",
        "scale-dtype",
        "globals",
        "two-descriptions",
        "total-size",
    ],
)
def test_planted_violation_is_reported(art, plant, needle):
    plant(art)
    problems = check_artifact(art)
    assert any(needle in p for p in problems), problems
    result = CliRunner().invoke(main, ["check", str(art)])
    assert result.exit_code == 1 and needle in result.output


def test_fused_group_disagreement_is_reported(art):
    # k_proj kept BF16 while q_proj/v_proj are int8: rebuild k_proj as a FLOAT layer
    def to_float(d):
        d[P + "k_proj.weight"] = "FLOAT"
        del d[P + "k_proj.weight_scale"], d[P + "k_proj.weight_offset"]

    shard = art / json.loads((art / INDEX).read_text())["weight_map"][P + "k_proj.weight"]
    with safe_open(str(shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    scale = tensors.pop(P + "k_proj.weight_scale")
    tensors.pop(P + "k_proj.weight_offset")
    tensors[P + "k_proj.weight"] = (tensors[P + "k_proj.weight"].float() * scale).to(torch.bfloat16)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    edit_json(art / DESC, to_float)
    edit_json(
        art / INDEX, lambda d: [d["weight_map"].pop(P + f"k_proj.{x}") for x in ("weight_scale", "weight_offset")]
    )
    total = sum(t.numel() * t.element_size() for t in _all(art).values())
    edit_json(art / INDEX, lambda d: d["metadata"].update(total_size=total))
    problems = check_artifact(art)
    assert len(problems) == 1 and "fused pieces carry different labels" in problems[0], problems


def _all(art: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in set(json.loads((art / INDEX).read_text())["weight_map"].values()):
        with safe_open(str(art / shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


# --- BF16 sources, and the engine rules on both ---------------------------------------------------------------


def test_a_make_tiny_source_passes(tiny_checkpoints):
    for kind, src in tiny_checkpoints.items():
        assert check_folder(src) == [], kind
    result = CliRunner().invoke(main, ["check", str(tiny_checkpoints["moe-multimodal-fused"])])
    assert result.exit_code == 0 and result.output.rstrip().endswith(": OK"), result.output


def test_a_broken_source_lists_every_violation(tiny_checkpoints, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_checkpoints["dense-multimodal"], src)

    def break_two_rules(config):
        config["text_config"]["rope_parameters"]["mrope_section"] = [11, 11, 10]  # the published models' split
        config["text_config"]["intermediate_size"] = 96  # the tensors have 192

    edit_json(src / "config.json", break_two_rules)
    (src / "preprocessor_config.json").unlink()
    problems = check_source(src)
    head_dim, factor = 32, 0.25  # the tiny preset's full-attention head and Qwen3.5's rotated share of it
    assert any(p.startswith("config.json: text_config.rope_parameters.mrope_section [11, 11, 10] sums to 32, not "
                            f"rotary_dim // 2 = {int(head_dim * factor) // 2}") for p in problems), problems
    assert any("mlp.gate_proj.weight has shape [192, 64]" in p and "intermediate_size=96" in p for p in problems)
    assert any(p.startswith("preprocessor_config.json: missing") for p in problems), problems
    layers = json.loads((src / "config.json").read_text())["text_config"]["num_hidden_layers"] + 1  # and the MTP's
    assert len(problems) == 2 + 3 * layers, problems  # one per engine rule, one per MLP projection of each layer
    result = CliRunner().invoke(main, ["check", str(src)])
    assert result.exit_code == 1
    assert [line for line in result.output.splitlines() if line.startswith("FAIL ")] == [f"FAIL {p}" for p in problems]


def test_a_source_without_weights_or_config_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    assert check_source(tmp_path / "empty") == ["config.json is missing",
                                                 "neither model.safetensors.index.json nor model.safetensors found"]


def test_an_artifact_is_held_to_the_engine_rules(art):
    edit_json(art / "config.json", lambda c: c["text_config"].update(full_attention_interval=2))
    problems = check_artifact(art)
    assert len(problems) == 1 and problems[0].startswith("config.json: text_config.layer_types[1]"), problems
    assert problems[0].endswith("[engine rule full-attention-interval]")
    result = CliRunner().invoke(main, ["check", str(art)])
    assert result.exit_code == 1 and "full_attention_interval 2" in result.output


def test_the_processor_files_travel_from_source_to_artifact_and_release(tiny_checkpoints, artifact, tmp_path):
    src = tiny_checkpoints["moe-multimodal-fused"]
    release = tmp_path / "release"
    result = CliRunner().invoke(main, ["package", str(artifact), "--out", str(release), "--force"])
    assert result.exit_code == 0, result.output
    for name in ("preprocessor_config.json", "video_preprocessor_config.json", "tokenizer.json"):
        assert (artifact / name).read_bytes() == (src / name).read_bytes(), name
        assert (release / name).read_bytes() == (src / name).read_bytes(), name
