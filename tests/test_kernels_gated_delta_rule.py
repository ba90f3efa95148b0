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
    RecurrentConfig,
    VerifyLog,
    chunk_gated_delta_rule_reference,
    chunk_gated_delta_rule_triton,
    fused_recurrent_gated_delta_rule_reference,
    fused_recurrent_gated_delta_rule_triton,
    replay_pending,
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


def prefix(inputs, start, stop):
    """The tokens start..stop - 1 of q, k, v, g, beta."""
    return [x[:, start:stop] for x in inputs]


def new_log(b, slots, h, hv, kd, vd):
    return VerifyLog.empty(b, slots, h, hv, kd, vd, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize(("t", "h", "hv", "kd", "vd"), [
    (1, 2, 4, 16, 16), (1, 2, 6, 16, 32), (3, 1, 2, 32, 16), (5, 3, 3, 8, 8),
])
def test_decode_kernel_stores_the_state_after_the_last_token(t, h, hv, kd, vd):
    q, k, v, g, beta, gen = make_inputs(t * 7 + hv, 3, t, h, hv, kd, vd, strided=True)
    s0 = torch.randn(3, hv, kd, vd, generator=gen)
    got_state, want_state = s0.clone(), s0.clone()
    out = fused_recurrent_gated_delta_rule_triton(q, k, v, g, beta, got_state)
    want = fused_recurrent_gated_delta_rule_reference(q, k, v, g, beta, want_state)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)
    assert (want_state - s0).abs().max() > 1e-2


@pytest.mark.parametrize(("t", "h", "hv", "kd", "vd"), [(4, 2, 4, 16, 32), (3, 1, 3, 8, 16), (1, 2, 2, 16, 16)])
def test_verify_log_holds_the_state_after_every_token(t, h, hv, kd, vd):
    """A verify step leaves the state at its start; replaying its first a log entries gives the state that
    decoding tokens 0..a - 1 stores, for every a (value heads split over several programs: vd > 16)."""
    *inputs, gen = make_inputs(t + hv, 3, t, h, hv, kd, vd, strided=True)
    s0 = torch.randn(3, hv, kd, vd, generator=gen)
    state, log = s0.clone(), new_log(3, 4, h, hv, kd, vd)
    out = fused_recurrent_gated_delta_rule_triton(*inputs, state, log)
    assert torch.equal(state, s0)
    want_out = fused_recurrent_gated_delta_rule_reference(*inputs, s0.clone())
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    log.keep(torch.zeros(3, dtype=torch.long))
    for a in range(t + 1):
        log.pending.fill_(a)
        want = s0.clone()
        fused_recurrent_gated_delta_rule_reference(*prefix(inputs, 0, a), want)
        torch.testing.assert_close(replay_pending(state, log), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("gating", "config"), [(False, RecurrentConfig(16, 1, one_pass=True)),
                                               (True, RecurrentConfig(16, 1, one_pass=False)),
                                               (True, RecurrentConfig(32, 2))])
def test_verify_steps_commit_what_each_request_accepted(gating, config):
    """Three verify steps of 4 tokens; each request keeps a different prefix of every step. The outputs of
    each step, and the state at the end, are those of decoding only the kept tokens - the Triton kernel
    replays the pending entries itself, and records the next step's into the log's other half while other
    programs of the same key head still read the first."""
    b, h, hv, kd, vd, t = 3, 2, 4, 16, 32, 4
    *inputs, gen = make_inputs(11, b, 3 * t, h, hv, kd, vd)
    extra = {}
    if gating:
        inputs[3], inputs[4] = 8 * torch.randn(b, 3 * t, hv, generator=gen), torch.randn(b, 3 * t, hv, generator=gen)
        extra = {"A_log": torch.randn(hv, generator=gen), "dt_bias": torch.randn(hv, generator=gen)}
    kept = torch.tensor([[2, 4, 0], [1, 1, 3], [4, 2, 1]])  # [step, request]
    s0 = torch.randn(b, hv, kd, vd, generator=gen)
    state, log = s0.clone(), new_log(b, t, h, hv, kd, vd)
    for step in range(3):
        out = fused_recurrent_gated_delta_rule_triton(*prefix(inputs, step * t, step * t + t), state, log, **extra,
                                                      config=config)
        log.keep(kept[step])
        for r in range(b):
            # request r's tokens so far: the kept ones of earlier steps, then this step's
            tokens = [i * t + j for i in range(step) for j in range(int(kept[i, r]))]
            tokens += range(step * t, step * t + t)
            want = fused_recurrent_gated_delta_rule_reference(*(x[r : r + 1, tokens] for x in inputs),
                                                              s0[r : r + 1].clone(), **extra)
            torch.testing.assert_close(out[r], want[0, -t:], rtol=1e-4, atol=1e-4)
    for r in range(b):
        tokens = [i * t + j for i in range(3) for j in range(int(kept[i, r]))]
        want = s0[r : r + 1].clone()
        fused_recurrent_gated_delta_rule_reference(*(x[r : r + 1, tokens] for x in inputs), want, **extra)
        torch.testing.assert_close(replay_pending(state, log)[r : r + 1], want, rtol=1e-4, atol=1e-4)


def test_verify_steps_on_a_view_of_a_larger_log_keep_its_other_requests_and_the_bits_of_their_own_log():
    """Requests 1..2 of a log of 5 (a continuous batch's decode slots as a view of its pool, runtime/slots.py):
    two verify steps through the view give the bits two steps of a log of their own give, and requests 0, 3, 4 of
    the larger log are not touched."""
    b, h, hv, kd, vd, t = 2, 2, 4, 16, 32, 3
    *inputs, gen = make_inputs(5, b, 2 * t, h, hv, kd, vd)
    s0 = torch.randn(b, hv, kd, vd, generator=gen)
    pool = new_log(5, t, h, hv, kd, vd)
    for x in (pool.keys, pool.log_decay, pool.writes):
        x.copy_(torch.randn(x.shape, generator=gen))
    before = pool.clone()
    view = VerifyLog(pool.keys[:, 1:3], pool.log_decay[:, 1:3], pool.writes[:, 1:3], pool.side, pool.pending[1:3])
    own = new_log(b, t, h, hv, kd, vd)
    states = [s0.clone(), s0.clone()]
    for step in range(2):
        outs = [fused_recurrent_gated_delta_rule_triton(*prefix(inputs, step * t, step * t + t), state, log)
                for state, log in zip(states, (view, own), strict=True)]
        assert torch.equal(outs[0], outs[1])
        for log in (view, own):
            log.keep(torch.tensor([2, 1]))
    assert torch.equal(replay_pending(states[0], view), replay_pending(states[1], own))
    for name in ("keys", "log_decay", "writes"):
        for r in (0, 3, 4):
            assert torch.equal(getattr(pool, name)[:, r], getattr(before, name)[:, r]), name
    scattered = torch.zeros(2, t, b, h, kd).transpose(1, 2)  # [2, B, S, H, K], each request's slots apart
    with pytest.raises(ValueError, match="contiguously"):
        fused_recurrent_gated_delta_rule_triton(*prefix(inputs, 0, t), states[0],
                                                VerifyLog(scattered, own.log_decay, own.writes, own.side, own.pending))


def test_the_reference_keeps_the_same_log_as_the_kernel():
    """The runtime runs the reference on CPU and the kernel elsewhere: one log format for both."""
    *inputs, gen = make_inputs(4, 2, 3, 2, 4, 16, 16)
    s0 = torch.randn(2, 4, 16, 16, generator=gen)
    logs = [new_log(2, 4, 2, 4, 16, 16) for _ in range(2)]
    states = [s0.clone(), s0.clone()]
    fused_recurrent_gated_delta_rule_triton(*inputs, states[0], logs[0])
    fused_recurrent_gated_delta_rule_reference(*inputs, states[1], logs[1])
    for name in ("keys", "log_decay", "writes"):
        torch.testing.assert_close(getattr(logs[0], name), getattr(logs[1], name), rtol=1e-5, atol=1e-5, msg=name)
    with pytest.raises(ValueError, match="5 tokens needs 5 log slots"):
        fused_recurrent_gated_delta_rule_triton(*make_inputs(4, 2, 5, 2, 4, 16, 16)[:5], states[0], logs[0])


def test_a_step_of_no_tokens_is_refused():
    """The kernel loads each token's inputs one token ahead; with no token there is nothing to load."""
    inputs = make_inputs(5, 2, 0, 2, 4, 16, 16)[:5]
    with pytest.raises(ValueError, match="at least one token"):
        fused_recurrent_gated_delta_rule_triton(*inputs, torch.zeros(2, 4, 16, 16))


def test_recurrent_kernel_fuses_the_gating():
    q, k, v, _, _, gen = make_inputs(3, 2, 4, 2, 4, 16, 16)
    a, b = 8 * torch.randn(2, 4, 4, generator=gen), torch.randn(2, 4, 4, generator=gen)
    a_log, dt_bias = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    s0 = torch.randn(2, 4, 16, 16, generator=gen)
    got_state, want_state = s0.clone(), s0.clone()
    out = fused_recurrent_gated_delta_rule_triton(q, k, v, a, b, got_state, A_log=a_log, dt_bias=dt_bias)
    want = fused_recurrent_gated_delta_rule_reference(q, k, v, a, b, want_state, A_log=a_log, dt_bias=dt_bias)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_recurrent_kernel_with_bf16_inputs(use_qk_l2norm):
    q, k, v, g, beta, gen = make_inputs(5, 2, 3, 2, 4, 16, 16, dtype=torch.bfloat16)
    if not use_qk_l2norm:
        q, k = q / 4, k / 4
    s0 = torch.randn(2, 4, 16, 16, generator=gen)
    got_state, want_state = s0.clone(), s0.clone()
    out = fused_recurrent_gated_delta_rule_triton(q, k, v, g, beta, got_state, use_qk_l2norm=use_qk_l2norm)
    want = fused_recurrent_gated_delta_rule_reference(q.float(), k.float(), v.float(), g, beta, want_state,
                                                      use_qk_l2norm=use_qk_l2norm)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)


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
    out = fused_recurrent_gated_delta_rule_triton(q[:, 40:], k[:, 40:], v[:, 40:], g[:, 40:], beta[:, 40:], state,
                                                  new_log(2, 4, 2, 4, 16, 16))
    torch.testing.assert_close(out, want[:, 40:], rtol=1e-4, atol=1e-4)
