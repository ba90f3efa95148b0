"""The expert kernels reading W4A8 experts as packed int4 (StackedExperts.int4), the matvec ones and the grouped
GEMM: against the int8 kernels on the unpacked weights (bit for bit: the same int32 sums, the same epilogue), against
a float64 loop over the dequantized weights, at the nibbles' edge values, with K and N not multiples of the tiles -
run on CPU tensors through Triton's interpreter at small widths. The unpacking is checked against convert/w4a8.py's
packing and against a nibble decode written out here."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from npuport.fixtures.int4_experts import random_int4_experts  # noqa: E402
from npuport.kernels.fused_moe import (  # noqa: E402
    GROUPED,
    MATVEC,
    SLOT,
    GroupedConfig,
    MatvecConfig,
    StackedExperts,
    fused_experts_reference,
    group_by_expert,
    grouped_gemm,
    matvec_config,
    matvec_down,
    matvec_experts,
    matvec_gate_up,
    plan_experts,
    plan_experts_triton,
    run_experts,
    shares_layout,
)
from npuport.kernels.fused_moe.experts import unpack_int4_rows  # noqa: E402
from npuport.kernels.w8a8 import int8_matmul_rescale_reference, quantize_per_token_int8_reference  # noqa: E402

# K = 48 and 40 are not multiples of the K tile of 32 (masked tails); N = 2 * 12 gate/up rows and 40 down rows are
# not multiples of the 8-row column tiles (masked row pairs).
HIDDEN, INTER, EXPERTS = 40, 12, 5
TILES = [MatvecConfig(gate_up_bn=8, down_bn=8, bk=32), MatvecConfig(gate_up_bn=2, down_bn=2, bk=16)]


def decode_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int8 [..., N/2, K] -> int64 [..., N, K], written out: byte j's low nibble is row 2j, its high one row 2j + 1,
    each 0..7 as is and 8..15 as -8..-1."""
    unsigned = packed.to(torch.int64) & 0xFF
    nibbles = torch.stack((unsigned & 0xF, unsigned >> 4), dim=-2).reshape(*packed.shape[:-2], -1, packed.shape[-1])
    return torch.where(nibbles >= 8, nibbles - 16, nibbles)


def int4_experts(experts: int, seed: int, hidden: int = HIDDEN, inter: int = INTER, edge: bool = False
                 ) -> tuple[StackedExperts, StackedExperts]:
    """(int4 experts, the int8 experts of the same values): random int4 values, or (edge) only -8 and 7; random
    positive per-channel scales."""
    return random_int4_experts(experts, hidden, inter, torch.Generator().manual_seed(seed), max_scale=0.02, edge=edge)


def routing(m: int, top_k: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(m)])
    return ids, torch.softmax(torch.randn(m, top_k, generator=gen), -1).bfloat16()


def float64_loop(x: torch.Tensor, experts: StackedExperts, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The experts in float64 on their dequantized weights (int4 value x scale), float tokens: what W4A8 approximates
    (the int8 activations are the difference)."""
    q_gate_up = decode_nibbles(experts.gate_up).double() * experts.gate_up_scale.double()[..., None]
    q_down = decode_nibbles(experts.down).double() * experts.down_scale.double()[..., None]
    out = torch.zeros(x.shape[0], q_down.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            gate, up = (q_gate_up[e] @ x[t].double()).chunk(2)
            out[t] += weights[t, s].double() * (q_down[e] @ (F.silu(gate) * up))
    return out


def test_unpacking_gives_the_values_convert_packed():
    packed, unpacked = int4_experts(3, seed=1)
    assert torch.equal(unpack_int4_rows(packed.gate_up), unpacked.gate_up)
    assert torch.equal(unpack_int4_rows(packed.down), unpacked.down)
    assert torch.equal(decode_nibbles(packed.down), unpacked.down.long())
    edge, _ = int4_experts(1, seed=2, edge=True)
    assert set(unpack_int4_rows(edge.gate_up).unique().tolist()) == {-8, 7}
    assert (packed.hidden, packed.intermediate, packed.unpacked().gate_up.shape) == (HIDDEN, INTER,
                                                                                     unpacked.gate_up.shape)


def bit_case(m: int, edge: bool, seed: int) -> tuple[StackedExperts, StackedExperts, torch.Tensor]:
    """(int4 experts, their int8 twins, bf16 tokens [m, HIDDEN]); edge: the experts' values -8 and 7 only and the
    first token's int8 values +-127 over the whole row, so that the int32 sums reach their extremes."""
    packed, unpacked = int4_experts(EXPERTS, seed=seed, edge=edge)
    x = torch.randn(m, HIDDEN, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    if edge:
        x[0] = torch.where(torch.arange(HIDDEN) % 2 == 0, -1.0, 1.0)
    return packed, unpacked, x


# every token form and weight kind on the wider tiles; the narrow tiles (one row pair a program, K in 16s, interpreted
# slowly: 9 s a case) on the hardest case only
BIT_CASES = [(TILES[0], tokens, edge) for tokens in ("float", "int8") for edge in (False, True)] + [
    (TILES[1], "float", True)]


@pytest.mark.parametrize(("config", "tokens", "edge"), BIT_CASES,
                         ids=[f"bn{c.gate_up_bn} bk{c.bk}-{t}-{'edge' if e else 'random'}" for c, t, e in BIT_CASES])
def test_int4_matvec_gives_the_int8_kernels_bits_on_the_unpacked_weights(config, tokens, edge):
    """gate/up and down, and both launches together: the int4 kernels on packed bytes == the int8 kernels on the
    unpacked values, every bit - from float tokens (quantized in the kernel) and from tokens quantized beforehand;
    with edge values the int32 sums reach their extremes (|x_q| 127 or 128 times 8)."""
    m, top_k = 3, 2
    packed, unpacked, x = bit_case(m, edge, seed=3)
    ids, weights = routing(m, top_k, EXPERTS, seed=5)
    if tokens == "int8":
        x_q, x_s = quantize_per_token_int8_reference(x)
        a, a_scale = x_q, x_s.reshape(-1)
    else:
        a, a_scale = x, None
    h = matvec_gate_up(a, a_scale, packed, ids, torch.bfloat16, config)
    assert torch.equal(h, matvec_gate_up(a, a_scale, unpacked, ids, torch.bfloat16, config))
    h_q, h_s = quantize_per_token_int8_reference(h)
    for rows, row_scale in ((h, None), (h_q, h_s.reshape(-1))):
        got = matvec_down(rows, row_scale, packed, ids, weights, torch.bfloat16, config)
        assert torch.equal(got, matvec_down(rows, row_scale, unpacked, ids, weights, torch.bfloat16, config))
    got = matvec_experts(a, a_scale, packed, ids, weights, torch.bfloat16, config)
    assert torch.equal(got, matvec_experts(a, a_scale, unpacked, ids, weights, torch.bfloat16, config))


@pytest.mark.parametrize(("hidden", "inter", "config"), [(HIDDEN, INTER, TILES[0]), (64, 32, matvec_config(1)),
                                                         (48, 16, MatvecConfig(4, 4, 32))])
def test_int4_matvec_equals_the_reference_and_the_float64_loop(hidden, inter, config):
    """The int4 kernels against the package's reference (unpack, then the int8 arithmetic: equal but for a silu
    ulp moving an int8 intermediate, rarely) and against float64 on the dequantized weights (the int8 tokens and
    intermediate are the difference: well under a tenth in relative L2)."""
    m, top_k = 4, 3
    packed, _ = int4_experts(EXPERTS, seed=hidden + inter, hidden=hidden, inter=inter)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(m, hidden, generator=gen).bfloat16()
    ids, weights = routing(m, top_k, EXPERTS, seed=7)
    got = matvec_experts(x, None, packed, ids, weights, torch.bfloat16, config)
    reference = fused_experts_reference(x, packed, weights, ids)
    torch.testing.assert_close(got.float(), reference.float(), atol=1e-2, rtol=1e-2)
    assert (got == reference).float().mean() >= 0.98
    exact = float64_loop(x, packed, weights, ids)
    assert ((got.double() - exact).norm() / exact.norm()).item() < 0.05


def test_the_plan_runs_int4_experts_packed_on_both_kernel_paths(monkeypatch):
    """Decode-sized calls take the int4 matvec kernels, larger ones the int4 grouped GEMMs: both read the packed
    bytes (nothing unpacks the experts) and give the bits of the int8 experts' kernels on the unpacked values; off
    Triton the reference unpacks them."""
    packed, unpacked = int4_experts(EXPERTS, seed=8)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(6, HIDDEN, generator=gen).bfloat16()
    ids, weights = routing(6, 2, EXPERTS, seed=10)
    for path, most in ((MATVEC, 128), (GROUPED, 0)):
        plan = plan_experts_triton(x, packed, ids, matvec_max_pairs=most)
        assert plan.path == path
        want = run_experts(plan, x, unpacked, weights, ids)
        with monkeypatch.context() as patch:
            patch.setattr(StackedExperts, "unpacked", lambda self: pytest.fail("the kernels unpacked the experts"))
            assert torch.equal(run_experts(plan, x, packed, weights, ids), want)
    off_triton = plan_experts(x, packed, ids)  # CPU: the reference
    assert torch.equal(run_experts(off_triton, x, packed, weights, ids),
                       fused_experts_reference(x, unpacked, weights, ids))


# bn 8: one K step short of HIDDEN = 40 and INTER = 12 (tails), 4 row pairs a tile; bn 2: one row pair a tile
GROUPED_TILES = [GroupedConfig(block=4, bn=8, bk=16), GroupedConfig(block=8, bn=2, bk=32)]


@pytest.mark.parametrize("config", GROUPED_TILES, ids=[f"block{c.block} bn{c.bn} bk{c.bk}" for c in GROUPED_TILES])
@pytest.mark.parametrize("edge", [False, True], ids=["random", "edge"])
def test_the_int4_grouped_gemm_gives_the_int8_grouped_gemms_bits_on_the_unpacked_weights(config, edge):
    """gate/up (silu(gate) * up paired across the packed halves) and down (times the routing weight): the grouped
    GEMM on packed bytes == the int8 grouped GEMM on the unpacked values, every bit - the int32 sums are exact
    whatever their grouping; with edge values they reach their extremes. And the down projection equals the per-row
    int8 reference (int8_matmul_rescale_reference on the unpacked expert) bit for bit."""
    m, top_k = 7, 2
    packed, unpacked, x = bit_case(m, edge, seed=21)
    x_q, x_s = quantize_per_token_int8_reference(x)
    ids, _ = routing(m, top_k, EXPERTS, seed=23)
    route_weight = torch.rand(m * top_k, generator=torch.Generator().manual_seed(24)).bfloat16()
    grouped = group_by_expert(ids, EXPERTS, config.block)
    h = grouped_gemm(x_q, x_s.reshape(-1), packed.gate_up, packed.gate_up_scale, grouped, top_k, torch.bfloat16,
                     config, gated=True, int4=True)
    want_h = grouped_gemm(x_q, x_s.reshape(-1), unpacked.gate_up, unpacked.gate_up_scale, grouped, top_k,
                          torch.bfloat16, config, gated=True)
    assert h.shape == (m * top_k, INTER) and torch.equal(h, want_h)
    h_q, h_s = quantize_per_token_int8_reference(h)
    y = grouped_gemm(h_q, h_s.reshape(-1), packed.down, packed.down_scale, grouped, 1, torch.bfloat16, config,
                     route_weight=route_weight, int4=True)
    assert y.shape == (m * top_k, HIDDEN)
    assert torch.equal(y, grouped_gemm(h_q, h_s.reshape(-1), unpacked.down, unpacked.down_scale, grouped, 1,
                                       torch.bfloat16, config, route_weight=route_weight))
    for r in range(m * top_k):
        e = int(ids.reshape(-1)[r])
        want = int8_matmul_rescale_reference(h_q[r : r + 1], h_s[r : r + 1], unpacked.down[e],
                                             unpacked.down_scale[e, :, None], torch.bfloat16) * route_weight[r]
        assert torch.equal(y[r : r + 1], want), f"row {r} (expert {e})"


def test_the_int4_grouped_gemm_takes_int8_bytes_in_tiles_of_whole_row_pairs():
    packed, _ = int4_experts(EXPERTS, seed=24)
    x_q = torch.zeros(2, HIDDEN, dtype=torch.int8)
    grouped = group_by_expert(torch.zeros(2, 1, dtype=torch.int64), EXPERTS, 4)
    with pytest.raises(ValueError, match="whole row pairs, got torch.int8 and tiles of 3"):
        grouped_gemm(x_q, torch.ones(2), packed.gate_up, packed.gate_up_scale, grouped, 1, torch.bfloat16,
                     GroupedConfig(block=4, bn=3, bk=16), gated=True, int4=True)


@pytest.mark.parametrize("m", [1, 5])
def test_a_float_shared_expert_rides_along_with_int4_experts(m):
    """The W4A8 recipe keeps the shared expert BF16: one more slot of the int4 launches, as beside int8 experts -
    the bits of the int8 experts with the same rider, in the interpreter (compiled for a GPU, the float slot's sum
    may take another order in each kernel: tests/test_kernels_on_gpu.py)."""
    packed, unpacked = int4_experts(EXPERTS, seed=11)
    gen = torch.Generator().manual_seed(12)
    shared = StackedExperts((torch.randn(1, 2 * INTER, HIDDEN, generator=gen) * 0.1).bfloat16(),
                            (torch.randn(1, HIDDEN, INTER, generator=gen) * 0.1).bfloat16())
    assert shares_layout(packed, shared) and shares_layout(unpacked, shared)
    assert not shares_layout(packed, StackedExperts(shared.gate_up[:, :INTER], shared.down[:, : HIDDEN // 2]))
    x = torch.randn(m, HIDDEN, generator=gen).bfloat16()
    ids, weights = routing(m, 2, EXPERTS, seed=13)
    shared_weight = torch.rand(m, 1, generator=gen).bfloat16()
    plan = plan_experts_triton(x, packed, ids, shared=shared, matvec_max_pairs=ids.numel())  # matvec at m = 5 too
    assert (plan.path, plan.shared) == (MATVEC, SLOT)
    got = run_experts(plan, x, packed, weights, ids, shared=(shared, shared_weight))
    assert torch.equal(got, run_experts(plan, x, unpacked, weights, ids, shared=(shared, shared_weight)))


def test_int4_experts_need_tiles_of_whole_row_pairs():
    packed, _ = int4_experts(2, seed=14)
    ids, weights = routing(1, 1, 2, seed=15)
    with pytest.raises(ValueError, match="row pair"):
        matvec_experts(torch.zeros(1, HIDDEN).bfloat16(), None, packed, ids, weights, torch.bfloat16,
                       MatvecConfig(gate_up_bn=1, down_bn=1, bk=16))


# --- the runtime on a W4A8 artifact, its experts kept packed as on a GPU -------------------------------------------

PROMPTS = [[31, 7, 1500, 42, 9], [1000, 3, 77, 640, 12, 18, 901]]
MAX_NEW = 6
# Interpreted, every program runs in Python: tiles as wide as the tiny model's rows keep the programs few (the
# kernels' masks, slots and nibbles are the same at any tile).
INTERPRETER_TILES = MatvecConfig(gate_up_bn=32, down_bn=32, bk=128)


def experts_as_on_a_gpu(monkeypatch) -> None:
    """The MoE experts' plan as on a GPU - the Triton kernels, interpreted on CPU tensors, INTERPRETER_TILES - every
    other operator still its CPU reference (all of them interpreted would take minutes)."""
    import npuport.kernels.fused_moe.plan as plan_module
    from npuport.kernels.implementations import REFERENCE, TRITON

    monkeypatch.setattr(plan_module, "use_triton", lambda *ts: all(t.dtype != torch.float64 for t in ts))
    monkeypatch.setattr(plan_module, "runnable", lambda op, device, native, triton: TRITON if triton else REFERENCE)
    monkeypatch.setattr(plan_module, "matvec_config", lambda pairs, device=None, int4=False: INTERPRETER_TILES)


def test_a_w4a8_artifact_decodes_the_same_tokens_from_packed_int4_experts(w4a8_artifact, monkeypatch,
                                                                         one_cpu_thread):
    """The loader keeps the experts packed where the int4 kernels run (forced here on CPU): half the expert bytes,
    the int8 experts' logits bit for bit (both through the kernels), the greedy tokens of the CPU path that unpacks
    them at load (its references), and greedy MTP == greedy."""
    import npuport.kernels.fused_moe.plan as plan_module
    import npuport.runtime.loader as loader_module
    from npuport.runtime.generate import forward_logits, generate
    from npuport.runtime.loader import load_model
    from npuport.runtime.model import MoE

    unpacked = load_model(w4a8_artifact, "cpu", torch.float32)
    cpu_tokens = generate(unpacked, PROMPTS, MAX_NEW).tokens
    monkeypatch.setattr(loader_module, "keeps_int4_packed", lambda device: True)
    packed = load_model(w4a8_artifact, "cpu", torch.float32)
    layers = [(a.mlp.experts, b.mlp.experts) for a, b in zip(packed.layers, unpacked.layers, strict=True)
              if isinstance(a.mlp, MoE)]
    assert layers and all(p.int4 and not u.int4 for p, u in layers)
    for p, u in layers:
        assert p.gate_up_proj.nbytes * 2 == u.gate_up_proj.nbytes and p.down_proj.nbytes * 2 == u.down_proj.nbytes
        assert torch.equal(p.stacked().unpacked().gate_up, u.gate_up_proj)
        assert torch.equal(p.gate_up_proj_scale, u.gate_up_proj_scale)
    experts_as_on_a_gpu(monkeypatch)
    # the int8 experts take the path the int4 ones take at each token count (the paths round alike, not the same)
    experts = layers[0][0].stacked().num_experts
    monkeypatch.setattr(plan_module, "MATVEC_MAX_PAIRS", int(plan_module.INT4_MATVEC_PAIRS_PER_EXPERT * experts))
    assert torch.equal(forward_logits(packed, PROMPTS)[0], forward_logits(unpacked, PROMPTS)[0])
    tokens = generate(packed, PROMPTS, MAX_NEW).tokens
    assert tokens == cpu_tokens
    assert generate(packed, PROMPTS, MAX_NEW, mtp=1).tokens == tokens


@pytest.mark.parametrize("experts", [4, 16])
def test_int4_experts_take_the_matvec_kernels_up_to_pairs_in_proportion_to_their_number(experts):
    """The matvec kernels serve int4 experts up to INT4_MATVEC_PAIRS_PER_EXPERT routed pairs an expert (1.5: at
    397B-A17B's 512 experts and top 10, batch 32's 320 pairs take them, an MTP k = 1 verify step's 640 too), the
    grouped GEMMs beyond; int8 experts of the same shape keep their fixed limit of MATVEC_MAX_PAIRS."""
    from npuport.kernels.fused_moe import GROUPED, MATVEC, MATVEC_MAX_PAIRS, plan_experts_triton
    from npuport.kernels.fused_moe.plan import INT4_MATVEC_PAIRS_PER_EXPERT

    packed, unpacked = int4_experts(experts, seed=9)
    top_k = 2
    limit = int(INT4_MATVEC_PAIRS_PER_EXPERT * experts)
    for tokens in (limit // top_k, limit // top_k + 1):
        x = torch.randn(tokens, HIDDEN).bfloat16()
        ids = torch.zeros(tokens, top_k, dtype=torch.int64)
        want = MATVEC if tokens * top_k <= limit else GROUPED
        assert plan_experts_triton(x, packed, ids).path == want
        assert plan_experts_triton(x, unpacked, ids).path == (MATVEC if tokens * top_k <= MATVEC_MAX_PAIRS else GROUPED)


@pytest.mark.parametrize("pairs", [320, 8192, 40960], ids=["decode", "short prefill", "long prefill"])
@pytest.mark.parametrize("gated", [True, False], ids=["gate-up", "down"])
def test_the_int4_grouped_gemm_compiles_for_hopper_onto_int8_tensor_cores(pairs, gated):
    """Compiled for an H100 / H200 (sm_90) by Triton itself, no GPU needed, with the tiles grouped_config picks at
    397B-A17B's 512 experts: the nibble tiles reach the tensor cores as int8 (an mma on s8 operands), within one
    block's shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from npuport.devices import HOPPER_SHARED_MEMORY_PER_BLOCK
    from npuport.kernels.fused_moe.grouped_gemm import _grouped_gemm_kernel, grouped_config, grouped_stages

    config = grouped_config(pairs, 512, torch.device("cuda"))
    types = {"a": "*i8", "w": "*i8", "a_scale": "*fp32", "w_scale": "*fp32", "route_weight": "*bf16",
             "rows": "*i32", "block_expert": "*i32", "out": "*bf16"}
    ints = ["N", "K", "PAIRS", "A_DIV", "n_tasks", "sa_m", "sw_e", "sw_n", "sws_e", "so_m"]
    constants = {"BLOCK": config.block, "BN": config.bn, "BK": config.bk, "INT8": True, "GATED": gated,
                 "ROUTED": not gated, "INT4": True}
    signature = types | dict.fromkeys(ints, "i32") | dict.fromkeys(constants, "constexpr")
    stages = grouped_stages(config, 1, gated, HOPPER_SHARED_MEMORY_PER_BLOCK)
    kernel = triton.compile(ASTSource(_grouped_gemm_kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": config.num_warps, "num_stages": stages})
    # mma.sync...s32.s8.s8.s32 for the small tiles, Hopper's wgmma.mma_async...s32.s8.s8 for the prefill ones
    assert re.search(r"mma[\w.]*\.s8\.s8", kernel.asm["ptx"]), "the int8 dots did not reach the tensor cores"
    assert 0 < kernel.metadata.shared <= HOPPER_SHARED_MEMORY_PER_BLOCK
