"""The Triton gated delta rule kernels (chunked prefill, fused recurrent decode / verify) against their
references, run on CPU tensors through Triton's interpreter.

Tolerances: with fp32 inputs both sides do fp32 math: 1e-5 (recurrent), 1e-4 (chunked, which sums in a
different order). With bf16 inputs the reference runs in fp32 on the same values; the recurrent kernel
also computes in fp32, so its states agree to 1e-5 and its bf16 outputs to one bf16 step; the chunked
kernel feeds bf16 tiles to tl.dot (as on the GPU), so it is held to 2e-2 in relative Frobenius norm."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from npuport.kernels.gated_delta_rule import (  # noqa: E402
    chunk_gated_delta_rule_reference,
    chunk_gated_delta_rule_triton,
    fused_recurrent_gated_delta_rule_reference,
    fused_recurrent_gated_delta_rule_triton,
)


def make_inputs(seed, b, t, h, hv, kd, vd, dtype=torch.float32, strided=False):
    """q, k [B, T, H, K], v [B, T, HV, V] (as views into one projection output when strided, like the
    runtime's split of in_proj_qkv), g <= 0, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    if strided:
        mixed = torch.randn(b, t, 2 * h * kd + hv * vd, generator=gen).to(dtype)
        q, k, v = mixed.split([h * kd, h * kd, hv * vd], dim=-1)
        q, k, v = q.reshape(b, t, h, kd), k.reshape(b, t, h, kd), v.reshape(b, t, hv, vd)
    else:
        q, k = (torch.randn(b, t, h, kd, generator=gen).to(dtype) for _ in range(2))
        v = torch.randn(b, t, hv, vd, generator=gen).to(dtype)
    g = -2 * torch.rand(b, t, hv, generator=gen)
    beta = torch.rand(b, t, hv, generator=gen)
    return q, k, v, g, beta, gen


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize(("t", "slots", "h", "hv", "kd", "vd"), [
    (1, 1, 2, 4, 16, 16), (1, 4, 2, 6, 16, 32), (3, 4, 1, 2, 32, 16), (4, 4, 2, 4, 16, 16), (5, 5, 3, 3, 8, 8),
])
def test_recurrent_kernel_writes_every_slot_like_the_reference(t, slots, h, hv, kd, vd):
    q, k, v, g, beta, gen = make_inputs(t * 7 + hv, 3, t, h, hv, kd, vd, strided=True)
    states = torch.randn(3, slots, hv, kd, vd, generator=gen)
    read_slot = torch.tensor([slots - 1, 0, min(1, slots - 1)])
    got_states, want_states = states.clone(), states.clone()
    out = fused_recurrent_gated_delta_rule_triton(q, k, v, g, beta, got_states, read_slot)
    want = fused_recurrent_gated_delta_rule_reference(q, k, v, g, beta, want_states, read_slot)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_states, want_states, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_states[:, t:], states[:, t:])  # slots past T are left alone


def test_recurrent_kernel_fuses_the_gating():
    q, k, v, _, _, gen = make_inputs(3, 2, 4, 2, 4, 16, 16)
    a, b = 8 * torch.randn(2, 4, 4, generator=gen), torch.randn(2, 4, 4, generator=gen)
    a_log, dt_bias = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    states = torch.randn(2, 4, 4, 16, 16, generator=gen)
    read_slot = torch.tensor([2, 1])
    got_states, want_states = states.clone(), states.clone()
    out = fused_recurrent_gated_delta_rule_triton(q, k, v, a, b, got_states, read_slot, A_log=a_log, dt_bias=dt_bias)
    want = fused_recurrent_gated_delta_rule_reference(q, k, v, a, b, want_states, read_slot, A_log=a_log,
                                                      dt_bias=dt_bias)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_states, want_states, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_recurrent_kernel_with_bf16_inputs(use_qk_l2norm):
    q, k, v, g, beta, gen = make_inputs(5, 2, 3, 2, 4, 16, 16, dtype=torch.bfloat16)
    if not use_qk_l2norm:
        q, k = q / 4, k / 4
    states = torch.randn(2, 4, 4, 16, 16, generator=gen)
    read_slot = torch.tensor([0, 3])
    got_states, want_states = states.clone(), states.clone()
    out = fused_recurrent_gated_delta_rule_triton(q, k, v, g, beta, got_states, read_slot, use_qk_l2norm)
    want = fused_recurrent_gated_delta_rule_reference(q.float(), k.float(), v.float(), g, beta, want_states,
                                                      read_slot, use_qk_l2norm)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_states, want_states, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("b", "t", "h", "hv", "kd", "vd", "initial"), [
    (1, 64, 1, 1, 16, 16, False), (2, 100, 2, 4, 16, 16, True), (1, 70, 1, 3, 32, 16, True), (1, 9, 2, 2, 8, 8, True),
])
def test_chunked_kernel_matches_the_reference(b, t, h, hv, kd, vd, initial):
    q, k, v, g, beta, gen = make_inputs(t + hv, b, t, h, hv, kd, vd)
    s0 = torch.randn(b, hv, kd, vd, generator=gen) if initial else None
    out, final = chunk_gated_delta_rule_triton(q, k, v, g, beta, s0)
    want, want_final = chunk_gated_delta_rule_reference(q, k, v, g, beta, s0)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, want_final, rtol=1e-4, atol=1e-4)


def test_chunked_kernel_with_bf16_inputs():
    q, k, v, g, beta, gen = make_inputs(11, 1, 80, 2, 4, 32, 32, dtype=torch.bfloat16)
    s0 = torch.randn(1, 4, 32, 32, generator=gen)
    out, final = chunk_gated_delta_rule_triton(q, k, v, g, beta, s0)
    want, want_final = chunk_gated_delta_rule_reference(q.float(), k.float(), v.float(), g, beta, s0)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert rel_err(out, want) < 2e-2
    assert rel_err(final, want_final) < 2e-2


def test_chunked_kernel_leaves_the_state_alone_over_padding():
    q, k, v, g, beta, gen = make_inputs(13, 2, 70, 1, 2, 16, 16)
    s0 = torch.randn(2, 2, 16, 16, generator=gen)
    g[1, 30:], beta[1, 30:] = 0.0, 0.0  # request 1 has 30 real tokens
    _, final = chunk_gated_delta_rule_triton(q, k, v, g, beta, s0)
    _, want_final = chunk_gated_delta_rule_reference(q[1:, :30], k[1:, :30], v[1:, :30], g[1:, :30],
                                                     beta[1:, :30], s0[1:])
    torch.testing.assert_close(final[1:], want_final, rtol=1e-4, atol=1e-4)


def test_recurrent_kernel_continues_from_the_chunked_state():
    """Prefill 40 tokens with the chunked kernel, verify 4 more with the recurrent one: the same as the
    reference over all 44 (one state orientation everywhere)."""
    q, k, v, g, beta, _ = make_inputs(17, 2, 44, 2, 4, 16, 16)
    want, _ = chunk_gated_delta_rule_reference(q, k, v, g, beta)
    _, state = chunk_gated_delta_rule_triton(q[:, :40], k[:, :40], v[:, :40], g[:, :40], beta[:, :40])
    slots = torch.zeros(2, 4, 4, 16, 16)
    slots[:, 2] = state
    out = fused_recurrent_gated_delta_rule_triton(q[:, 40:], k[:, 40:], v[:, 40:], g[:, 40:], beta[:, 40:], slots,
                                                  torch.tensor([2, 2]))
    torch.testing.assert_close(out, want[:, 40:], rtol=1e-4, atol=1e-4)
