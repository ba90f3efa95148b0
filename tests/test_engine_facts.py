"""The engine facts shipped as data: every entry well-formed; a malformed table refused naming the entry; each
condition meets exactly the artifacts it describes (hand-made labels and real converted artifacts); `npuport
check` warns of the facts an artifact meets, with their workaround and source, and still passes it; the model
card carries them beside the serving commands."""

from __future__ import annotations

from importlib import resources

import pytest
import yaml
from click.testing import CliRunner

from npuport.cli import main
from npuport.convert.engine_facts import CONDITIONS, artifact_labels, engine_facts, facts_for
from npuport.errors import NpuportError

MOE_NEXTN = "sglang-npu-nextn-float-mtp-experts"
DRAFT_INHERITS = "sglang-qwen35-mtp-draft-inherits-quantization"


def test_the_shipped_table_is_well_formed():
    facts = engine_facts()
    assert len({f.id for f in facts}) == len(facts) >= 4
    assert all(f.source and f.effect and (f.workaround or f.kind == "loads") for f in facts)
    assert {MOE_NEXTN, DRAFT_INHERITS} <= {f.id for f in facts}


@pytest.mark.parametrize(("change", "message"), [
    (lambda e: e.pop("source"), "fact 0 must have exactly the fields"),
    (lambda e: e.update(condition="moon_phase"), "kind, engine or condition unknown"),
    (lambda e: e.update(engine="trt-llm"), "kind, engine or condition unknown"),
])
def test_a_malformed_table_is_refused_naming_the_entry(tmp_path, change, message):
    data = yaml.safe_load((resources.files("npuport.data") / "engine_facts.yaml").read_text())
    change(data["facts"][0])
    path = tmp_path / "facts.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(NpuportError, match=message):
        engine_facts(path)


def test_conditions_meet_the_artifacts_they_describe():
    target_experts = "model.layers.0.mlp.experts.3.gate_proj.weight"
    mtp_experts = "mtp.layers.0.mlp.experts.3.gate_proj.weight"
    moe = {target_experts: "W8A8_DYNAMIC", mtp_experts: "FLOAT", "mtp.fc.weight": "FLOAT"}
    dense = {"model.layers.0.mlp.up_proj.weight": "W8A8_DYNAMIC", "mtp.fc.weight": "FLOAT"}
    moe_float = {target_experts: "FLOAT", mtp_experts: "FLOAT", "model.layers.0.self_attn.q_proj.weight":
                 "W8A8_DYNAMIC"}
    no_mtp = {"model.layers.0.mlp.up_proj.weight": "W8A8_DYNAMIC"}
    label_conditions = ("float_mtp_experts_beside_int8_experts", "quantized_target_with_mtp")
    meets = {name: [CONDITIONS[name](labels, {}) for labels in (moe, dense, moe_float, no_mtp)]
             for name in label_conditions}
    assert meets == {"float_mtp_experts_beside_int8_experts": [True, False, False, False],
                     "quantized_target_with_mtp": [True, True, True, False]}


def text_config(key_dim: int, value_dim: int, dtype: str = "bfloat16") -> dict:
    return {"text_config": {"linear_key_head_dim": key_dim, "linear_value_head_dim": value_dim, "dtype": dtype}}


@pytest.mark.parametrize(("config", "head_dims", "dtype"), [
    (text_config(64, 64), False, False),
    (text_config(128, 128), False, False),
    (text_config(32, 32), True, False),  # the shape vLLM's CPU build refused
    (text_config(64, 128), True, False),  # key and value head dims must be equal there
    (text_config(128, 128, "float16"), False, True),
    ({"linear_key_head_dim": 16, "linear_value_head_dim": 16, "torch_dtype": "float32"}, True, True),
])
def test_vllm_cpu_conditions_meet_bf16_sources_by_their_config(config, head_dims, dtype):
    bf16_source, artifact = {}, {"model.layers.0.mlp.up_proj.weight": "W8A8_DYNAMIC"}
    assert CONDITIONS["bf16_source_gdn_head_dims_outside_vllm_cpu_kernels"](bf16_source, config) is head_dims
    assert CONDITIONS["bf16_source_declares_another_dtype"](bf16_source, config) is dtype
    assert not CONDITIONS["bf16_source_gdn_head_dims_outside_vllm_cpu_kernels"](artifact, config)
    assert not CONDITIONS["bf16_source_declares_another_dtype"](artifact, config)


def test_check_warns_a_source_of_vllm_cpu_kernel_limits(tiny_checkpoints):
    # the tiny preset's GatedDeltaNet head dims are 16: vLLM's CPU kernels take 64 and 128
    result = CliRunner().invoke(main, ["check", str(tiny_checkpoints["dense-text"])])
    assert result.exit_code == 0, result.output
    warning = next(line for line in result.output.splitlines() if line.startswith("warning: vllm "))
    assert "64 and 128" in warning and "fla.cpp" in warning and "workaround:" in warning
    assert result.output.rstrip().endswith(": OK")


def test_check_warns_of_what_the_engines_do_with_a_moe_artifact(tiny_artifacts):
    moe, dense = tiny_artifacts["moe-multimodal-fused"], tiny_artifacts["dense-text"]
    assert {f.id for f in facts_for(artifact_labels(moe))} >= {MOE_NEXTN, DRAFT_INHERITS}
    assert MOE_NEXTN not in {f.id for f in facts_for(artifact_labels(dense))}
    result = CliRunner().invoke(main, ["check", str(moe)])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning: ")]
    nextn = next(w for w in warnings if "Unsupported ModelSlim MoE schemes" in w)
    assert "sglang 0.5.17 to 0.5.23" in nextn and "--speculative-algorithm NEXTN" in nextn
    assert "https://github.com/sgl-project/sglang/issues/34211" in nextn
    assert "workaround: add --speculative-draft-model-quantization unquant" in nextn
    assert result.output.rstrip().endswith(": OK")


def test_the_model_card_carries_the_facts_beside_the_serving_commands(tiny_artifacts, tmp_path):
    result = CliRunner().invoke(main, ["package", str(tiny_artifacts["moe-multimodal-fused"]), "--out",
                                       str(tmp_path / "release"), "--force"])
    assert result.exit_code == 0, result.output
    card = (tmp_path / "release" / "README.md").read_text()
    serving = card.split("## Serving", 1)[1].split("\n## ", 1)[0]
    sglang = serving.split("sglang:", 1)[1]
    assert "--speculative-draft-model-quantization unquant" in sglang
    nextn_versions = next(f.versions for f in engine_facts() if f.id == MOE_NEXTN)
    assert f"**Known problem** ({nextn_versions}, with `--speculative-algorithm NEXTN`)" in sglang
    assert "Versions known to load an artifact like this one: 0.5.17:" in sglang
    assert "issues/34211" in sglang and "pull/34622" in sglang
