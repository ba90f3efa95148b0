"""The NPU path of each kernel entry point, checked on the CPU: inside standing_in_for_npu() an entry point takes its
native wrapper (kernels/npu/), which calls the stand-in of torch-npu's operator (what its documentation says it
computes); the result must equal the entry point's PyTorch reference - exactly where both compute the same fp32
arithmetic in the same order, within float32 (or one bf16 step of) rounding otherwise. A call that breaks an
operator's documented constraint steps down to the reference, calling no operator."""

from __future__ import annotations

import pytest
import torch

from npuport.kernels.causal_conv1d import (
    causal_conv1d_fn,
    causal_conv1d_fn_reference,
    causal_conv1d_update,
    causal_conv1d_update_reference,
)
from npuport.kernels.decode_attention import decode_attention, decode_attention_reference
from npuport.kernels.fused_moe import StackedExperts, fused_experts_reference, route_top_k_reference
from npuport.kernels.gated_delta_rule import (
    VerifyLog,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_reference,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_gated_delta_rule_reference,
)
from npuport.kernels.implementations import (
    NATIVE,
    REFERENCE,
    TRITON,
    batch_invariant_calls,
    fall_back,
    implementation,
    reset_fall_backs,
    standing_in_for_npu,
)
from npuport.kernels.npu.moe import moe_experts_native, moe_routing_native
from npuport.kernels.npu.operators import recording_calls
from npuport.kernels.npu.w8a8 import quantize_refusal
from npuport.kernels.rms_norm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from npuport.kernels.rope import apply_rope, apply_rope_reference, rms_norm_rope, rms_norm_rope_reference
from npuport.kernels.w8a8 import (
    int8_matmul_rescale,
    int8_matmul_rescale_reference,
    quantize_per_token_int8,
    quantize_per_token_int8_reference,
)

FLOAT32 = {"rtol": 1e-5, "atol": 1e-5}
BF16_STEP = {"rtol": 1.6e-2, "atol": 1.6e-2}


def tolerance(dtype: torch.dtype) -> dict:
    return FLOAT32 if dtype == torch.float32 else BF16_STEP


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(shape, generator=gen)).to(dtype)


def on_npu_path(fn, *args, **kwargs):
    """fn(*args, **kwargs) standing in for an NPU: (its result, the names of the operators it called)."""
    with standing_in_for_npu(), recording_calls() as calls:
        out = fn(*args, **kwargs)
    return out, [c.name for c in calls]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norms_through_the_gemma_norm_equal_the_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    x, residual = randn(gen, 3, 5, 64, dtype=dtype, scale=3), randn(gen, 3, 5, 64, dtype=dtype)
    weight = randn(gen, 64, dtype=dtype, scale=0.1)
    got, called = on_npu_path(rms_norm, x, weight, 1e-6)
    assert called == ["npu_gemma_rms_norm"]
    assert torch.equal(got, rms_norm_reference(x, weight, 1e-6))
    (normed, summed), called = on_npu_path(add_rms_norm, x, residual, weight, 1e-6)
    want_normed, want_summed = add_rms_norm_reference(x, residual, weight, 1e-6)
    assert called == ["npu_gemma_rms_norm"]
    assert torch.equal(summed, want_summed) and torch.equal(normed, want_normed)


@pytest.mark.parametrize(("dtype", "rot"), [(torch.float32, 8), (torch.bfloat16, 8), (torch.float32, 32)])
def test_rope_through_rotary_mul_equals_the_reference(dtype, rot):
    gen = torch.Generator().manual_seed(1)
    b, t, h, d = 2, 3, 4, 32
    q = randn(gen, b, t, h, 2 * d, dtype=dtype, scale=3)[..., :d]  # the q half of a [q | gate] projection
    weight = randn(gen, d, dtype=dtype, scale=0.1)
    angles = randn(gen, b, t, rot, scale=4)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got, called = on_npu_path(rms_norm_rope, q, weight, 1e-6, cos, sin)
    assert called == ["npu_gemma_rms_norm", "npu_rotary_mul"]
    assert torch.equal(got, rms_norm_rope_reference(q, weight, 1e-6, cos, sin))
    got, called = on_npu_path(apply_rope, q, cos, sin)
    assert called == ["npu_rotary_mul"]
    assert torch.equal(got, apply_rope_reference(q, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_through_dynamic_quant_and_quant_matmul_equals_the_reference(dtype):
    gen = torch.Generator().manual_seed(2)
    x = randn(gen, 6, 96, dtype=dtype, scale=2)
    x[3] = 0  # an all-zero row: npuport floors its scale
    (x_q, x_scale), called = on_npu_path(quantize_per_token_int8, x)
    want_q, want_scale = quantize_per_token_int8_reference(x)
    assert called == ["npu_dynamic_quant"]
    assert torch.equal(x_q, want_q) and torch.equal(x_scale, want_scale)
    w_q = torch.randint(-128, 128, (40, 96), generator=gen, dtype=torch.int8)
    w_scale = torch.rand(40, 1, generator=gen) / 100
    got, called = on_npu_path(int8_matmul_rescale, x_q, x_scale, w_q, w_scale, dtype)
    assert called == ["npu_quant_matmul"]
    assert torch.equal(got, int8_matmul_rescale_reference(x_q, x_scale, w_q, w_scale, dtype))


def test_a_dtype_outside_the_documentation_is_refused_on_an_npu_and_taken_standing_in():
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(9))
    assert "bf16 / fp16" in quantize_refusal(x) and "bf16 / fp16" in quantize_refusal(x.double())
    assert quantize_refusal(x.bfloat16()) is None
    with standing_in_for_npu():
        assert quantize_refusal(x) is None and quantize_refusal(x.double()) is None
    (x_q, x_scale), called = on_npu_path(quantize_per_token_int8, x.double())
    want_q, want_scale = quantize_per_token_int8_reference(x.double())
    assert called == ["npu_dynamic_quant"] and torch.equal(x_q, want_q) and torch.equal(x_scale, want_scale)


@pytest.mark.parametrize(("dtype", "tokens", "gated"), [(torch.float32, 1, True), (torch.float32, 3, False),
                                                        (torch.bfloat16, 4, True)])
def test_decode_attention_through_fused_infer_attention_equals_the_reference(dtype, tokens, gated):
    gen = torch.Generator().manual_seed(3)
    b, hq, hkv, d, s = 3, 4, 2, 32, 40
    q_gate = randn(gen, b, tokens, hq, 2 * d, dtype=dtype)
    q, gate = q_gate[..., :d], q_gate[..., d:] if gated else None
    keys, values = randn(gen, b, s, hkv, d, dtype=dtype), randn(gen, b, s, hkv, d, dtype=dtype)
    start = torch.tensor([0, 17, s - tokens])
    got, called = on_npu_path(decode_attention, q, keys, values, start, gate)
    assert called == ["npu_fused_infer_attention_score"]
    torch.testing.assert_close(got, decode_attention_reference(q, keys, values, start, gate), **tolerance(dtype))
    # a batch-invariant step keeps to the kernel that plans for it (here, on the CPU, the reference)
    got, called = on_npu_path(decode_attention, q, keys, values, start, gate, plan_tokens=4)
    assert called == [] and torch.equal(got, decode_attention_reference(q, keys, values, start, gate))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_of_width_3_through_the_fused_conv_equals_the_reference(dtype):
    gen = torch.Generator().manual_seed(4)
    b, t, d, length = 2, 3, 128, 5
    x, weight = randn(gen, b, t, d, dtype=dtype), randn(gen, d, 3, dtype=dtype, scale=0.5)
    window = randn(gen, b, d, length, dtype=dtype)
    got_window, want_window = window.clone(), window.clone()
    got, called = on_npu_path(causal_conv1d_update, x, weight, got_window)
    assert called == ["npu_fused_causal_conv1d"]
    torch.testing.assert_close(got, causal_conv1d_update_reference(x, weight, want_window), **tolerance(dtype))
    assert torch.equal(got_window, want_window)
    n_valid = torch.tensor([3, 1])
    got_window, want_window = window.clone(), window.clone()
    got, called = on_npu_path(causal_conv1d_fn, x, weight, got_window, n_valid)
    want = causal_conv1d_fn_reference(x, weight, want_window, n_valid)
    assert called == ["npu_fused_causal_conv1d"]
    torch.testing.assert_close(got, want, **tolerance(dtype))
    assert torch.equal(got_window, want_window)


def test_qwen35s_width_4_conv_steps_down_from_the_fused_conv():
    gen = torch.Generator().manual_seed(5)
    x, weight, window = randn(gen, 2, 1, 128), randn(gen, 128, 4), randn(gen, 2, 128, 3)
    want_window = window.clone()
    got, called = on_npu_path(causal_conv1d_update, x, weight, window)
    assert called == []
    assert torch.equal(got, causal_conv1d_update_reference(x, weight, want_window))


def gdn_inputs(seed: int, b: int, t: int, h: int, hv: int, kd: int, vd: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q, k = randn(gen, b, t, h, kd, dtype=dtype), randn(gen, b, t, h, kd, dtype=dtype)
    v = randn(gen, b, t, hv, vd, dtype=dtype)
    a, b_logits = randn(gen, b, t, hv), randn(gen, b, t, hv)  # raw in_proj_a / in_proj_b outputs
    A_log, dt_bias = torch.rand(hv, generator=gen).log(), torch.rand(hv, generator=gen)
    state = randn(gen, b, hv, kd, vd, scale=0.3)
    return q, k, v, a, b_logits, A_log, dt_bias, state


@pytest.mark.parametrize(("t", "h", "hv", "kd", "vd"), [(1, 2, 4, 16, 16), (2, 1, 3, 16, 8), (1, 2, 2, 8, 24)])
def test_gdn_decode_through_the_recurrent_operator_equals_the_reference(t, h, hv, kd, vd):
    q, k, v, a, b_logits, A_log, dt_bias, state = gdn_inputs(t + hv, 3, t, h, hv, kd, vd)
    got_state, want_state = state.clone(), state.clone()
    got, called = on_npu_path(fused_recurrent_gated_delta_rule, q, k, v, a, b_logits, got_state, A_log=A_log,
                              dt_bias=dt_bias)
    want = fused_recurrent_gated_delta_rule_reference(q, k, v, a, b_logits, want_state, A_log=A_log, dt_bias=dt_bias)
    assert called == ["npu_recurrent_gated_delta_rule"]
    torch.testing.assert_close(got, want, **FLOAT32)
    torch.testing.assert_close(got_state, want_state, **FLOAT32)


def test_a_gdn_verify_step_with_a_log_keeps_to_npuports_kernels():
    q, k, v, a, b_logits, A_log, dt_bias, state = gdn_inputs(6, 2, 3, 1, 2, 8, 8)
    log = VerifyLog.empty(2, 3, 1, 2, 8, 8, torch.float32, torch.device("cpu"))
    want_state, want_log = state.clone(), log.clone()
    got, called = on_npu_path(fused_recurrent_gated_delta_rule, q, k, v, a, b_logits, state, log, A_log=A_log,
                              dt_bias=dt_bias)
    want = fused_recurrent_gated_delta_rule_reference(q, k, v, a, b_logits, want_state, want_log, A_log=A_log,
                                                      dt_bias=dt_bias)
    assert called == [] and torch.equal(got, want) and torch.equal(log.writes, want_log.writes)


@pytest.mark.parametrize(("t", "with_state"), [(8, True), (5, False)])
def test_gdn_prefill_through_the_chunk_operator_equals_the_reference(t, with_state):
    q, k, v, a, b_logits, A_log, dt_bias, state = gdn_inputs(t, 2, t, 1, 2, 128, 128)
    g, beta = -torch.rand(2, t, 2), torch.rand(2, t, 2)
    g[1, -2:], beta[1, -2:] = 0, 0  # right padding leaves the state as it was
    initial = state if with_state else None
    (got, got_final), called = on_npu_path(chunk_gated_delta_rule, q, k, v, g, beta, initial)
    want, want_final = chunk_gated_delta_rule_reference(q, k, v, g, beta, initial)
    assert called == ["npu_chunk_gated_delta_rule"]
    torch.testing.assert_close(got, want, **FLOAT32)
    torch.testing.assert_close(got_final, want_final, **FLOAT32)
    if with_state:
        assert torch.equal(state, gdn_inputs(t, 2, t, 1, 2, 128, 128)[-1])  # the caller's initial state untouched


def test_gdn_prefills_outside_the_chunk_operators_limits_step_down():
    for t, kd in [(9, 128), (4, 64)]:  # over 8 tokens a sequence; head dims other than 128
        q, k, v, *_ = gdn_inputs(0, 1, t, 1, 2, kd, kd)
        g, beta = -torch.rand(1, t, 2), torch.rand(1, t, 2)
        _, called = on_npu_path(chunk_gated_delta_rule, q, k, v, g, beta)
        assert called == []


def random_experts(gen: torch.Generator, experts: int, hidden: int, inter: int, quantized: bool,
                   dtype: torch.dtype) -> StackedExperts:
    gate_up, down = randn(gen, experts, 2 * inter, hidden, scale=0.2), randn(gen, experts, hidden, inter, scale=0.2)
    if not quantized:
        return StackedExperts(gate_up.to(dtype), down.to(dtype))

    def per_channel(w):
        scale = w.abs().amax(-1) / 127
        return (w / scale[..., None]).round().clamp(-128, 127).to(torch.int8), scale.float()

    (gu_q, gu_s), (d_q, d_s) = per_channel(gate_up), per_channel(down)
    return StackedExperts(gu_q, d_q, gu_s, d_s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_routing_through_gating_top_k_softmax_equals_the_reference(dtype):
    gen = torch.Generator().manual_seed(7)
    logits = randn(gen, 9, 16, dtype=dtype, scale=2)
    (weights, ids), called = on_npu_path(moe_routing_native, logits, 4, dtype)
    want_weights, want_ids = route_top_k_reference(logits, 4, dtype)
    assert called == ["npu_moe_gating_top_k_softmax"]
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, **tolerance(dtype))


@pytest.mark.parametrize(("quantized", "with_shared", "arrived_int8", "dtype"), [
    (False, False, False, torch.float32), (False, True, False, torch.bfloat16), (True, False, False, torch.float32),
    (True, True, True, torch.float32), (True, True, False, torch.bfloat16),
])
def test_moe_experts_through_routing_and_grouped_matmul_equal_the_reference(quantized, with_shared, arrived_int8,
                                                                            dtype):
    gen = torch.Generator().manual_seed(8)
    m, top_k, experts, hidden, inter = 7, 3, 6, 32, 16
    stacked = random_experts(gen, experts, hidden, inter, quantized, dtype)
    x = randn(gen, m, hidden, dtype=dtype)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(m)])
    ids[2] = ids[1]  # two tokens to the same experts
    weights = torch.softmax(randn(gen, m, top_k), -1).to(dtype)
    shared = (random_experts(gen, 1, hidden, 24, quantized, dtype), torch.rand(m, 1, generator=gen).to(dtype)) \
        if with_shared else None
    x_int8 = quantize_per_token_int8_reference(x) if arrived_int8 else None
    got, called = on_npu_path(moe_experts_native, x, stacked, weights, ids, shared=shared, x_int8=x_int8)
    want = fused_experts_reference(x, stacked, weights, ids, shared=shared, x_int8=x_int8)
    assert called[0] == "npu_moe_init_routing_v2" and called[-1] == "npu_moe_finalize_routing"
    assert called.count("npu_grouped_matmul") == 2 * (1 + with_shared)
    torch.testing.assert_close(got, want, **tolerance(dtype))


def test_who_decides_native():
    cpu = torch.device("cpu")
    assert implementation("rms_norm", cpu) == REFERENCE
    with standing_in_for_npu():
        assert implementation("rms_norm", cpu) == NATIVE and implementation("gated_rms_norm", cpu) == REFERENCE
        with batch_invariant_calls():  # only operators whose results follow no summation order stay native
            assert implementation("rms_norm", cpu) == REFERENCE
            assert implementation("w8a8_matmul", cpu) == NATIVE
        with reset_fall_backs(), pytest.warns(RuntimeWarning, match="rms_norm switched"):
            fall_back("rms_norm", "planted")
            assert implementation("rms_norm", cpu) == REFERENCE
        assert implementation("rms_norm", cpu) == NATIVE
    assert TRITON not in {implementation(op, cpu) for op in ("rms_norm", "decode_attention")}
