"""Fused MoE: routing on the device and the grouped expert kernels against independent references - a plain
Python grouping of the routed rows, a float64 softmax top-k, and the per-expert PyTorch loop (BF16: each
expert's F.linear; W8A8: the int8 references of kernels.w8a8) - run on CPU tensors through Triton's
interpreter at small widths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from npuport.kernels.fused_moe import (  # noqa: E402
    GROUPED,
    MATVEC,
    SLOT,
    ExpertPlan,
    GroupedConfig,
    MatvecConfig,
    StackedExperts,
    expert_mlp_reference,
    fused_experts,
    fused_experts_reference,
    group_by_expert,
    grouped_config,
    grouped_gemm,
    matvec_config,
    matvec_experts,
    max_blocks,
    plan_experts,
    plan_experts_triton,
    route_top_k_reference,
    route_top_k_triton,
    run_experts,
)
from npuport.kernels.implementations import NATIVE, REFERENCE  # noqa: E402
from npuport.kernels.w8a8 import (  # noqa: E402
    int8_matmul_rescale_reference,
    quantize_per_token_int8_reference,
)

HIDDEN, INTER = 64, 32


def routings(m: int, top_k: int, experts: int, kind: str, seed: int) -> torch.Tensor:
    """expert ids [M, top_k], distinct per token: random, or every token on the same top_k experts (one of
    them holding all tokens in slot 0), or only the first top_k + 1 experts used (the others get nothing)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "same":
        return torch.arange(top_k).repeat(m, 1)
    pool = experts if kind == "random" else top_k + 1
    return torch.stack([torch.randperm(pool, generator=gen)[:top_k] for _ in range(m)])


def expected_blocks(ids: torch.Tensor, experts: int, block: int) -> list[tuple[int, list[int]]]:
    """(expert, rows) per block, by hand: each expert's rows token * top_k + slot in token order, in blocks."""
    top_k = ids.shape[1]
    out = []
    for e in range(experts):
        rows = [t * top_k + s for t in range(ids.shape[0]) for s in range(top_k) if int(ids[t, s]) == e]
        for start in range(0, len(rows), block):
            out.append((e, rows[start : start + block]))
    return out


@pytest.mark.parametrize(("m", "top_k", "experts", "block"), [(1, 8, 256, 16), (5, 3, 6, 4), (64, 8, 256, 16),
                                                                (33, 2, 4, 16)])
@pytest.mark.parametrize("kind", ["random", "same", "few"])
def test_rows_are_grouped_by_expert_and_padded_to_whole_blocks(m, top_k, experts, block, kind):
    ids = routings(m, top_k, experts, kind, seed=m * 31 + top_k)
    got = group_by_expert(ids, experts, block)
    pairs = m * top_k
    want = expected_blocks(ids, experts, block)
    assert got.rows.numel() == max_blocks(pairs, experts, block) * block >= len(want) * block
    for b, (expert, rows) in enumerate(want):
        assert int(got.block_expert[b]) == expert
        assert got.rows[b * block : (b + 1) * block].tolist() == rows + [pairs] * (block - len(rows))
    assert (got.block_expert[len(want) :] == -1).all()
    assert (got.rows[len(want) * block :] == pairs).all()


@pytest.mark.parametrize("route", [route_top_k_reference, route_top_k_triton], ids=["torch", "triton"])
@pytest.mark.parametrize(("m", "experts", "top_k"), [(9, 16, 4), (3, 256, 8), (2, 512, 10), (4, 6, 1)])
def test_routing_is_the_renormalised_softmax_top_k(route, m, experts, top_k):
    logits = torch.randn(m, experts, generator=torch.Generator().manual_seed(experts))
    weights, ids = route(logits, top_k, torch.bfloat16)  # fp32 logits: no ties to order
    probs = torch.softmax(logits.double(), -1)
    want_ids = probs.argsort(-1, descending=True)[:, :top_k]
    assert torch.equal(ids, want_ids)
    top = probs.gather(-1, want_ids)
    torch.testing.assert_close(weights.double(), top / top.sum(-1, keepdim=True), atol=4e-3, rtol=0)
    assert weights.dtype == torch.bfloat16


def random_experts(experts: int, quantized: bool, seed: int) -> StackedExperts:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * INTER, HIDDEN, generator=gen) * 0.1
    down = torch.randn(experts, HIDDEN, INTER, generator=gen) * 0.1
    if not quantized:
        return StackedExperts(gate_up.bfloat16(), down.bfloat16())

    def per_channel(w):
        scale = w.abs().amax(-1) / 127
        return (w / scale[..., None]).round().clamp(-128, 127).to(torch.int8), scale.float()

    (gu_q, gu_s), (d_q, d_s) = per_channel(gate_up), per_channel(down)
    return StackedExperts(gu_q, d_q, gu_s, d_s)


def loop_over_experts(x, experts: StackedExperts, weights, ids):
    """The per-expert loop written out again here, independently of the package's reference."""
    out = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float32)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            row = x[t : t + 1]
            if experts.quantized:
                q, sc = quantize_per_token_int8_reference(row)
                w, ws = experts.gate_up[e], experts.gate_up_scale[e, :, None]
                g = int8_matmul_rescale_reference(q, sc, w[:INTER], ws[:INTER], x.dtype)
                u = int8_matmul_rescale_reference(q, sc, w[INTER:], ws[INTER:], x.dtype)
                hq, hs = quantize_per_token_int8_reference(F.silu(g) * u)
                y = int8_matmul_rescale_reference(hq, hs, experts.down[e], experts.down_scale[e, :, None], x.dtype)
            else:
                g, u = row @ experts.gate_up[e, :INTER].T, row @ experts.gate_up[e, INTER:].T
                y = (F.silu(g) * u) @ experts.down[e].T
            out[t] += (y * weights[t, s])[0].float()
    return out.to(x.dtype)


SHAPES = [(1, 1, 8, 256, "random"), (1, 4, 8, 256, "random"), (8, 2, 4, 16, "few"), (64, 1, 8, 256, "random"),
          (3, 3, 2, 8, "same"), (16, 4, 2, 4, "random")]
# The matvec kernels serve few routed pairs only (MATVEC_MAX_PAIRS); past that they are not run (and slow to
# interpret).
CASES = [(GROUPED, *s) for s in SHAPES] + [(MATVEC, *s) for s in SHAPES if s[0] * s[1] * s[2] <= 64]


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "w8a8"])
@pytest.mark.parametrize(("path", "batch", "tokens", "top_k", "experts", "kind"), CASES)
def test_fused_experts_equal_the_per_expert_loop(path, quantized, batch, tokens, top_k, experts, kind):
    m = batch * tokens
    gen = torch.Generator().manual_seed(m + top_k)
    x = torch.randn(m, HIDDEN, generator=gen).bfloat16()
    ids = routings(m, top_k, experts, kind, seed=m)
    weights = torch.softmax(torch.randn(m, top_k, generator=gen), -1).bfloat16()
    stacked = random_experts(experts, quantized, seed=experts)
    plan = plan_experts_triton(x, stacked, ids, matvec_max_pairs=m * top_k if path == MATVEC else 0)
    assert plan.path == path
    got = run_experts(plan, x, stacked, weights, ids)
    reference = fused_experts_reference(x, stacked, weights, ids)
    # BF16: the same rounding steps, GEMM sums in another order -> within bf16 rounding of the loop.
    torch.testing.assert_close(got.float(), loop_over_experts(x, stacked, weights, ids).float(), atol=2e-2,
                               rtol=2e-2)
    torch.testing.assert_close(got.float(), reference.float(), atol=1e-2, rtol=1e-2)
    if quantized:  # int32 sums are exact: only a silu ulp can move an int8 intermediate, rarely
        assert (got == reference).float().mean() >= 0.98


@pytest.mark.parametrize("routed", [False, True])
def test_the_int8_grouped_gemm_is_exact(routed):
    """The down projection alone: int32 sums and the fp32 rescale (times the routing weight) in the
    reference's order, so every value equals the per-row int8 reference bit for bit."""
    m, top_k, experts = 12, 3, 5
    ids = routings(m, top_k, experts, "random", seed=7)
    stacked = random_experts(experts, True, seed=11)
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(m * top_k, INTER, generator=gen).bfloat16()
    h_q, h_s = quantize_per_token_int8_reference(h)
    weights = torch.rand(m * top_k, generator=gen).bfloat16()
    cfg = GroupedConfig(block=4, bn=32, bk=16)
    routing = group_by_expert(ids, experts, cfg.block)
    got = grouped_gemm(h_q, h_s.reshape(-1), stacked.down, stacked.down_scale, routing, 1, torch.bfloat16, cfg,
                       route_weight=weights if routed else None)
    for r in range(m * top_k):
        e = int(ids.reshape(-1)[r])
        want = int8_matmul_rescale_reference(h_q[r : r + 1], h_s[r : r + 1], stacked.down[e],
                                             stacked.down_scale[e, :, None], torch.bfloat16)
        if routed:
            want = want * weights[r]
        assert torch.equal(got[r : r + 1], want), f"row {r} (expert {e})"


def test_int8_tokens_into_bf16_experts_are_refused():
    stacked = random_experts(4, False, seed=1)
    ids = routings(2, 2, 4, "random", seed=1)
    routing = group_by_expert(ids, 4, 16)
    x_q = torch.zeros(2, HIDDEN, dtype=torch.int8)
    with pytest.raises(ValueError, match="int8 tokens with int8 experts only"):
        grouped_gemm(x_q, torch.ones(2), stacked.gate_up, None, routing, 2, torch.bfloat16,
                     GroupedConfig(16, 64, 128), gated=True)


@pytest.mark.parametrize(("quantized", "arrived"), [(False, "float"), (True, "float"), (True, "int8")],
                         ids=["bf16", "w8a8", "w8a8 from int8 tokens"])
def test_a_weighted_expert_added_to_a_base_equals_the_torch_sum(quantized, arrived):
    """A shared expert added after the routed sum by the matvec kernels: base + weight * expert(x), product and sum
    rounded as two bf16 operations - from float tokens (int8 experts quantize them in the kernel) or from tokens
    quantized beforehand."""
    gen = torch.Generator().manual_seed(9)
    expert = random_experts(1, quantized, seed=3)
    x = torch.randn(5, HIDDEN, generator=gen).bfloat16()
    base = torch.randn(5, HIDDEN, generator=gen).bfloat16()
    weight = torch.rand(5, 1, generator=gen).bfloat16()
    want = base + weight * expert_mlp_reference(x, expert, 0)
    tokens, scales = quantize_per_token_int8_reference(x) if arrived == "int8" else (x, None)
    ids = torch.zeros(5, 1, dtype=torch.long)
    got = matvec_experts(tokens, None if scales is None else scales.reshape(-1), expert, ids, weight, torch.bfloat16,
                         matvec_config(5), add_to=base)
    assert torch.equal(got, want)


@pytest.mark.parametrize(("quantized", "shared_quantized"), [(False, False), (True, True), (True, False)],
                         ids=["bf16", "w8a8", "w8a8 with a bf16 shared expert"])
@pytest.mark.parametrize(("m", "top_k", "experts", "kind"), [(1, 8, 256, "random"), (3, 4, 8, "same"),
                                                             (7, 2, 4, "few"), (20, 8, 16, "random")])
def test_the_shared_expert_rides_along_as_one_more_slot(quantized, shared_quantized, m, top_k, experts, kind):
    """A GPU's plan (interpreted): the shared expert one more slot of the matvec pipeline (few tokens), or beside
    the grouped GEMMs (m = 20: 160 routed pairs), against the loop written out above plus the shared expert's own
    loop, all slots summed in fp32 and rounded once. The W8A8 recipes keep the shared expert BF16 beside int8 routed
    experts: the kernels take both kinds in one launch."""
    gen = torch.Generator().manual_seed(m * top_k)
    x = torch.randn(m, HIDDEN, generator=gen).bfloat16()
    ids = routings(m, top_k, experts, kind, seed=m)
    weights = torch.softmax(torch.randn(m, top_k, generator=gen), -1).bfloat16()
    shared_weight = torch.rand(m, 1, generator=gen).bfloat16()
    stacked, shared = random_experts(experts, quantized, seed=experts), random_experts(1, shared_quantized, seed=99)
    plan = plan_experts_triton(x, stacked, ids, shared=shared)
    assert (plan.path, plan.shared) == (MATVEC if m * top_k <= 128 else GROUPED, SLOT)
    got = run_experts(plan, x, stacked, weights, ids, shared=(shared, shared_weight))
    # the independent loop: each slot's product rounded to bf16, then summed in fp32 with the shared slot
    routed = torch.zeros(m, HIDDEN)
    for t in range(m):
        for s in range(top_k):
            one = (slice(t, t + 1), slice(s, s + 1))
            routed[t] += loop_over_experts(x[t : t + 1], stacked, weights[one], ids[one])[0].float()
    own = loop_over_experts(x, shared, shared_weight, torch.zeros(m, 1, dtype=torch.long)).float()
    torch.testing.assert_close(got.float(), (routed + own).bfloat16().float(), atol=2e-2, rtol=2e-2)
    want = fused_experts_reference(x, stacked, weights, ids, shared=(shared, shared_weight))
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    assert (got == want).float().mean() >= (0.98 if quantized else 0.9)


@pytest.mark.parametrize("pairs", [64, 8192, 32768], ids=["decode", "short prefill", "long prefill"])
@pytest.mark.parametrize("gated", [True, False], ids=["gate-up", "down"])
def test_grouped_gemm_tiles_fit_hopper_shared_memory_in_float32(pairs, gated):
    """Compiled for an H100 / H200 (sm_90) by Triton itself, no GPU needed: with the tiles grouped_config picks
    at 256 experts and the stages grouped_stages allows, float32 experts (a --dtype float32 run) stay within one
    block's shared memory - a float32 prefill on an H100 asked for 245,760 of its 232,448 bytes before."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from npuport.devices import HOPPER_SHARED_MEMORY_PER_BLOCK
    from npuport.kernels.fused_moe.grouped_gemm import _grouped_gemm_kernel, grouped_config, grouped_stages

    config = grouped_config(pairs, 256, torch.device("cuda"))
    stages = grouped_stages(config, 4, gated, HOPPER_SHARED_MEMORY_PER_BLOCK)
    pointers = ["a", "a_scale", "w", "w_scale", "route_weight", "rows", "block_expert", "out"]
    ints = ["N", "K", "PAIRS", "A_DIV", "n_tasks", "sa_m", "sw_e", "sw_n", "sws_e", "so_m"]
    signature = {name: "*i32" if name in ("rows", "block_expert") else "*fp32" for name in pointers}
    signature |= dict.fromkeys(ints, "i32")
    constants = {"BLOCK": config.block, "BN": config.bn, "BK": config.bk, "INT8": False, "GATED": gated,
                 "ROUTED": not gated, "INT4": False}
    signature |= dict.fromkeys(constants, "constexpr")
    kernel = triton.compile(ASTSource(_grouped_gemm_kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": config.num_warps, "num_stages": stages})
    assert 0 < kernel.metadata.shared <= HOPPER_SHARED_MEMORY_PER_BLOCK, (config, stages, kernel.metadata.shared)


def moe_call(m: int, top_k: int, experts: int, quantized: bool, seed: int):
    """(x [m, HIDDEN] bf16, stacked experts, weights, expert ids) of a small random call."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, HIDDEN, generator=gen).bfloat16()
    weights = torch.softmax(torch.randn(m, top_k, generator=gen), -1).bfloat16()
    return x, random_experts(experts, quantized, seed=experts), weights, routings(m, top_k, experts, "random", seed)


def test_the_plan_takes_the_implementation_chosen_for_the_device(monkeypatch):
    """kernels.implementations decides: CPU tensors take the PyTorch loop, an NPU's choice (played on the CPU) the
    native seam, a Triton device the kernels - unless the kernels cannot take the call (float64) or the operator
    fell back to its reference."""
    import npuport.kernels.implementations as implementations
    import npuport.kernels.launch as launch_module

    x, stacked, _, ids = moe_call(2, 2, 4, False, seed=1)
    assert plan_experts(x, stacked, ids).path == REFERENCE
    with implementations.standing_in_for_npu():
        assert plan_experts(x, stacked, ids).path == NATIVE
        with implementations.batch_invariant_calls():  # torch_npu's grouped matmul promises no per-row order
            assert plan_experts(x, stacked, ids).implementation == REFERENCE
    for module in (implementations, launch_module):
        monkeypatch.setattr(module, "runs_triton", lambda device: True)
    assert plan_experts(x, stacked, ids).path == MATVEC
    assert plan_experts(x.double(), stacked, ids).path == REFERENCE
    with implementations.reset_fall_backs(), pytest.warns(RuntimeWarning, match="moe_experts"):
        implementations.fall_back("moe_experts", "planted")
        assert plan_experts(x, stacked, ids).path == REFERENCE


@pytest.mark.parametrize(("m", "top_k", "plan_tokens"), [(1, 8, None), (16, 8, None), (17, 8, None), (1, 8, 16),
                                                          (1, 8, 17), (20, 8, 5)])
def test_the_path_and_tiles_follow_the_planned_routed_pairs(m, top_k, plan_tokens):
    """The matvec kernels up to MATVEC_MAX_PAIRS routed pairs of the planned tokens (the call's, or plan_tokens when
    more), the grouped GEMMs beyond; the tiles those of the planned pairs, the shared slot counted."""
    x, stacked, _, ids = moe_call(m, top_k, 16, False, seed=2)
    planned = max(m, plan_tokens or 0)
    shared = random_experts(1, False, seed=3)
    for rider in (None, shared):
        plan = plan_experts_triton(x, stacked, ids, shared=rider, plan_tokens=plan_tokens)
        slots, way = top_k + (rider is not None), None if rider is None else SLOT
        if planned * top_k <= 128:
            assert plan == ExpertPlan(MATVEC, way, False, matvec=matvec_config(planned * slots, x.device))
        else:
            assert plan == ExpertPlan(GROUPED, way, False, grouped=grouped_config(planned * top_k, 16, x.device))


@pytest.mark.parametrize("m", [3, 5])
def test_a_shared_expert_of_another_layout_is_added_after_the_routed_sum(m):
    """A shared expert the routed kernels cannot take as a slot (another width): the routed sum rounded, then
    + weight * shared(x) rounded as PyTorch rounds it - by matvec launches of its own for few tokens (m = 3), by
    PyTorch past the matvec limit (m = 5; a limit of 4 routed pairs, so that the routed experts take the grouped
    GEMMs in both) - against the independent loop and against the references so composed."""
    x, stacked, weights, ids = moe_call(m, 2, 4, False, seed=m)
    gen = torch.Generator().manual_seed(7)
    shared = StackedExperts(torch.randn(1, 2 * 2 * INTER, HIDDEN, generator=gen).bfloat16() * 0.1,
                            torch.randn(1, HIDDEN, 2 * INTER, generator=gen).bfloat16() * 0.1)
    shared_weight = torch.rand(m, 1, generator=gen).bfloat16()
    plan = plan_experts_triton(x, stacked, ids, shared=shared, matvec_max_pairs=4)
    assert plan.shared == (MATVEC if m <= 4 else REFERENCE)
    got = run_experts(plan, x, stacked, weights, ids, shared=(shared, shared_weight))
    routed = loop_over_experts(x, stacked, weights, ids)
    own = expert_mlp_reference(x, shared, 0)  # the loop above is written for the routed width
    torch.testing.assert_close(got.float(), (routed + shared_weight * own).float(), atol=2e-2, rtol=2e-2)
    want = fused_experts_reference(x, stacked, weights, ids) + shared_weight * own
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("path", [MATVEC, GROUPED])
@pytest.mark.parametrize("shared_quantized", [None, False, True], ids=["no shared", "bf16 shared", "w8a8 shared"])
def test_tokens_that_arrive_quantized_give_the_bits_of_float_tokens(path, shared_quantized):
    """Int8 dispatch: W8A8 experts given the tokens quantized per token compute what they compute from the float
    tokens (the same int8 values); a BF16 shared expert riding along in the matvec kernels takes the float tokens."""
    x, stacked, weights, ids = moe_call(3, 2, 4, True, seed=4)
    shared = None if shared_quantized is None else random_experts(1, shared_quantized, seed=5)
    gen = torch.Generator().manual_seed(6)
    call = {} if shared is None else {"shared": (shared, torch.rand(3, 1, generator=gen).bfloat16())}
    limit = 64 if path == MATVEC else 0
    from_float = plan_experts_triton(x, stacked, ids, shared=shared, matvec_max_pairs=limit)
    from_int8 = plan_experts_triton(x, stacked, ids, shared=shared, tokens_int8=True, matvec_max_pairs=limit)
    assert not from_float.int8_tokens
    assert from_int8.int8_tokens == (path == GROUPED or shared_quantized is not False)
    x_q, x_scale = quantize_per_token_int8_reference(x)
    want = run_experts(from_float, x, stacked, weights, ids, **call)
    assert torch.equal(run_experts(from_int8, x, stacked, weights, ids, x_int8=(x_q, x_scale), **call), want)


def test_off_triton_fused_experts_runs_the_loop_and_adds_the_shared_expert_after_it():
    """CPU tensors: the PyTorch loop, the shared expert added onto the rounded routed sum as PyTorch adds it."""
    x, stacked, weights, ids = moe_call(3, 2, 4, False, seed=6)
    shared, shared_weight = random_experts(1, False, seed=8), torch.rand(3, 1).bfloat16()
    got = fused_experts(x, stacked, weights, ids, shared=(shared, shared_weight))
    routed = loop_over_experts(x, stacked, weights, ids)
    torch.testing.assert_close(got.float(), (routed + shared_weight * expert_mlp_reference(x, shared, 0)).float(),
                               atol=2e-2, rtol=2e-2)
    assert torch.equal(got, fused_experts_reference(x, stacked, weights, ids)
                       + shared_weight * expert_mlp_reference(x, shared, 0))


def test_a_plan_runs_only_the_call_it_was_made_for():
    x, stacked, weights, ids = moe_call(2, 2, 4, False, seed=9)
    shared = (random_experts(1, False, seed=10), torch.ones(2, 1).bfloat16())
    with pytest.raises(ValueError, match="plan is for no shared expert"):
        run_experts(plan_experts(x, stacked, ids), x, stacked, weights, ids, shared=shared)
    with pytest.raises(ValueError, match="matvec path needs its tiles"):
        ExpertPlan(MATVEC, None, False, grouped=GroupedConfig(16, 64, 128))
    with pytest.raises(ValueError, match="no such expert plan"):
        ExpertPlan("few tokens", None, False, matvec=MatvecConfig())
