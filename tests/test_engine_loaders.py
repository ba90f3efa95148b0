"""npuport's artifacts through the serving engines' own loader code (tests/engine_loaders): every tensor must land in
the parameter the engine builds for it, with the quantization it was written in. Artifacts are made here with
make-tiny and convert-qwen35 (every shipped recipe); known engine failures are reproduced on the releases that have
them, by the engine's own words. The engines are installed by tests/engine_loaders/install.sh; without them every
test here fails with that command. sglang 0.5.23 and 0.5.18; vllm-ascend 0.23.0 with vLLM 0.23.0."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from engine_loaders import ROOT, run_engine_many
from safetensors.torch import load_file, save_file

from npuport.cli import main
from npuport.convert.engine_facts import EngineTarget
from npuport.convert.recipe import QUANTIZED

NEWEST = "sglang==0.5.23"
VLLM = "vllm-ascend==0.23.0"  # with vLLM 0.23.0, the release it targets
OLD = "sglang==0.5.18"  # has sglang issues 34211 and 36423
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
DENSE, MOE = ROOT / "recipes" / "qwen3_5_dense_w8a8.yaml", ROOT / "recipes" / "qwen3_5_moe_w8a8.yaml"
# parameters no tensor of the artifact is loaded into, by design: sglang's Qwen3-VL vision tower makes deepstack
# mergers when the vision config names none (a Qwen3.5 has none); the MTP draft is given the target's embedding and
# lm_head (set_embed_and_head)
NO_CHECKPOINT_TENSOR = {"target": ("visual.deepstack_merger_list.",),
                        "mtp-draft": ("lm_head.weight", "model.embed_tokens.weight")}
MTP_EXPERTS_REFUSED = "Unsupported ModelSlim MoE schemes for layer mtp.layers.0.mlp.experts: W13='FLOAT', W2='FLOAT'"


def _npuport(*args: str) -> None:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output


def _moe(recipe: Path) -> bool:
    return "mlp.experts" in recipe.read_text(encoding="utf-8")


# --engine sglang output x the newest sglang, every recipe (text layout for one dense and one MoE recipe)
CASES = [(r, "multimodal") for r in RECIPES] + [
    (next(r for r in RECIPES if not _moe(r)), "text"), (next(r for r in RECIPES if _moe(r)), "text")]
GDN_RECIPE = next(r for r in RECIPES if "linear_attn.in_proj_qkv" in r.read_text(encoding="utf-8"))
# default output (no --engine) x vllm-ascend: every recipe in the multimodal layout (every released Qwen3.5 is one),
# and one dense and one MoE recipe in the text layout
DEFAULT_CASES = [(r, "multimodal") for r in RECIPES] + [(DENSE, "text"), (MOE, "text")]
VLLM_TEXT_REFUSED = "are not supported for now"


def _rewrite(src: Path, dst: Path, change) -> Path:
    """A copy of the artifact `src` whose tensors and labels `change(tensors, labels)` edits in place."""
    shutil.copytree(src, dst)
    index_path = dst / "quant_model_weights.safetensors.index.json"
    index = json.loads(index_path.read_text())
    (shard,) = set(index["weight_map"].values())
    tensors = load_file(dst / shard)
    labels = _labels(dst)
    change(tensors, labels)
    save_file(tensors, dst / shard, metadata={"format": "pt"})
    index["weight_map"] = {n: shard for n in tensors}
    index_path.write_text(json.dumps(index))
    (dst / "quant_model_description.json").write_text(json.dumps(labels))
    return dst


def _relabel_a_down_proj_float(tensors, labels) -> None:
    layer = next(n.removesuffix(".weight") for n, v in labels.items()
                 if v == "W8A8_DYNAMIC" and n.endswith("mlp.down_proj.weight"))
    for n in labels:
        if n.startswith(layer + "."):
            labels[n] = "FLOAT"


def _rename_a_gdn_projection(tensors, labels) -> None:
    old = next(n for n in labels if n.endswith("linear_attn.in_proj_qkv.weight"))
    new = old.replace("in_proj_qkv.", "in_proj_qkvz.")
    tensors[new] = tensors.pop(old)
    labels[new] = labels.pop(old)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[tuple, Path]:
    """Every artifact the tests load, made once: (recipe name, layout, engine option) -> folder, and the planted
    mismatches by name."""
    root = tmp_path_factory.mktemp("engine-loaders")
    sources = {}
    for arch in ("dense", "moe"):
        for layout in ("multimodal", "text"):
            sources[arch, layout] = root / f"{arch}-{layout}"
            _npuport("make-tiny", "--arch", arch, "--layout", layout, "--quiet", str(sources[arch, layout]))
    made: dict[tuple, Path] = {}
    wanted = [(r, lay, "sglang") for r, lay in CASES] + [(GDN_RECIPE, "text", None)]
    wanted += [(r, lay, None) for r, lay in DEFAULT_CASES if (r, lay) != (GDN_RECIPE, "text")]
    for recipe, layout, engine in wanted:
        out = root / f"{recipe.stem}-{layout}-{engine or 'default'}"
        option = ["--engine", engine] if engine else []
        _npuport("convert-qwen35", "--quiet", "--recipe", str(recipe), *option,
                 str(sources["moe" if _moe(recipe) else "dense", layout]), str(out))
        made[recipe.name, layout, engine] = out
    dense = made[DENSE.name, "text", "sglang"]
    made["planted-float-label"] = _rewrite(dense, root / "planted-float-label", _relabel_a_down_proj_float)
    made["planted-renamed"] = _rewrite(dense, root / "planted-renamed", _rename_a_gdn_projection)
    default = made[DENSE.name, "multimodal", None]
    made["vllm-planted-float-label"] = _rewrite(default, root / "vllm-planted-float-label", _relabel_a_down_proj_float)
    made["vllm-planted-renamed"] = _rewrite(default, root / "vllm-planted-renamed", _rename_a_gdn_projection)
    return made


@pytest.fixture(scope="module")
def runs(artifacts) -> dict[tuple[str, str | None], dict[Path, object]]:
    """(engine release, draft quantization) -> {artifact: its EngineRun}: each release and setting loads all the
    artifacts its tests need in one subprocess."""
    engine_option = [a for key, a in artifacts.items() if isinstance(key, tuple) and key[2] == "sglang"]
    moe = artifacts[MOE.name, "multimodal", "sglang"]
    gdn = artifacts[GDN_RECIPE.name, "text", None]
    planted = [artifacts["planted-float-label"], artifacts["planted-renamed"]]
    plan = {(NEWEST, "unquant"): [*engine_option, gdn, *planted], (NEWEST, None): [moe],
            (OLD, "unquant"): [moe, gdn], (OLD, None): [moe],
            (VLLM, None): [*(artifacts[r.name, lay, None] for r, lay in DEFAULT_CASES),
                           artifacts["vllm-planted-float-label"], artifacts["vllm-planted-renamed"]]}
    return {(engine, draft): run_engine_many(arts, engine, draft_quantization=draft)
            for (engine, draft), arts in plan.items()}


def _run(runs, art: Path, engine: str = NEWEST, draft: str | None = "unquant"):
    return runs[engine, draft][Path(art).resolve()]


def _assert_loads(run) -> None:
    assert not run.failures(), run.summary()
    for tag, model in run.models.items():
        unloaded = [p for p in model["unloaded_params"] if not p.startswith(NO_CHECKPOINT_TENSOR[tag])]
        assert not unloaded, f"{run.engine} {tag}: parameters no tensor was loaded into: {unloaded}"


def _labels(art: Path) -> dict[str, str]:
    return json.loads((art / "quant_model_description.json").read_text())


@pytest.mark.parametrize("recipe,layout", CASES, ids=[f"{r.stem}-{lay}" for r, lay in CASES])
def test_engine_sglang_output_loads_in_newest_sglang(artifacts, runs, recipe, layout):
    """With --speculative-draft-model-quantization unquant (the serving command of CONTRACT.md), the MTP draft
    included: every tensor where the artifact says, int8 into int8 parameters of a ModelSlim method of its scheme
    (W4A8 experts into sglang's W4A8 MoE method), BF16 into unquantized ones."""
    art = artifacts[recipe.name, layout, "sglang"]
    run = _run(runs, art)
    _assert_loads(run)
    labels = _labels(art)
    for name, v in run.verdicts.items():
        quantized = "ModelSlim" in (v.method or "")
        assert quantized == (labels[name] in QUANTIZED) or v.method is None or name.endswith("bias"), (
            f"{name}: labelled {labels[name]}, built with {v.method}")
        if labels[name] == "W4A8_DYNAMIC" and v.method:
            assert "W4A8" in v.method, f"{name}: labelled W4A8_DYNAMIC, built with {v.method}"


def test_engine_sglang_output_loads_in_old_sglang(artifacts, runs):
    _assert_loads(_run(runs, artifacts[MOE.name, "multimodal", "sglang"], OLD))


@pytest.mark.parametrize("engine", [NEWEST, OLD])
def test_sglang_refuses_float_mtp_experts_without_unquant_draft(artifacts, runs, engine):
    """sglang issue 34211: with the draft quantization unset, the MoE MTP draft is built with the target's ModelSlim
    config, which has no method for the FLOAT (BF16) MTP experts; the remedy is the flag
    --speculative-draft-model-quantization unquant, with which the same artifact loads whole."""
    art = artifacts[MOE.name, "multimodal", "sglang"]
    run = _run(runs, art, engine, None)
    assert MTP_EXPERTS_REFUSED in (run.models["mtp-draft"]["error"] or ""), run.summary()
    refused = {n for n, v in run.failures().items() if v.status == "refused"}
    assert refused == {n for n in _labels(art) if n.startswith("mtp.")}, run.summary()
    assert all(v.status == "loaded" for n, v in run.verdicts.items() if not n.startswith("mtp.")), run.summary()
    _assert_loads(_run(runs, art, engine, "unquant"))


@pytest.mark.parametrize("engine", [NEWEST, OLD])
def test_sglang_garbles_quantized_gdn_input_projections(artifacts, runs, engine):
    """sglang issue 36423: quantized linear_attn.in_proj_qkv / in_proj_z (the Qwen3.6-27B recipe, default output)
    are fused into in_proj_qkvz, which ModelSlim resolves to no scheme: int8 weights copied into a BF16 parameter,
    their scales dropped."""
    art = artifacts[GDN_RECIPE.name, "text", None]
    bad = _run(runs, art, engine).failures()
    gdn = {n for n, label in _labels(art).items() if ".linear_attn.in_proj_" in n and label == "W8A8_DYNAMIC"}
    assert gdn and set(bad) == gdn, _run(runs, art, engine).summary()
    for name in gdn:
        if name.endswith(".weight"):
            assert bad[name].status == "dtype-mismatch" and "UnquantizedLinearMethod" in bad[name].method, bad[name]


def test_the_engine_facts_name_what_the_harness_finds_sglang_cannot_load(artifacts, runs):
    """The table `--engine sglang` and `npuport check` read holds a cannot_load fact for each layer kind the newest
    sglang loads wrong in the default output, and --engine sglang keeps exactly those FLOAT (the output loads,
    test_engine_sglang_output_loads_in_newest_sglang)."""
    target = EngineTarget.parse(NEWEST)
    bad = _run(runs, artifacts[GDN_RECIPE.name, "text", None]).failures()
    assert bad and all(target.keep_float_reason(n.rsplit(".", 1)[0]) for n in bad), sorted(bad)


def test_planted_float_label_on_int8_tensor_fails(artifacts, runs):
    art = artifacts["planted-float-label"]
    run = _run(runs, art)
    layer = next(n.removesuffix(".weight") for n, v in _labels(art).items()
                 if v == "FLOAT" and n.endswith("mlp.down_proj.weight") and load_file(
                     next(art.glob("*.safetensors")))[n].dtype == torch.int8)
    assert run.verdicts[layer + ".weight"].status == "dtype-mismatch", run.summary()
    assert run.verdicts[layer + ".weight_scale"].status in ("unknown", "dropped", "dtype-mismatch"), run.summary()


def test_planted_renamed_fused_projection_fails(artifacts, runs):
    run = _run(runs, artifacts["planted-renamed"])
    new = next(n for n in _labels(artifacts["planted-renamed"]) if n.endswith("linear_attn.in_proj_qkvz.weight"))
    assert run.verdicts[new].status != "loaded" or run.failures(), run.summary()
    assert run.failures(), run.summary()


def test_harness_sees_values_not_only_names():
    """The garbage check of the harness: a tensor is found in a parameter only where its rows are."""
    from engine_loaders.recorder import _rows_inside

    param = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    assert _rows_inside(param[2:4].clone(), param)
    assert not _rows_inside(param[2:4].flip(0).clone(), param)
    assert not _rows_inside(param[:, :2].clone(), param)


@pytest.mark.parametrize("recipe,layout", [c for c in DEFAULT_CASES if c[1] == "multimodal"],
                         ids=[r.stem for r, lay in DEFAULT_CASES if lay == "multimodal"])
def test_default_output_loads_in_vllm_ascend(artifacts, runs, recipe, layout):
    """`vllm serve ART --quantization ascend --speculative-config '{"method":"qwen3_5_mtp",...}'`, the MTP draft as
    vllm-ascend's proposer builds it included: every tensor where the artifact says, int8 into the parameters of
    vllm-ascend's W8A8_DYNAMIC method (also the Qwen3.6-27B recipe's in_proj_qkv / in_proj_z and vision blocks),
    W4A8_DYNAMIC experts into its W4A8 MoE method, BF16 (the MTP head's experts too) into unquantized ones."""
    art = artifacts[recipe.name, layout, None]
    run = _run(runs, art, VLLM, None)
    _assert_loads(run)
    labels = _labels(art)
    for name, v in run.verdicts.items():
        if name.endswith("bias"):
            continue
        quantized = "Dynamic" in (v.method or "")
        assert quantized == (labels[name] in QUANTIZED) or v.method == "none", (
            f"{name}: labelled {labels[name]}, built with {v.method}")
        if labels[name] == "W4A8_DYNAMIC":
            assert "W4A8DynamicFusedMoE" in v.method, f"{name}: labelled W4A8_DYNAMIC, built with {v.method}"


def test_vllm_refuses_the_text_layout_with_qwen3_5_mtp(artifacts, runs):
    """vLLM 0.23 registers Qwen3.5 only as Qwen3_5(Moe)ForConditionalGeneration (and the MTP classes): for an
    artifact of the text layout (architectures Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM, model type
    qwen3_5_text) the speculative config keeps the target's architecture for the draft and refuses it, before any
    weight is read."""
    for recipe in (DENSE, MOE):
        run = _run(runs, artifacts[recipe.name, "text", None], VLLM, None)
        assert VLLM_TEXT_REFUSED in (run.models["target"]["error"] or ""), run.summary()
        assert {v.status for v in run.verdicts.values()} == {"refused"}, run.summary()


def test_vllm_mtp_draft_under_its_own_model_type(artifacts, runs):
    """The draft built under its own model config (model type qwen3_5_mtp), with a quantization config made anew and
    the target's hf_to_vllm_mapper applied, loads the mtp.* tensors as the proposer's build does: vLLM 0.23.0's
    Qwen3.5 mapper renames only model.visual., model.language_model. and lm_head., so mtp.fc.weight keeps its entry
    (a KeyError 'mtp.fc.weight' would need a mapper that renames or drops mtp.*; not seen in this release)."""
    for recipe in (DENSE, MOE):
        art = artifacts[recipe.name, "multimodal", None]
        run = _run(runs, art, VLLM, None)
        own = run.extra["mtp-own-type"]
        assert own["error"] is None, own["error"]
        mtp = {n: t for n, t in own["tensors"].items() if n.startswith("mtp.")}
        assert mtp and all(t["status"] == "loaded" for t in mtp.values()), mtp
        assert own["tensors"]["mtp.fc.weight"]["method"] == run.verdicts["mtp.fc.weight"].method


def test_vllm_planted_float_label_on_int8_tensor_fails(artifacts, runs):
    art = artifacts["vllm-planted-float-label"]
    run = _run(runs, art, VLLM, None)
    layer = next(n.removesuffix(".weight") for n, v in _labels(art).items()
                 if v == "FLOAT" and n.endswith("mlp.down_proj.weight") and load_file(
                     next(art.glob("*.safetensors")))[n].dtype == torch.int8)
    assert run.verdicts[layer + ".weight"].status == "dtype-mismatch", run.summary()
    assert run.verdicts[layer + ".weight_scale"].status in ("unknown", "dropped", "dtype-mismatch"), run.summary()


def test_vllm_planted_renamed_fused_projection_fails(artifacts, runs):
    run = _run(runs, artifacts["vllm-planted-renamed"], VLLM, None)
    assert run.failures(), run.summary()
