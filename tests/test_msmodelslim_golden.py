"""npuport's converter writes what msModelSlim 26.1.0 writes, tensor for tensor and bit for bit, for each recipe of
msModelSlim's lab_practice/qwen3_5_moe folder, with our recipe of the same name from recipes/. The goldens in
tests/golden/msmodelslim were written by msModelSlim itself on a CPU (make_golden.sh there; README.md says how).

The MTP head aside: npuport keeps every mtp.* tensor BF16 and labelled FLOAT whatever a recipe says, while
msModelSlim's dense recipes quantize it. The W4A8 golden's int4 routed experts (W4A8_DYNAMIC, msModelSlim's ssz
search) are compared too, and also checked against what README.md says msModelSlim writes for them.

Both sides are read with the safetensors library, not with npuport's own reader."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from npuport.convert.converter import convert_qwen35
from npuport.fixtures.tiny_checkpoint import TinySpec, make_tiny

GOLDEN = Path(__file__).parent / "golden" / "msmodelslim"
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
GOLDEN_JSON = json.loads((GOLDEN / "golden.json").read_text(encoding="utf-8"))
CASES = list(GOLDEN_JSON["cases"])
W4A8_CASES = [c for c in CASES if GOLDEN_JSON["cases"][c]["int4_experts"]]
INDEX = "quant_model_weights.safetensors.index.json"
DESCRIPTION = "quant_model_description.json"
GLOBAL_KEYS = ("version", "model_quant_type", "metadata", "group_size", "optional")
NPUPORT_ONLY_FILES = {"npuport_manifest.json"}
# a routed expert of the text model, per expert (the W4A8 recipe makes these int4)
ROUTED_EXPERT = re.compile(r"^(?!mtp\.).*\.mlp\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.")
PER_EXPERT_WEIGHT = re.compile(
    r"^(?P<experts>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
MAX_SHOWN = 20


def _load_fingerprint_module():
    spec = importlib.util.spec_from_file_location("golden_fingerprint", GOLDEN / "fingerprint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fingerprint = _load_fingerprint_module()


# ---------------------------------------------------------------------------------------------------------------
# Reading an artifact (safetensors library only)


def read_tensors(folder: Path, pattern: str = "*.safetensors") -> dict[str, torch.Tensor]:
    """Every tensor of every shard in `folder`, by name."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob(pattern)):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                assert name not in out, f"{folder.name}: tensor {name} is in two shards"
                out[name] = f.get_tensor(name)
    return out


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` as uint8 [numel, itemsize]."""
    return t.contiguous().reshape(-1).view(torch.uint8).reshape(t.numel(), t.element_size())


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when `a` and `b` have the same dtype, shape and bytes, else what differs."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"msModelSlim {str(a.dtype).removeprefix('torch.')} {list(a.shape)}, " \
               f"npuport {str(b.dtype).removeprefix('torch.')} {list(b.shape)}"
    differ = (raw(a) != raw(b)).any(dim=1)
    if not differ.any():
        return None
    first = int(differ.nonzero()[0])
    return (f"{int(differ.sum())} of {a.numel()} values differ ({str(a.dtype).removeprefix('torch.')} "
            f"{list(a.shape)}); first at flat index {first}: msModelSlim {a.reshape(-1)[first].item()!r}, "
            f"npuport {b.reshape(-1)[first].item()!r}")


def compared(case: str, name: str) -> bool:
    """Whether tensor `name` of `case` must equal msModelSlim's: all but mtp.*."""
    return not name.startswith("mtp.")


def shown(names) -> str:
    names = sorted(names)
    return ", ".join(names[:MAX_SHOWN]) + (f" and {len(names) - MAX_SHOWN} more" if len(names) > MAX_SHOWN else "")


# ---------------------------------------------------------------------------------------------------------------
# Inputs and npuport's artifacts


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """input name -> the make-tiny checkpoint msModelSlim was run on, rebuilt, its tensors checked against the
    fingerprint make_golden.sh recorded."""
    root = tmp_path_factory.mktemp("golden-inputs")
    out = {}
    for name, spec in GOLDEN_JSON["inputs"].items():
        path = make_tiny(root / name, TinySpec(**spec["spec"]))
        got = fingerprint.tensor_fingerprint(path)
        if got != spec["tensor_sha256"]:
            pytest.fail(f"make-tiny no longer writes the golden input {name!r} ({spec['make_tiny']}): its tensors' "
                        f"fingerprint is {got}, the goldens were made from {spec['tensor_sha256']}. Re-create them "
                        f"with tests/golden/msmodelslim/make_golden.sh (README.md there).")
        out[name] = path
    return out


@pytest.fixture(scope="module")
def artifact(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """case -> the artifact npuport's converter writes from the case's input with our recipe (made once)."""
    root = tmp_path_factory.mktemp("golden-npuport")
    made: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in made:
            c = GOLDEN_JSON["cases"][case]
            # npuport names the recipe record after the source folder, msModelSlim after --model_type
            src = root / case / c["model_type"]
            shutil.copytree(sources[c["input"]], src)
            made[case] = convert_qwen35(src, root / case / "artifact", recipe_path=RECIPES / c["npuport_recipe"],
                                        show_progress=False, log=lambda _: None).out
        return made[case]

    return get


# ---------------------------------------------------------------------------------------------------------------
# The goldens are what README.md says


def test_the_readme_records_each_input_and_recipe():
    readme = (GOLDEN / "README.md").read_text(encoding="utf-8")
    for name, spec in GOLDEN_JSON["inputs"].items():
        assert spec["tensor_sha256"] in readme, f"README.md lacks the fingerprint of input {name}"
        assert spec["make_tiny"] in readme, f"README.md lacks the make-tiny command of input {name}"
    for case, c in GOLDEN_JSON["cases"].items():
        assert c["lab_practice_sha256"] in readme, f"README.md lacks the sha256 of {c['lab_practice_recipe']}"
        assert sorted(p.name for p in (GOLDEN / case).iterdir()) == c["files_kept"], case


def test_make_tiny_still_writes_the_golden_inputs(sources):
    for name, spec in GOLDEN_JSON["inputs"].items():
        assert fingerprint.tensor_fingerprint(sources[name]) == spec["tensor_sha256"], \
            f"make-tiny no longer writes the golden input {name!r}"


# ---------------------------------------------------------------------------------------------------------------
# npuport's artifact equals msModelSlim's


@pytest.mark.parametrize("case", CASES)
def test_every_tensor_equals_msmodelslims_bit_for_bit(case, artifact):
    gold, ours = read_tensors(GOLDEN / case), read_tensors(artifact(case))
    g = {n for n in gold if compared(case, n)}
    o = {n for n in ours if compared(case, n)}
    assert g == o, (f"{case}: tensors only msModelSlim writes: {shown(g - o) or 'none'}; "
                    f"only npuport writes: {shown(o - g) or 'none'}")
    problems = [f"{name}: {why}" for name in sorted(g) if (why := same_bytes(gold[name], ours[name]))]
    assert not problems, f"{case}: {len(problems)} of {len(g)} tensors differ from msModelSlim's:\n  " + \
        "\n  ".join(problems[:MAX_SHOWN])


@pytest.mark.parametrize("case", CASES)
def test_every_label_equals_msmodelslims(case, artifact):
    folder = artifact(case)
    gold, ours = read_json(GOLDEN / case / DESCRIPTION), read_json(folder / DESCRIPTION)
    for key in GLOBAL_KEYS:
        assert key in gold and key in ours and ours[key] == gold[key], \
            f"{case}: global key {key!r}: msModelSlim {gold.get(key)!r}, npuport {ours.get(key)!r}"
    for side, desc, where in (("msModelSlim", gold, GOLDEN / case), ("npuport", ours, folder)):
        named = set(desc) - set(GLOBAL_KEYS)
        written = set(read_tensors(where))
        assert named == written, (f"{case}: {side}'s description and shards disagree: labelled, not written: "
                                  f"{shown(named - written) or 'none'}; written, not labelled: "
                                  f"{shown(written - named) or 'none'}")
    differ = [f"{n}: msModelSlim {gold[n]}, npuport {ours.get(n)}"
              for n in sorted(gold) if n not in GLOBAL_KEYS and compared(case, n) and ours.get(n) != gold[n]]
    assert not differ, f"{case}: {len(differ)} labels differ:\n  " + "\n  ".join(differ[:MAX_SHOWN])
    not_float = [n for n in ours if n.startswith("mtp.") and ours[n] != "FLOAT"]
    assert not not_float, f"{case}: npuport labels MTP tensors other than FLOAT: {shown(not_float)}"


@pytest.mark.parametrize("case", CASES)
def test_the_file_layout_equals_msmodelslims(case, artifact):
    """The same files, shard names, tensors in the same shard (the k-th of each side), and an index whose total_size
    is the sum of the tensors' bytes, as msModelSlim's is."""
    folder = artifact(case)
    c = GOLDEN_JSON["cases"][case]
    problems = []
    files = sorted(p.name for p in folder.iterdir() if p.name not in NPUPORT_ONLY_FILES)
    if files != c["files_written"]:
        problems.append(f"files only msModelSlim writes: {sorted(set(c['files_written']) - set(files))}; "
                        f"only npuport writes: {sorted(set(files) - set(c['files_written']))}")
    gold, ours = read_json(GOLDEN / case / INDEX), read_json(folder / INDEX)
    g_shards, o_shards = sorted(set(gold["weight_map"].values())), sorted(set(ours["weight_map"].values()))
    if g_shards != o_shards:
        problems.append(f"shards: msModelSlim {g_shards}, npuport {o_shards}")
    g = {n: g_shards.index(s) for n, s in gold["weight_map"].items() if compared(case, n)}
    o = {n: o_shards.index(s) for n, s in ours["weight_map"].items() if compared(case, n)}
    if g != o:
        moved = {n for n in g.keys() | o.keys() if g.get(n) != o.get(n)}
        problems.append(f"{len(moved)} tensors are not in the same shard (or not in both indexes): {shown(moved)}")
    for side, index, where in (("msModelSlim", gold, GOLDEN / case), ("npuport", ours, folder)):
        tensors = read_tensors(where)
        if set(index["weight_map"]) != set(tensors):
            problems.append(f"{side}'s index does not name the tensors of its shards")
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        if index["metadata"] != {"total_size": total}:
            problems.append(f"{side}'s index metadata is {index['metadata']}, its tensors' bytes sum to {total}")
    assert not problems, f"{case}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("case", CASES)
def test_config_json_equals_msmodelslims(case, artifact):
    assert read_json(artifact(case) / "config.json") == read_json(GOLDEN / case / "config.json")


def _source_tensor(source: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Tensor `name` of the artifact as the source holds it: itself, or a slice of the fused experts."""
    if name in source:
        return source[name]
    m = PER_EXPERT_WEIGHT.match(name)
    assert m, f"{name} is not in the source"
    e, proj = int(m["e"]), m["proj"]
    if proj == "down_proj":
        return source[f"{m['experts']}.down_proj"][e]
    gate_up = source[f"{m['experts']}.gate_up_proj"][e]  # [2I, H]: gate rows first, then up
    half = gate_up.shape[0] // 2
    return gate_up[:half] if proj == "gate_proj" else gate_up[half:]


@pytest.mark.parametrize("case", CASES)
def test_the_mtp_head_is_the_sources_bf16(case, artifact, sources):
    folder = artifact(case)
    gold, ours = read_tensors(GOLDEN / case), read_tensors(folder)
    labels = read_json(folder / DESCRIPTION)
    source = read_tensors(sources[GOLDEN_JSON["cases"][case]["input"]], "model*.safetensors")
    gold_mtp = {n for n in gold if n.startswith("mtp.")}
    ours_mtp = {n for n in ours if n.startswith("mtp.")}
    # msModelSlim's MTP tensors, less the scale and offset of the layers its recipe quantized there
    expected = {n for n in gold_mtp if not n.endswith((".weight_scale", ".weight_offset"))}
    assert ours_mtp == expected, (f"{case}: MTP tensors only msModelSlim writes: {shown(expected - ours_mtp) or 'none'}"
                                  f"; only npuport writes: {shown(ours_mtp - expected) or 'none'}")
    gold_labels = read_json(GOLDEN / case / DESCRIPTION)
    for name in sorted(ours_mtp):
        assert ours[name].dtype == torch.bfloat16 and labels[name] == "FLOAT", name
        assert same_bytes(_source_tensor(source, name), ours[name]) is None, f"{name}: not the source's bytes"
        if gold_labels[name] == "FLOAT":
            assert same_bytes(gold[name], ours[name]) is None, f"{name}: {same_bytes(gold[name], ours[name])}"


def _rules(recipe: dict) -> list[tuple[dict, list, list]]:
    """(qconfig, include, exclude) of each linear_quant step, groups flattened, the `mtp*` patterns left out."""
    def flat(steps):
        for step in steps:
            if step["type"] == "group":
                yield from flat(step["configs"])
            else:
                yield step
    return [(s["qconfig"], [p for p in s.get("include", []) if p != "mtp*"],
             [p for p in s.get("exclude", []) if p != "mtp*"]) for s in flat(recipe["spec"]["process"])]


@pytest.mark.parametrize("case", CASES)
def test_our_recipe_asks_what_msmodelslims_asked(case):
    """Our recipe file quantizes what msModelSlim's (as recorded in its artifact) does, `mtp*` aside."""
    c = GOLDEN_JSON["cases"][case]
    recorded = yaml.safe_load((GOLDEN / case / f"{c['model_type']}_best_practice.yaml").read_text(encoding="utf-8"))
    ours = yaml.safe_load((RECIPES / c["npuport_recipe"]).read_text(encoding="utf-8"))
    assert _rules(ours) == _rules(recorded)
    assert ours["spec"]["save"] == recorded["spec"]["save"]


@pytest.mark.parametrize("case", CASES)
def test_our_recipe_has_msmodelslims_apiversion(case):
    """msModelSlim picks its pipeline by `apiversion` (its Qwen3.5 recipes: the multimodal one), so that our recipe
    files run in msModelSlim as its own do."""
    c = GOLDEN_JSON["cases"][case]
    recorded = yaml.safe_load((GOLDEN / case / f"{c['model_type']}_best_practice.yaml").read_text(encoding="utf-8"))
    ours = yaml.safe_load((RECIPES / c["npuport_recipe"]).read_text(encoding="utf-8"))
    assert ours["apiversion"] == recorded["apiversion"], \
        f"recipes/{c['npuport_recipe']}: apiversion {ours['apiversion']!r}, msModelSlim's {recorded['apiversion']!r}"


# ---------------------------------------------------------------------------------------------------------------
# The W4A8 golden's int4 experts: what msModelSlim writes (README.md)


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N/2, K] int8 -> [N, K]: row 2j is the low nibble of packed row j, row 2j+1 the high one (two's complement)."""
    p = packed.to(torch.int16)
    low, high = ((p & 0xF) ^ 8) - 8, p >> 4
    return torch.stack([low, high], dim=1).reshape(2 * packed.shape[0], packed.shape[1])


@pytest.mark.parametrize("case", W4A8_CASES)
def test_the_w4a8_golden_experts_are_as_documented(case, sources):
    gold = read_tensors(GOLDEN / case)
    labels = read_json(GOLDEN / case / DESCRIPTION)
    source = read_tensors(sources[GOLDEN_JSON["cases"][case]["input"]], "model*.safetensors")
    assert labels["model_quant_type"] == "W8A8_DYNAMIC"  # msModelSlim 26.1.0 does not rank W4A8_DYNAMIC
    modules = sorted({n.rsplit(".", 1)[0] for n in gold if ROUTED_EXPERT.match(n)})
    assert modules
    for module in modules:
        assert {n for n in gold if n.startswith(module + ".")} == \
            {f"{module}.{p}" for p in ("weight", "weight_scale", "weight_offset", "scale_bias")}, module
        assert all(labels[f"{module}.{p}"] == "W4A8_DYNAMIC"
                   for p in ("weight", "weight_scale", "weight_offset", "scale_bias")), module
        w = _source_tensor(source, f"{module}.weight")
        n, k = w.shape
        packed, scale = gold[f"{module}.weight"], gold[f"{module}.weight_scale"]
        offset, scale_bias = gold[f"{module}.weight_offset"], gold[f"{module}.scale_bias"]
        assert packed.dtype == torch.int8 and list(packed.shape) == [n // 2, k], module
        assert scale.dtype == torch.float32 and list(scale.shape) == [n, 1], module
        assert torch.equal(scale, scale.to(torch.bfloat16).float()), f"{module}: scales are BF16 values"
        assert offset.dtype == torch.float32 and list(offset.shape) == [n, 1] and not offset.any(), module
        q = _unpack_int4(packed).float()
        assert q.min() >= -8 and q.max() <= 7
        deq = q * scale
        # within one step of the source weight, or clamped at -8 / 7 (ssz scales can be below max|w| / 7)
        near = ((w.float() - deq).abs() <= scale) | ((q == 7) & (w.float() > deq)) | ((q == -8) & (w.float() < deq))
        assert near.all(), f"{module}: int4 x scale is not the source weight, rounded"
        if module.endswith("down_proj"):  # sums over 16 equal column groups (msModelSlim's tp_num 16)
            expected = 8 * deq.reshape(n, 16, k // 16).sum(dim=2)
        else:
            expected = 8 * deq.sum(dim=1, keepdim=True)
        assert scale_bias.dtype == torch.float32
        torch.testing.assert_close(scale_bias, expected, rtol=1e-5, atol=1e-5, msg=f"{module}: scale_bias")

