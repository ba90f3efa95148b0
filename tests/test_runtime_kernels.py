"""The pure-PyTorch GDN and W8A8 kernels against naive references written here from the formulas
(QWEN35.md, CONTRACT.md): per-token loops over one head and one state S [K, V] at a time."""

from __future__ import annotations

import math

import pytest
import torch

from npuport.kernels.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from npuport.kernels.gated_delta_rule import (
    VerifyLog,
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    replay_pending,
)
from npuport.kernels.gdn_gating import fused_gdn_gating
from npuport.kernels.w8a8 import int8_matmul_rescale, quantize_per_token_int8
from npuport.runtime.linear import W8A8Linear

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

B, T, H, HV, K, V = 2, 11, 2, 4, 8, 8  # K == V: a transposed state is no shape error here


def naive_delta_rule(q, k, v, g, beta, s0):
    """Float64 loops: returns o [B, T, HV, V] and the state after every token, [B, T, HV, K, V]."""
    q, k, v, g, beta, s0 = (x.double() for x in (q, k, v, g, beta, s0))
    out = torch.zeros(B, T, HV, V, dtype=torch.float64)
    states = torch.zeros(B, T, HV, K, V, dtype=torch.float64)
    for b in range(B):
        for j in range(HV):
            s = s0[b, j].clone()
            for t in range(T):
                qt, kt = q[b, t, j // (HV // H)], k[b, t, j // (HV // H)]
                qt = qt / math.sqrt(float(qt @ qt) + 1e-6) / math.sqrt(K)
                kt = kt / math.sqrt(float(kt @ kt) + 1e-6)
                s = math.exp(g[b, t, j]) * s
                u = beta[b, t, j] * (v[b, t, j] - s.T @ kt)
                s = s + torch.outer(kt, u)
                out[b, t, j] = s.T @ qt
                states[b, t, j] = s
    return out, states


@pytest.fixture(scope="module")
def gdn_inputs():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = -3 * torch.rand(B, T, HV, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    s0 = torch.randn(B, HV, K, V, generator=gen)  # far from symmetric
    return [x.double() for x in (q, k, v, g, beta, s0)]


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_chunked_delta_rule_matches_the_recurrence(gdn_inputs, chunk_size):
    q, k, v, g, beta, s0 = gdn_inputs
    want, states = naive_delta_rule(q, k, v, g, beta, s0)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=chunk_size)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, states[:, -1], rtol=1e-10, atol=1e-10)


def test_verify_step_logs_the_state_after_each_token(gdn_inputs):
    """A verify step of 4 tokens leaves the state at its start; replaying the first a log entries gives the
    naive recurrence's state after token a - 1, for every a; a decode step stores the state after its last."""
    q, k, v, g, beta, s0 = gdn_inputs
    want, states = naive_delta_rule(q, k, v, g, beta, s0)
    state = s0.clone()
    log = VerifyLog.empty(B, 4, H, HV, K, V, torch.float64, torch.device("cpu"))
    out = fused_recurrent_gated_delta_rule(q[:, :4], k[:, :4], v[:, :4], g[:, :4], beta[:, :4], state, log)
    torch.testing.assert_close(out, want[:, :4], rtol=1e-10, atol=1e-10)
    assert torch.equal(state, s0)
    for a in range(1, 5):
        log.pending.fill_(a)
        log.side.fill_(1)  # the half the step wrote, as VerifyLog.keep leaves it
        torch.testing.assert_close(replay_pending(state, log), states[:, a - 1], rtol=1e-10, atol=1e-10)
    decoded = s0.clone()
    out = fused_recurrent_gated_delta_rule(q[:, :4], k[:, :4], v[:, :4], g[:, :4], beta[:, :4], decoded)
    torch.testing.assert_close(decoded, states[:, 3], rtol=1e-10, atol=1e-10)


def test_recurrent_step_continues_from_the_chunked_final_state(gdn_inputs):
    q, k, v, g, beta, s0 = gdn_inputs
    want, _ = naive_delta_rule(q, k, v, g, beta, s0)
    _, final = chunk_gated_delta_rule(q[:, :7], k[:, :7], v[:, :7], g[:, :7], beta[:, :7], s0, chunk_size=4)
    out = fused_recurrent_gated_delta_rule(q[:, 7:], k[:, 7:], v[:, 7:], g[:, 7:], beta[:, 7:], final)
    torch.testing.assert_close(out, want[:, 7:], rtol=1e-10, atol=1e-10)


def test_a_transposed_state_is_caught(gdn_inputs):
    q, k, v, g, beta, s0 = gdn_inputs
    want, _ = naive_delta_rule(q, k, v, g, beta, s0)
    out, _ = chunk_gated_delta_rule(q, k, v, g, beta, s0.transpose(-1, -2).contiguous())
    assert (out - want).abs().max() > 1e-2


def test_padding_tokens_with_zero_gate_and_beta_leave_the_state_unchanged(gdn_inputs):
    q, k, v, g, beta, s0 = gdn_inputs
    _, states = naive_delta_rule(q, k, v, g, beta, s0)
    g, beta = g.clone(), beta.clone()
    g[:, 5:], beta[:, 5:] = 0.0, 0.0
    _, final = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=4)
    torch.testing.assert_close(final, states[:, 4], rtol=1e-10, atol=1e-10)


def test_gdn_gating_formula():
    gen = torch.Generator().manual_seed(1)
    a_log, dt_bias = torch.randn(HV, generator=gen), torch.randn(HV, generator=gen)
    a, b = 10 * torch.randn(B, T, HV, generator=gen), torch.randn(B, T, HV, generator=gen)
    g, beta = fused_gdn_gating(a_log, a, dt_bias, b)
    x = (a + dt_bias).double()
    softplus = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    torch.testing.assert_close(g.double(), -torch.exp(a_log.double()) * softplus, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(beta.double(), 1 / (1 + torch.exp(-b.double())), rtol=1e-6, atol=1e-7)
    assert g.dtype == beta.dtype == torch.float32


def naive_conv(history, x, weight):
    """silu(sum_i w[d, i] * inputs[t + i]) over history [B, D, W-1] followed by x [B, T, D]."""
    full = torch.cat([history, x.transpose(1, 2)], dim=-1)
    w = weight.shape[1]
    acc = sum(weight[None, :, i, None] * full[:, :, i : i + x.shape[1]] for i in range(w))
    return (acc * torch.sigmoid(acc)).transpose(1, 2)


def test_conv_prefill_reads_the_window_and_keeps_the_last_inputs_of_each_row():
    gen = torch.Generator().manual_seed(2)
    d, w, length, t = 6, 4, 5, 7  # window of (W - 1) + 2 columns
    x = torch.randn(B, t, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(d, w, generator=gen, dtype=torch.float64)
    window = torch.randn(B, d, length, generator=gen, dtype=torch.float64)
    before = window.clone()
    n_valid = torch.tensor([7, 2])
    out = causal_conv1d_fn(x, weight, window, n_valid)
    for b in range(B):
        n = int(n_valid[b])
        want = naive_conv(before[b : b + 1, :, -(w - 1) :], x[b : b + 1, :n], weight)
        torch.testing.assert_close(out[b : b + 1, :n], want)
        inputs = torch.cat([before[b], x[b, :n].T], dim=-1)
        torch.testing.assert_close(window[b], inputs[:, -length:])


def test_conv_update_appends_first_in_first_out():
    gen = torch.Generator().manual_seed(3)
    d, w, length, t = 6, 4, 6, 3
    x = torch.randn(B, t, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(d, w, generator=gen, dtype=torch.float64)
    window = torch.randn(B, d, length, generator=gen, dtype=torch.float64)
    before = window.clone()
    out = causal_conv1d_update(x, weight, window)
    torch.testing.assert_close(out, naive_conv(before[..., -(w - 1) :], x, weight))
    torch.testing.assert_close(window, torch.cat([before, x.transpose(1, 2)], dim=-1)[..., -length:])


def test_per_token_quantization_rounds_half_to_even_and_handles_zero_rows():
    x = torch.tensor([[2.5, -127.0, 0.5, 1.5], [0.0, 0.0, 0.0, 0.0], [1.0, -0.3, 0.2, 0.0]])
    x_q, scale = quantize_per_token_int8(x)
    assert x_q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (3, 1)
    assert x_q[0].tolist() == [2, -127, 0, 2]
    assert x_q[1].tolist() == [0, 0, 0, 0] and scale[1, 0] > 0
    assert x_q[2].tolist() == [127, round(-0.3 * 127), round(0.2 * 127), 0]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_int8_matmul_equals_dequantize_then_matmul(out_dtype):
    gen = torch.Generator().manual_seed(4)
    m, n, k = 9, 12, 300
    x_q = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
    w_q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    x_s, w_s = torch.rand(m, 1, generator=gen) / 50, torch.rand(n, 1, generator=gen) / 50
    y = int8_matmul_rescale(x_q, x_s, w_q, w_s, out_dtype)
    want = (x_q.double() * x_s.double()) @ (w_q.double() * w_s.double()).T
    rtol = 1e-6 if out_dtype == torch.float32 else 1e-2
    assert y.dtype == out_dtype
    torch.testing.assert_close(y.double(), want, rtol=rtol, atol=1e-12)


def test_w8a8_linear_quantizes_tokens_then_matches_dequantized_matmul():
    gen = torch.Generator().manual_seed(5)
    layer = W8A8Linear(64, 16, torch.float32)
    layer.weight.copy_(torch.randint(-128, 128, (16, 64), generator=gen, dtype=torch.int8))
    layer.weight_scale.copy_(torch.rand(16, 1, generator=gen) / 100)
    x = torch.randn(3, 5, 64, generator=gen)
    y = layer(x)
    xf = x.reshape(-1, 64).double()
    s_x = xf.abs().amax(-1, keepdim=True) / 127
    x_dq = torch.round(xf / s_x) * s_x
    want = x_dq @ (layer.weight.double() * layer.weight_scale.double()).T
    torch.testing.assert_close(y.reshape(-1, 16).double(), want, rtol=1e-5, atol=1e-6)
