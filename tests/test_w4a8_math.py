"""The W4A8_DYNAMIC weight math (convert/w4a8.py) against msModelSlim's own output and against an independent
float64 re-implementation of its documented steps.

(a) Every routed-expert projection of the golden `qwen3.5_moe_w4a8` case (tests/golden/msmodelslim), recomputed
    from its make-tiny input, equals msModelSlim's four tensors byte for byte.
(b) On random weights, a float64 numpy version of the module docstring's math (round-to-bf16 by frexp, written
    here, no call into the module's helpers) gives the same integers, scales and scale_bias; unpack(pack(q)) == q.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from npuport.convert.w4a8 import pack_int4, scale_bias_groups, unpack_int4, w4a8_dynamic
from npuport.fixtures.tiny_checkpoint import TinySpec, make_tiny

GOLDEN = Path(__file__).parent / "golden" / "msmodelslim"
GOLDEN_JSON = json.loads((GOLDEN / "golden.json").read_text(encoding="utf-8"))
CASE = "qwen3.5_moe_w4a8"
CASE_DIR = GOLDEN / CASE
SUFFIXES = ("weight", "weight_scale", "weight_offset", "scale_bias")


def _fingerprint_module():
    spec = importlib.util.spec_from_file_location("golden_fingerprint", GOLDEN / "fingerprint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------------------------
# (a) msModelSlim's output, byte for byte


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The case's input, rebuilt with make-tiny and checked against the recorded fingerprint: name -> tensor."""
    spec = GOLDEN_JSON["inputs"][GOLDEN_JSON["cases"][CASE]["input"]]
    path = make_tiny(tmp_path_factory.mktemp("w4a8-input") / "moe", TinySpec(**spec["spec"]))
    assert _fingerprint_module().tensor_fingerprint(path) == spec["tensor_sha256"], \
        "make-tiny no longer writes the input the golden was made from"
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    index = json.loads((CASE_DIR / "quant_model_weights.safetensors.index.json").read_text(encoding="utf-8"))
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(CASE_DIR / file, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def expert_projections(source: dict[str, torch.Tensor]):
    """(prefix, BF16 weight [N, K]) of every routed expert projection of the text model, from the fused tensors
    gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I]."""
    for name in sorted(source):
        if name.startswith("mtp.") or not name.endswith(".mlp.experts.gate_up_proj"):
            continue
        experts = name.removesuffix(".gate_up_proj")
        gate_up, down = source[name], source[experts + ".down_proj"]
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            yield f"{experts}.{e}.gate_proj", gate_up[e, :inter]
            yield f"{experts}.{e}.up_proj", gate_up[e, inter:]
            yield f"{experts}.{e}.down_proj", down[e]


def test_every_routed_expert_equals_msmodelslim_byte_for_byte(source, golden):
    description = json.loads((CASE_DIR / "quant_model_description.json").read_text(encoding="utf-8"))
    projections = list(expert_projections(source))
    assert len(projections) == 4 * 8 * 3  # 4 MoE layers, 8 experts, gate/up/down
    golden_names = {n for n in golden if ".mlp.experts." in n and not n.startswith("mtp.")}
    assert golden_names == {f"{p}.{s}" for p, _ in projections for s in SUFFIXES}

    differing = []
    for prefix, weight in projections:
        assert weight.dtype == torch.bfloat16
        got = dict(zip(SUFFIXES, w4a8_dynamic(weight, scale_bias_groups(prefix)), strict=True))
        for suffix, tensor in got.items():
            name = f"{prefix}.{suffix}"
            want = golden[name]
            assert description[name] == "W4A8_DYNAMIC"
            if (tensor.dtype, tensor.shape) != (want.dtype, want.shape) or not torch.equal(tensor, want):
                differing.append(f"{name}: ours {tensor.dtype} {tuple(tensor.shape)}, "
                                 f"msModelSlim {want.dtype} {tuple(want.shape)}")
    assert not differing, f"{len(differing)} tensors differ: " + "; ".join(differing[:10])


def test_golden_matches_the_documented_layout(source, golden):
    """What the module claims about msModelSlim's tensors, read off the golden itself."""
    for prefix, weight in expert_projections(source):
        n, k = weight.shape
        q = unpack_int4(golden[f"{prefix}.weight"])
        scale = golden[f"{prefix}.weight_scale"]
        assert golden[f"{prefix}.weight"].shape == (n // 2, k)
        assert scale.shape == (n, 1) and torch.equal(scale.bfloat16().float(), scale)  # BF16-exact
        assert torch.equal(golden[f"{prefix}.weight_offset"], torch.zeros(n, 1))
        assert int(q.min()) >= -8 and int(q.max()) <= 7
        # the scale is a refinement of max|w| / 7, within a few tens of percent of it
        ratio = scale[:, 0] / (weight.float().abs().amax(dim=1) / 7)
        assert bool((ratio > 0.7).all() and (ratio < 1.3).all())
        groups = 16 if prefix.endswith("down_proj") else 1
        sums = (q.double() * scale.double()).reshape(n, groups, k // groups).sum(dim=2)
        assert torch.equal(golden[f"{prefix}.scale_bias"].double(), 8 * sums)


# ---------------------------------------------------------------------------------------------------------------
# (b) an independent float64 re-implementation


def bf16(x: np.ndarray) -> np.ndarray:
    """Round float64 values to the nearest bfloat16 (8 significant bits), ties to even."""
    mant, exp = np.frexp(x)
    return np.ldexp(np.round(mant * 256.0), exp - 8)


def f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32).astype(np.float64)


def reference(w: torch.Tensor, groups: int, rounds: int = 50):
    """The module docstring's steps in float64, per output channel: (q int8 [N, K], scale [N], scale_bias
    [N, groups]). Each BF16 product is rounded to BF16; the sums are exact float64 sums rounded once to BF16."""
    x = w.float().numpy().astype(np.float64)
    n, k = x.shape

    def quant(s):
        return np.clip(np.round(bf16(x / s[:, None])), -8, 7)

    def mse(s):
        return f32(((x - bf16(quant(s) * s[:, None])) ** 2).mean(axis=1))

    scale = np.maximum(bf16(np.maximum(-np.minimum(x.min(axis=1), 0), np.maximum(x.max(axis=1), 0)) / 7), 2**-23)
    best_scale, best = scale.copy(), mse(scale)
    for _ in range(rounds):
        q = quant(scale)
        cand = bf16(bf16(bf16(x * q).sum(axis=1)) / np.maximum(bf16((q * q).sum(axis=1)), 1e-30))
        err = mse(cand)
        gain = best - err
        if np.all((gain / np.maximum(best, 1e-4) < 1e-10) | (np.abs(gain) < 1e-10)):
            break
        better = err < best
        best = np.where(better, err, best)
        best_scale = np.where(better, cand, best_scale)
        scale = cand
    q = quant(best_scale)
    bias = 8 * (q * best_scale[:, None]).reshape(n, groups, k // groups).sum(axis=2)
    return q.astype(np.int8), best_scale, bias


def random_weight(seed: int, n: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02 * torch.exp(torch.randn(n, 1, generator=g))
    w[torch.rand(n, k, generator=g) < 0.02] *= 20  # outliers
    return w.bfloat16()


@pytest.mark.parametrize(("seed", "n", "k", "groups"), [(1, 64, 128, 1), (2, 96, 256, 16), (3, 32, 512, 16),
                                                         (4, 128, 64, 1)])
def test_matches_float64_reference(seed, n, k, groups):
    w = random_weight(seed, n, k)
    q_ref, scale_ref, bias_ref = reference(w, groups)
    packed, scale, offset, bias = w4a8_dynamic(w, groups)
    assert packed.dtype == torch.int8 and packed.shape == (n // 2, k)
    assert scale.dtype == offset.dtype == bias.dtype == torch.float32
    assert scale.shape == offset.shape == (n, 1) and bias.shape == (n, groups)
    assert torch.equal(offset, torch.zeros(n, 1))
    np.testing.assert_array_equal(scale[:, 0].double().numpy(), scale_ref)
    np.testing.assert_array_equal(unpack_int4(packed).numpy(), q_ref)
    np.testing.assert_array_equal(bias.double().numpy(), bias_ref)
    # the search improves on the plain max|w| / 7 start, never worsens it
    x = w.float().numpy().astype(np.float64)
    start = bf16(np.abs(x).max(axis=1) / 7)
    err_start = ((x - np.clip(np.round(bf16(x / start[:, None])), -8, 7) * start[:, None]) ** 2).sum()
    err = ((x - q_ref * scale_ref[:, None]) ** 2).sum()
    assert err <= err_start


def test_result_does_not_depend_on_the_row_blocks():
    w = random_weight(5, 48, 64)
    whole = w4a8_dynamic(w, 16)
    for rows in (1, 5, 16):
        assert all(torch.equal(a, b) for a, b in zip(whole, w4a8_dynamic(w, 16, block_rows=rows), strict=True))


def test_zero_rows_and_bad_shapes():
    w = random_weight(6, 8, 32)
    w[3] = 0
    packed, scale, _, bias = w4a8_dynamic(w, 1)
    assert float(scale[3, 0]) == 2.0**-23 and not unpack_int4(packed)[3].any() and float(bias[3, 0]) == 0.0
    with pytest.raises(ValueError):
        w4a8_dynamic(w[:7], 1)  # N odd
    with pytest.raises(ValueError):
        w4a8_dynamic(w[:, :24], 16)  # K not a multiple of 16
    with pytest.raises(TypeError):
        w4a8_dynamic(w.float(), 1)


def test_scale_bias_groups_by_name():
    assert scale_bias_groups("model.language_model.layers.0.mlp.experts.3.gate_proj") == 1
    assert scale_bias_groups("model.language_model.layers.0.mlp.experts.3.up_proj") == 1
    assert scale_bias_groups("model.language_model.layers.0.mlp.experts.3.down_proj") == 16
    with pytest.raises(ValueError):
        scale_bias_groups("model.language_model.layers.0.linear_attn.out_proj")


def test_pack_unpack_round_trip_and_byte_layout():
    g = torch.Generator().manual_seed(7)
    q = torch.randint(-8, 8, (64, 40), generator=g, dtype=torch.int8)
    q[0, 0], q[1, 0] = -8, 7  # both extremes in one byte
    packed = pack_int4(q)
    assert packed.dtype == torch.int8 and packed.shape == (32, 40)
    assert torch.equal(unpack_int4(packed), q)
    lo, hi = q[0::2].numpy().astype(np.int64), q[1::2].numpy().astype(np.int64)
    expected = (((hi & 0xF) << 4) | (lo & 0xF)).astype(np.uint8).view(np.int8)
    np.testing.assert_array_equal(packed.numpy(), expected)
    every = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)[None, :]  # every byte value
    assert torch.equal(pack_int4(unpack_int4(every)), every)


def test_the_benchs_start_scales_skip_the_search_even_where_the_recipe_asks_for_its_rounds():
    """bench/moe.py times W4A8 artifacts converted with msModelSlim's start scales alone (max |W| / 7 per channel, in
    BF16): the converter passes the recipe's rounds to the search, and they must not bring it back."""
    from bench.moe import start_scales_only

    weight = (torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16()
    start = (weight.float().abs().amax(dim=1) / 7).bfloat16().float()
    with start_scales_only():
        _, scale, _, _ = w4a8_dynamic(weight, 1, iterations=50)
    assert torch.equal(scale[:, 0], start)
    _, searched, _, _ = w4a8_dynamic(weight, 1, iterations=50)
    assert not torch.equal(searched[:, 0], start)  # the search moves scales: the check above can fail
