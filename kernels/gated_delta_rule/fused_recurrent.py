"""The recurrent gated delta rule for decode and speculative verify: one Triton kernel that updates each
request's state in place (or, in verify, records each token's update in a VerifyLog), and its dispatcher."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from npuport.kernels.gated_delta_rule.naive import fused_recurrent_gated_delta_rule_reference
from npuport.kernels.gated_delta_rule.verify_log import VerifyLog, check_log_room, log_storage_rows
from npuport.kernels.gdn_gating import softplus
from npuport.kernels.implementations import NATIVE, TRITON, runnable
from npuport.kernels.launch import jit, launch, launch_options, next_power_of_2, persistent_grid, tl, use_triton
from npuport.kernels.npu import gdn as native


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    log: VerifyLog | None = None,
    use_qk_l2norm: bool = True,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    plan_tokens: int | None = None,
) -> torch.Tensor:
    """Decode / verify of T tokens over state [B, HV, K, V] fp32, updated in place. Returns o [B, T, HV, V].

    Without a log (decode) the state after the last token is stored. With one (verify, T <= log.slots) the
    pending entries of the previous step are replayed into the state first, which is stored, and the T
    tokens' updates are recorded in the log instead (VerifyLog). With A_log and dt_bias [HV] given, g and
    beta are the raw in_proj_a / in_proj_b outputs [B, T, HV] and the gating (gdn_gating.fused_gdn_gating)
    is computed inside. plan_tokens: launch as for steps of that many tokens, whatever T is (batch-invariant
    steps: a decode step then sums each state column in a verify step's order); default T."""
    # A batch-invariant step (plan_tokens) does not take the native operator: its documentation does not promise a
    # state column summed in one order whatever the step's size.
    refusal = None if plan_tokens is not None else lambda: native.gdn_recurrent_refusal(q, v, log is not None)
    chosen = runnable("gdn_recurrent", q.device, refusal, use_triton(q, k, v))
    if chosen == NATIVE:
        return native.gdn_recurrent_native(q, k, v, g, beta, state, use_qk_l2norm, A_log, dt_bias)
    if chosen == TRITON:
        return fused_recurrent_gated_delta_rule_triton(q, k, v, g, beta, state, log, use_qk_l2norm, A_log, dt_bias,
                                                       plan_tokens=plan_tokens)
    return fused_recurrent_gated_delta_rule_reference(q, k, v, g, beta, state, log, use_qk_l2norm, A_log, dt_bias)


# ---------------------------------------------------------------------------------------------------------
# Triton. One program owns the state tile S[:, v0:v0+BV] of one (request, value head) - keys along rows,
# values along columns, as in the references - and never shares it, so reading and writing it in place needs
# no synchronisation; the log entries that programs share (keys, decays) are read from one half of the log
# and written to the other.




@jit
def _token_inputs(q_at, k_at, v_at, g_at, beta_at, t, T, sq_t, sk_t, sv_t, sg_t, keys, key_ok, vals, val_ok):
    """Token t's q [BK], k [BK], v [BV], g and beta of one (request, head, value block), as stored; *_at point at
    the request's and head's token 0. Past the last token (t >= T, a prefetch with nothing left) the last
    token's again, so no load needs a scalar mask."""
    t = tl.minimum(t, T - 1)
    q_t = tl.load(q_at + t * sq_t + keys, mask=key_ok, other=0.0)
    k_t = tl.load(k_at + t * sk_t + keys, mask=key_ok, other=0.0)
    v_t = tl.load(v_at + t * sv_t + vals, mask=val_ok, other=0.0)
    return q_t, k_t, v_t, tl.load(g_at + t * sg_t), tl.load(beta_at + t * sg_t)


# NPU budget (per program): S [BK, BV] fp32 = 128 x 16 x 4 B = 8 KiB (16 KiB at BV = 32), plus two products of
# the same size and vectors (the next token's inputs loaded ahead among them, q, k [BK] and v [BV] bf16: under
# 1 KiB): under 48 KiB, below the ~70 KiB that multi-buffering leaves.
@jit
def _recurrent_kernel(q, k, v, g, beta, A_log, dt_bias, state, log_keys, log_decay, log_writes, log_side, pending,
                      out, B, LOG_ROWS, T, H, HV, GROUP, n_tasks, scale, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t,
                      sv_h,
                      sg_b, sg_t, so_b, so_t, so_h, S: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, GATING: tl.constexpr,
                      LOG: tl.constexpr, ONE_PASS: tl.constexpr):
    # state [B, HV, K, V] and the log's keys [2, B, S, H, K], log_decay [2, B, S, HV], writes [2, B, S, HV, V]
    # are contiguous, each half of the log in rows of a storage of LOG_ROWS requests (B, or more where the log is
    # a view of some requests of a larger one); entry (half, b, t) starts at row (half * LOG_ROWS + b) * S + t.
    n_v = (V + BV - 1) // BV
    keys = tl.arange(0, BK)
    key_ok = keys < K
    for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        head = (task // n_v) % HV
        b = tl.cast(task // n_v // HV, tl.int64)
        key_head = head // GROUP
        vals = task % n_v * BV + tl.arange(0, BV)
        val_ok = vals < V
        tile = keys[:, None] * V + vals[None, :]
        tile_ok = key_ok[:, None] & val_ok[None, :]
        q_at = q + b * sq_b + key_head * sq_h
        k_at = k + b * sk_b + key_head * sk_h
        v_at = v + b * sv_b + head * sv_h
        g_at = g + b * sg_b + head
        beta_at = beta + b * sg_b + head
        # the first token's inputs load while the state and the log entries do
        q_n, k_n, v_n, g_n, beta_n = _token_inputs(q_at, k_at, v_at, g_at, beta_at, 0, T, sq_t, sk_t, sv_t, sg_t,
                                                   keys, key_ok, vals, val_ok)
        state_at = state + (b * HV + head) * K * V + tile
        s = tl.load(state_at, mask=tile_ok, other=0.0)
        if LOG:
            side = tl.load(log_side).to(tl.int64)
            read_row = (side * LOG_ROWS + b) * S
            write_row = ((1 - side) * LOG_ROWS + b) * S
            n_pending = tl.load(pending + b)
            # Replay the accepted tokens of the last step, unrolled over all S slots so that every entry's
            # loads are issued at once; the entries past n_pending (an older step's values) are dropped.
            for j in tl.static_range(S):
                row = read_row + j
                kept = j < n_pending
                k_j = tl.load(log_keys + (row * H + key_head) * K + keys, mask=key_ok, other=0.0)
                u_j = tl.load(log_writes + (row * HV + head) * V + vals, mask=val_ok, other=0.0)
                decay_j = tl.exp(tl.load(log_decay + row * HV + head))
                # x 1 and + 0 past the kept entries: exactly s. The update is the decode step's below, the same
                # explicit fma, and the kernel is compiled without contraction (launch_options' contract): left to
                # the compiler, a decode step's and a verify step's specialisations rounded differently, and the
                # state a verify step kept differed in its last bits from the one decode steps left (H200, bf16
                # inputs, the sequential products)
                s = tl.fma(tl.where(kept, k_j, 0.0)[:, None], tl.where(kept, u_j, 0.0)[None, :],
                           s * tl.where(kept, decay_j, 1.0))
            if n_pending > 0:
                tl.store(state_at, s, mask=tile_ok)
        if GATING:
            neg_rate = -tl.exp(tl.load(A_log + head).to(tl.float32))
            bias = tl.load(dt_bias + head).to(tl.float32)
        for t in range(T):
            # This token's inputs were loaded one token ahead: issue the next token's now, so that their latency
            # overlaps this token's work instead of adding to every token's.
            q_t, k_t, v_t, g_t, beta_t = q_n, k_n, v_n, g_n, beta_n
            q_n, k_n, v_n, g_n, beta_n = _token_inputs(q_at, k_at, v_at, g_at, beta_at, t + 1, T, sq_t, sk_t, sv_t,
                                                       sg_t, keys, key_ok, vals, val_ok)
            q_t, k_t, v_t = q_t.to(tl.float32), k_t.to(tl.float32), v_t.to(tl.float32)
            g_t, beta_t = g_t.to(tl.float32), beta_t.to(tl.float32)
            if L2NORM:
                q_t = q_t * tl.rsqrt(tl.sum(q_t * q_t, 0) + 1e-6)
                k_t = k_t * tl.rsqrt(tl.sum(k_t * k_t, 0) + 1e-6)
            q_t = q_t * scale
            if GATING:
                g_t = neg_rate * softplus(g_t + bias)
                beta_t = 1.0 / (1.0 + tl.exp(-beta_t))
            decay = tl.exp(g_t)
            if ONE_PASS:
                # Both products from the previous state at once, one reduction deep per token instead of two:
                # S'^T k = a S^T k and S_t^T q = a S^T q + (k . q) u, with a = exp(g_t), S' = a S.
                s_k = tl.sum(s * k_t[:, None], 0)
                s_q = tl.sum(s * q_t[:, None], 0)
                u = beta_t * (v_t - decay * s_k)
                o_t = decay * s_q + tl.sum(k_t * q_t, 0) * u
                s = tl.fma(k_t[:, None], u[None, :], s * decay)  # the replay's update above, bit for bit
            else:
                s = s * decay
                u = beta_t * (v_t - tl.sum(s * k_t[:, None], 0))
                s = tl.fma(k_t[:, None], u[None, :], s)  # the replay's update above, bit for bit
                o_t = tl.sum(s * q_t[:, None], 0)
            tl.store(out + b * so_b + t * so_t + head * so_h + vals, o_t.to(out.dtype.element_ty), mask=val_ok)
            if LOG:
                row = write_row + t
                tl.store(log_writes + (row * HV + head) * V + vals, u, mask=val_ok)
                if task % n_v == 0:  # one program per (request, value head) records the shared entries
                    tl.store(log_decay + row * HV + head, g_t)
                    if head % GROUP == 0:
                        tl.store(log_keys + (row * H + key_head) * K + keys, k_t, mask=key_ok)
        if not LOG:
            tl.store(state_at, s, mask=tile_ok)


@dataclass(frozen=True)
class RecurrentConfig:
    """Launch choices of the recurrent kernel: the value block of a program, its warps and stages, and whether
    a token's two products come from the previous state in one pass (a shorter dependency chain per token, more
    live registers) or one after the other."""

    bv: int
    num_warps: int
    num_stages: int = 1
    one_pass: bool = True


def recurrent_config(pairs: int, tokens: int) -> RecurrentConfig:
    """Measured on an H200 (bench/RESULTS.md): one warp on a [K, 16] slice of a state is fastest for verify
    steps and for fewer than 1024 (request, head) pairs, plain decode of more streams states better in [K, 32];
    one pass per token wins for few pairs, where latency rules, and loses to the sequential products from
    192 pairs on, where its extra registers cost programs in flight."""
    if tokens == 1 and pairs >= 1024:
        return RecurrentConfig(32, 2)
    return RecurrentConfig(16, 1, one_pass=pairs < 192)


def fused_recurrent_gated_delta_rule_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    log: VerifyLog | None = None,
    use_qk_l2norm: bool = True,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    config: RecurrentConfig | None = None,
    plan_tokens: int | None = None,
) -> torch.Tensor:
    """The Triton kernel behind fused_recurrent_gated_delta_rule (any device; CPU tensors run in Triton's
    interpreter). config: the launch choices (default: recurrent_config's for this step, or with plan_tokens for a
    step of that many tokens)."""
    b, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    if t < 1:
        raise ValueError(f"a recurrent step needs at least one token, got q of shape {tuple(q.shape)}")
    if state.dtype != torch.float32 or not state.is_contiguous() or state.shape != (b, hv, kd, vd):
        raise ValueError(f"the recurrent state must be a contiguous fp32 [{b}, {hv}, {kd}, {vd}] tensor, got "
                         f"{state.dtype} {tuple(state.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k, v need a contiguous last dimension")
    slots, log_rows = 1, b
    if log is not None:
        check_log_room(log, t)
        slots = log.slots
        if log.keys.shape[1:] != (b, slots, h, kd) or log.writes.shape[1:] != (b, slots, hv, vd) or not all(
                x.dtype == torch.float32 for x in (log.keys, log.log_decay, log.writes)):
            raise ValueError("the verify log does not match the inputs (VerifyLog.empty makes one)")
        log_rows = log_storage_rows(log)
    if g.stride() != beta.stride() or g.stride(-1) != 1:  # the kernel reads both with g's strides
        g, beta = g.contiguous(), beta.contiguous()
    out = torch.empty(b, t, hv, vd, dtype=v.dtype, device=v.device)
    cfg = config or recurrent_config(b * hv, plan_tokens or t)
    bv = min(cfg.bv, next_power_of_2(vd))
    n_tasks = b * hv * -(-vd // bv)
    entries = (None,) * 5 if log is None else (log.keys, log.log_decay, log.writes, log.side, log.pending)
    launch(_recurrent_kernel, persistent_grid(v.device, n_tasks), q, k, v, g, beta, A_log, dt_bias, state, *entries,
           out, b, log_rows, t, h, hv, hv // h, n_tasks, kd**-0.5, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
           k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), out.stride(0),
           out.stride(1), out.stride(2), S=slots, K=kd, V=vd, BK=max(16, next_power_of_2(kd)), BV=bv,
           L2NORM=use_qk_l2norm, GATING=A_log is not None, LOG=log is not None, ONE_PASS=cfg.one_pass,
           **launch_options(v.device, num_warps=cfg.num_warps, num_stages=cfg.num_stages, contract=False))
    return out
