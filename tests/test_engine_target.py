"""`convert-qwen35 --engine`: by default the artifact is what the recipe asks (msModelSlim's Qwen3.6 recipe
quantizes the GatedDeltaNet in_proj_qkv / in_proj_z); naming an engine release keeps FLOAT exactly what the table
of engine facts says that release cannot load, each such layer in the ignore-list with the engine, its releases
and the issue; `npuport check` says which engines load the artifact."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from click.testing import CliRunner

from npuport.cli import main
from npuport.convert.engine_facts import EngineTarget, engine_facts, newest_releases
from npuport.errors import NpuportError

DESCRIPTION = "quant_model_description.json"
GDN_INPUT = re.compile(r"linear_attn\.in_proj_(qkv|z)\.weight$")


def convert(src, out, *extra: str) -> tuple[dict, dict, str]:
    """(labels, manifest, log) of `npuport convert-qwen35 --a8w8 src out --recipe qwen3_6_27b_w8a8 extra...`."""
    result = CliRunner().invoke(main, ["convert-qwen35", "--a8w8", str(src), str(out), "--recipe", "qwen3_6_27b_w8a8",
                                       "--quiet", *extra])
    assert result.exit_code == 0, result.output
    labels = json.loads((out / DESCRIPTION).read_text())
    return labels, json.loads((out / "npuport_manifest.json").read_text()), result.output


def gdn_input_labels(labels: dict) -> set[str]:
    return {label for name, label in labels.items() if GDN_INPUT.search(name)}


@pytest.fixture(scope="module")
def engine_artifacts(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-target")
    src = tiny_checkpoints["dense-text"]
    return {engine: convert(src, root / (engine or "default"), *(["--engine", engine] if engine else []))
            for engine in (None, "sglang", "vllm-ascend", "sglang==0.5.17")}


def test_the_default_writes_what_the_recipe_asks(engine_artifacts):
    labels, manifest, _ = engine_artifacts[None]
    assert gdn_input_labels(labels) == {"W8A8_DYNAMIC"}
    # in_proj_b / in_proj_a are not in the recipe: FLOAT, a fused pair of their own
    assert {label for name, label in labels.items() if re.search(r"in_proj_[ab]\.weight$", name)} == {"FLOAT"}
    assert manifest["engine"] is None


def test_sglang_keeps_exactly_the_layers_it_cannot_load_float(engine_artifacts):
    default, _, _ = engine_artifacts[None]
    labels, manifest, log = engine_artifacts["sglang"]
    assert gdn_input_labels(labels) == {"FLOAT"}
    changed = {name for name in default if name in labels and default[name] != labels[name]}
    assert changed and all(GDN_INPUT.search(name) for name in changed)
    newest = str(newest_releases()["sglang"])
    assert manifest["engine"] == {"name": "sglang", "version": newest}
    reasons = {entry["reason"] for entry in manifest["ignore_list"] if ".linear_attn.in_proj_qkv" in entry["module"]}
    assert len(reasons) == 1
    reason = reasons.pop()
    assert f"--engine sglang {newest}" in reason and "sglang/issues/36423" in reason
    assert "issues/36423" in log


def test_an_engine_that_loads_them_gets_the_recipe_unchanged(engine_artifacts):
    assert engine_artifacts["vllm-ascend"][0] == engine_artifacts[None][0]


def test_a_named_release_follows_the_facts_version_range(engine_artifacts):
    fact = next(f for f in engine_facts() if f.id == "sglang-quantized-gdn-input-projections")
    expected = "FLOAT" if fact.applies_to(EngineTarget.parse("sglang==0.5.17").version) else "W8A8_DYNAMIC"
    assert gdn_input_labels(engine_artifacts["sglang==0.5.17"][0]) == {expected}


def test_check_says_which_engines_load_an_artifact(engine_artifacts, tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    outputs = {}
    for engine in (None, "sglang"):
        art = next(root.glob(f"engine-target*/{engine or 'default'}"))
        result = CliRunner().invoke(main, ["check", str(art)])
        assert result.exit_code == 0, result.output
        outputs[engine] = [line for line in result.output.splitlines() if line.startswith("engine: ")]
    assert any(line.startswith("engine: sglang") and "cannot load it" in line and "36423" in line
               and "--engine sglang" in line for line in outputs[None])
    assert any(line.startswith("engine: vllm-ascend") and "loads it" in line for line in outputs[None])
    assert len(outputs["sglang"]) == 2 and all("loads it" in line for line in outputs["sglang"])


@pytest.mark.parametrize(("text", "message"), [
    ("trt-llm", "unknown engine"),
    ("sglang==soon", "not a version number"),
])
def test_an_unknown_engine_or_version_is_one_line(text, message):
    with pytest.raises(NpuportError, match=message):
        EngineTarget.parse(text)


def test_keep_float_outside_a_cannot_load_fact_is_refused(tmp_path):
    from importlib import resources

    data = yaml.safe_load((resources.files("npuport.data") / "engine_facts.yaml").read_text())
    data["facts"][0]["keep_float"] = "linear_attn"
    path = tmp_path / "facts.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(NpuportError, match="keep_float belongs to cannot_load facts"):
        engine_facts(path)
