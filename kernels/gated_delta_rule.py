"""The gated delta rule of a GatedDeltaNet layer: chunked prefill and a recurrent step for decode and for
speculative verify, which keeps every token's state update so that any accepted prefix can be committed.

Shapes: q, k [B, T, H, K]; v [B, T, HV, V]; g (log decay), beta [B, T, HV]; value head j reads key head
j // (HV // H). The recurrent state of one value head is S [K, V] (keys along rows, values along columns),
so a batch of states is [B, HV, K, V], always in fp32 (float64 for float64 inputs) - the one orientation
used everywhere: prefill, chunked prefill, verify and commit. Per token, with q, k l2-normalized and
q scaled by K^-0.5:

    S = exp(g_t) * S;  u = beta_t * (v_t - S^T k_t);  S = S + k_t u^T;  o_t = S^T q_t

so the state after token t is S_t = exp(g_t) S_{t-1} + k_t u_t^T: k_t, g_t and u_t (K + 1 + V numbers) hold it
as well as the K x V of S_t itself. A verify step records them per token (VerifyLog) and leaves the state at
the step's start; the next step first replays the entries its request accepted - the same operations on the
same fp32 values, so the same state as if it had been kept - and goes on from there. The state is read and
written once per step, as in a plain decode step, however many tokens were verified.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from npuport.kernels.gdn_gating import fused_gdn_gating_reference, softplus, state_dtype
from npuport.kernels.launch import (
    jit,
    launch,
    launch_options,
    next_power_of_2,
    persistent_grid,
    tl,
    use_triton,
)
from npuport.runtime.devices import multiprocessor_count

L2NORM_EPS = 1e-6


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill. Returns o [B, T, HV, V] (v's dtype) and the state after the last token, final_state
    [B, HV, K, V] fp32. initial_state [B, HV, K, V] (zeros when None). A token with g = 0 and beta = 0
    leaves the state unchanged, which is how padding is masked."""
    if use_triton(q, k, v):
        return chunk_gated_delta_rule_triton(q, k, v, g, beta, initial_state, use_qk_l2norm, chunk_size)
    return chunk_gated_delta_rule_reference(q, k, v, g, beta, initial_state, use_qk_l2norm, chunk_size)


@dataclass
class VerifyLog:
    """The per-token state updates of the last verify step, for up to S tokens per request (QWEN35.md: "the
    state after each of the k + 1 tokens"): the state after token t is
    S_t = exp(log_decay_t) S_{t-1} + keys_t writes_t^T, from the state the step started at.

    keys [2, B, S, H, K] (unit-norm), log_decay [2, B, S, HV], writes [2, B, S, HV, V], all fp32 (float64 for
    float64 states). Two halves: a step reads the entries of half `side` [1] (long) and writes its own into
    the other, so no kernel program overwrites an entry that another has still to read; `keep` flips it.
    pending [B] (long): how many of the recorded entries request b keeps; the next step replays those first.
    """

    keys: torch.Tensor
    log_decay: torch.Tensor
    writes: torch.Tensor
    side: torch.Tensor
    pending: torch.Tensor

    @classmethod
    def empty(cls, batch: int, slots: int, key_heads: int, value_heads: int, k_dim: int, v_dim: int,
              dtype: torch.dtype, device: torch.device) -> VerifyLog:
        def zeros(*shape):
            return torch.zeros(2, batch, slots, *shape, dtype=dtype, device=device)

        return cls(zeros(key_heads, k_dim), zeros(value_heads), zeros(value_heads, v_dim),
                   torch.zeros(1, dtype=torch.long, device=device), torch.zeros(batch, dtype=torch.long, device=device))

    @property
    def slots(self) -> int:
        return self.keys.shape[2]

    def keep(self, n: torch.Tensor) -> None:
        """After a verify step: request b keeps its first n[b] tokens (0..S); their entries become pending."""
        self.pending.copy_(n)
        self.side.bitwise_xor_(1)

    def clear(self) -> None:
        """Nothing pending: the state already is the committed one (after a prefill)."""
        self.pending.zero_()

    def clone(self) -> VerifyLog:
        return VerifyLog(*(getattr(self, f.name).clone() for f in fields(self)))


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
) -> torch.Tensor:
    """Decode / verify of T tokens over state [B, HV, K, V] fp32, updated in place. Returns o [B, T, HV, V].

    Without a log (decode) the state after the last token is stored. With one (verify, T <= log.slots) the
    pending entries of the previous step are replayed into the state first, which is stored, and the T
    tokens' updates are recorded in the log instead (VerifyLog). With A_log and dt_bias [HV] given, g and
    beta are the raw in_proj_a / in_proj_b outputs [B, T, HV] and the gating (gdn_gating.fused_gdn_gating)
    is computed inside."""
    if use_triton(q, k, v):
        return fused_recurrent_gated_delta_rule_triton(q, k, v, g, beta, state, log, use_qk_l2norm, A_log, dt_bias)
    return fused_recurrent_gated_delta_rule_reference(q, k, v, g, beta, state, log, use_qk_l2norm, A_log, dt_bias)


def replay_pending(state: torch.Tensor, log: VerifyLog) -> torch.Tensor:
    """state [B, HV, K, V] with each request's pending log entries applied (a new tensor): the committed
    state when a verify step's tokens were kept."""
    side = int(log.side)
    group = log.writes.shape[3] // log.keys.shape[3]
    out = state.clone()
    for j in range(int(log.pending.max()) if log.pending.numel() else 0):
        keys = log.keys[side, :, j].repeat_interleave(group, dim=1)  # [B, HV, K]
        stepped = out * log.log_decay[side, :, j].exp()[..., None, None]
        stepped = stepped + keys[..., :, None] * log.writes[side, :, j, :, None, :]
        out = torch.where((log.pending > j)[:, None, None, None], stepped, out)
    return out


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _prepare(q, k, v, g, beta, use_qk_l2norm):
    """To the state dtype, keys shared across value heads, heads before time: q, k [B, HV, T, K],
    v [B, HV, T, V], g, beta [B, HV, T]."""
    acc = state_dtype(v.dtype)
    group = v.shape[2] // k.shape[2]
    q, k = (x.to(acc).repeat_interleave(group, dim=2) for x in (q, k))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    return [x.transpose(1, 2) for x in (q, k, v.to(acc), g.to(acc), beta.to(acc))]


def chunk_gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Within a chunk, with G_t the cumulative log decay from the chunk start and D[t, s] = exp(G_t - G_s)
    # for s <= t, the writes u solve the unit lower-triangular system
    #     u_t + beta_t * sum_{s<t} D[t, s] (k_t . k_s) u_s = beta_t * (v_t - exp(G_t) S0^T k_t),
    # then o_t = exp(G_t) S0^T q_t + sum_{s<=t} D[t, s] (q_t . k_s) u_s, and the chunk's final state is
    # exp(G_last) S0 + sum_s exp(G_last - G_s) k_s u_s^T.
    qh, kh, vh, gh, bh = _prepare(q, k, v, g, beta, use_qk_l2norm)
    b, hv, t_total, kd = kh.shape
    vd = vh.shape[-1]
    state = torch.zeros(b, hv, kd, vd, dtype=vh.dtype, device=vh.device)
    if initial_state is not None:
        state = state + initial_state.to(vh.dtype)
    out = torch.empty_like(vh)
    for s in range(0, t_total, chunk_size):
        qc, kc, vc = (x[:, :, s : s + chunk_size] for x in (qh, kh, vh))
        gc, bc = gh[:, :, s : s + chunk_size], bh[:, :, s : s + chunk_size]
        c = kc.shape[2]
        cum = gc.cumsum(-1)  # [B, HV, c]
        causal = torch.ones(c, c, dtype=torch.bool, device=kc.device).tril()
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # D [c, c]
        system = (bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        system = system + torch.eye(c, dtype=system.dtype, device=system.device)
        rhs = bc[..., None] * (vc - cum.exp()[..., None] * (kc @ state))
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [B, HV, c, V]
        out[:, :, s : s + chunk_size] = cum.exp()[..., None] * (qc @ state) + ((qc @ kc.transpose(-1, -2)) * decay) @ u
        to_end = (cum[..., -1:] - cum).exp()[..., None]  # [B, HV, c, 1]
        state = cum[..., -1].exp()[..., None, None] * state + (kc * to_end).transpose(-1, -2) @ u
    return out.transpose(1, 2).to(v.dtype), state


def fused_recurrent_gated_delta_rule_reference(
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
) -> torch.Tensor:
    if A_log is not None:
        g, beta = fused_gdn_gating_reference(A_log, g, dt_bias, beta)
    qh, kh, vh, gh, bh = _prepare(q, k, v, g, beta, use_qk_l2norm)
    tokens = vh.shape[2]
    if log is not None:
        _check_log_room(log, tokens)
        state.copy_(replay_pending(state, log))
        write = 1 - int(log.side)
        log.keys[write, :, :tokens] = kh[:, :: v.shape[2] // k.shape[2]].transpose(1, 2)
        log.log_decay[write, :, :tokens] = gh.transpose(1, 2)
    s = state.to(vh.dtype, copy=True)  # [B, HV, K, V]
    out = torch.empty_like(vh)
    for t in range(tokens):
        s = s * gh[:, :, t].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", s, kh[:, :, t])
        u = bh[:, :, t, None] * (vh[:, :, t] - predicted)
        s = s + kh[:, :, t, :, None] * u[:, :, None, :]
        out[:, :, t] = torch.einsum("bhkv,bhk->bhv", s, qh[:, :, t])
        if log is not None:
            log.writes[write, :, t] = u
    if log is None:
        state.copy_(s)
    return out.transpose(1, 2).to(v.dtype)


def _check_log_room(log: VerifyLog, tokens: int) -> None:
    if tokens > log.slots:
        raise ValueError(f"a verify step of {tokens} tokens needs {tokens} log slots, the log has {log.slots}")


# ---------------------------------------------------------------------------------------------------------
# Triton. One program owns the state tile S[:, v0:v0+BV] of one (request, value head) - keys along rows,
# values along columns, as in the references - and never shares it, so reading and writing it in place needs
# no synchronisation; the log entries that programs share (keys, decays) are read from one half of the log
# and written to the other.


@jit
def _unit_rows(x, L2NORM: tl.constexpr):
    """x [rows, K] fp32 with each row scaled to unit length (when L2NORM), as l2norm above."""
    if L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
    return x


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
                      out, B, T, H, HV, GROUP, n_tasks, scale, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                      sg_b, sg_t, so_b, so_t, so_h, S: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, GATING: tl.constexpr,
                      LOG: tl.constexpr, ONE_PASS: tl.constexpr):
    # state [B, HV, K, V] and the log's keys [2, B, S, H, K], log_decay [2, B, S, HV], writes [2, B, S, HV, V]
    # are contiguous; entry (half, b, t) of the log starts at row (half * B + b) * S + t.
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
            read_row = (side * B + b) * S
            write_row = ((1 - side) * B + b) * S
            n_pending = tl.load(pending + b)
            # Replay the accepted tokens of the last step, unrolled over all S slots so that every entry's
            # loads are issued at once; the entries past n_pending (an older step's values) are dropped.
            for j in tl.static_range(S):
                row = read_row + j
                kept = j < n_pending
                k_j = tl.load(log_keys + (row * H + key_head) * K + keys, mask=key_ok, other=0.0)
                u_j = tl.load(log_writes + (row * HV + head) * V + vals, mask=val_ok, other=0.0)
                decay_j = tl.exp(tl.load(log_decay + row * HV + head))
                s = s * tl.where(kept, decay_j, 1.0)  # x 1 and + 0 past the kept entries: exactly s
                s = s + tl.where(kept, k_j, 0.0)[:, None] * tl.where(kept, u_j, 0.0)[None, :]
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
                s = s * decay  # the same two steps as the replay above: the same state, bit for bit
                s = s + k_t[:, None] * u[None, :]
            else:
                s = s * decay
                u = beta_t * (v_t - tl.sum(s * k_t[:, None], 0))
                s = s + k_t[:, None] * u[None, :]
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
) -> torch.Tensor:
    """The Triton kernel behind fused_recurrent_gated_delta_rule (any device; CPU tensors run in Triton's
    interpreter)."""
    b, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    if t < 1:
        raise ValueError(f"a recurrent step needs at least one token, got q of shape {tuple(q.shape)}")
    if state.dtype != torch.float32 or not state.is_contiguous() or state.shape != (b, hv, kd, vd):
        raise ValueError(f"the recurrent state must be a contiguous fp32 [{b}, {hv}, {kd}, {vd}] tensor, got "
                         f"{state.dtype} {tuple(state.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k, v need a contiguous last dimension")
    slots = 1
    if log is not None:
        _check_log_room(log, t)
        slots = log.slots
        if log.keys.shape[1:] != (b, slots, h, kd) or log.writes.shape[1:] != (b, slots, hv, vd) or not all(
                x.is_contiguous() and x.dtype == torch.float32 for x in (log.keys, log.log_decay, log.writes)):
            raise ValueError("the verify log does not match the inputs (VerifyLog.empty makes one)")
    g, beta = g.contiguous(), beta.contiguous()
    out = torch.empty(b, t, hv, vd, dtype=v.dtype, device=v.device)
    cfg = config or recurrent_config(b * hv, t)
    bv = min(cfg.bv, next_power_of_2(vd))
    n_tasks = b * hv * -(-vd // bv)
    entries = (None,) * 5 if log is None else (log.keys, log.log_decay, log.writes, log.side, log.pending)
    launch(_recurrent_kernel, persistent_grid(v.device, n_tasks), q, k, v, g, beta, A_log, dt_bias, state, *entries,
           out, b, t, h, hv, hv // h, n_tasks, kd**-0.5, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
           k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), out.stride(0),
           out.stride(1), out.stride(2), S=slots, K=kd, V=vd, BK=max(16, next_power_of_2(kd)), BV=bv,
           L2NORM=use_qk_l2norm, GATING=A_log is not None, LOG=log is not None, ONE_PASS=cfg.one_pass,
           **launch_options(v.device, num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return out


# Chunked prefill, in two kernels. With G the cumulative log decay inside a chunk of BT tokens and
# A[t, s] = beta_t (k_t . k_s) exp(G_t - G_s) for s < t, the chunk's writes are u = U - W S0, where
#     U = (I + A)^-1 diag(beta) V,   W = (I + A)^-1 diag(beta exp(G)) K
# do not depend on the state; nor does P[t, s] = (q_t . k_s) exp(G_t - G_s) for s <= t. The first kernel
# computes U, W, P (and the unit-norm q, k) for all chunks at once. The second walks the chunks of each
# (request, value head, value block) in order, carrying S:
#     v_new = U - W S;  o = exp(G) (Q S) + P v_new;  S = exp(G_last) S + (K * exp(G_last - G))^T v_new.


@jit
def _block16(k, g, beta, b, head, key_head, rows, T, sk_b, sk_t, sk_h, sg_b, sg_t, g_before,
             K: tl.constexpr, BK: tl.constexpr, L2NORM: tl.constexpr):
    """16 tokens of a chunk: unit-norm keys [16, BK] (k's dtype), cumulative log decay [16] continuing from
    g_before, beta [16], and the decay summed to the block's end."""
    ok = rows < T
    keys = tl.arange(0, BK)
    gates = tl.load(g + b * sg_b + rows.to(tl.int64) * sg_t + head, mask=ok, other=0.0).to(tl.float32)
    cum = tl.cumsum(gates, 0) + g_before
    beta_b = tl.load(beta + b * sg_b + rows.to(tl.int64) * sg_t + head, mask=ok, other=0.0).to(tl.float32)
    k_b = tl.load(k + b * sk_b + rows[:, None].to(tl.int64) * sk_t + key_head * sk_h + keys[None, :],
                  mask=ok[:, None] & (keys < K)[None, :], other=0.0).to(tl.float32)
    return _unit_rows(k_b, L2NORM).to(k.dtype.element_ty), cum, beta_b, g_before + tl.sum(gates, 0)


@jit
def _a_block(k_i, cum_i, beta_i, k_j, cum_j):
    """A's [16, 16] block of rows i and columns j < i: beta_r (k_r . k_s) exp(G_r - G_s)."""
    kk = tl.dot(k_i, tl.trans(k_j), input_precision="ieee")
    return beta_i[:, None] * kk * tl.exp(cum_i[:, None] - cum_j[None, :])


@jit
def _diag_inverse(k_i, cum_i, beta_i, idx):
    """(I + A_ii)^-1 for a diagonal block. A_ii = N is strictly lower, so N^16 = 0 and
    (I + N)^-1 = sum_k (-N)^k = (I - N)(I + N^2)(I + N^4)(I + N^8): six small products, no serial steps."""
    kk = tl.dot(k_i, tl.trans(k_i), input_precision="ieee")
    earlier = idx[:, None] > idx[None, :]
    n = tl.where(earlier, beta_i[:, None] * kk * tl.exp(tl.where(earlier, cum_i[:, None] - cum_i[None, :], 0.0)), 0.0)
    inv = (idx[:, None] == idx[None, :]).to(tl.float32) - n
    power = _mm(n, n)
    inv += _mm(inv, power)
    power = _mm(power, power)
    inv += _mm(inv, power)
    power = _mm(power, power)
    return inv + _mm(inv, power)


@jit
def _mm(a, b):
    return tl.dot(a, b, input_precision="ieee")


@jit
def _store_wu(w_out, u_out, v, x0, x1, x2, x3, k0, k1, k2, k3, c0, c1, c2, c3, b0, b1, b2, b3, rows0, b, head, T,
              sw_b, sw_t, sw_h, sv_b, sv_t, sv_h, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr):
    """One 16-row block of W = X diag(beta exp(G)) K and U = X diag(beta) V, X's row block given as
    x0..x3 (its [16, 16] blocks against token blocks 0..3; zeros past the diagonal)."""
    dt = k0.dtype
    idx = tl.arange(0, 16)
    keys = tl.arange(0, BK)
    vals = tl.arange(0, BV)
    w = _mm(x0.to(dt), (k0.to(tl.float32) * (b0 * tl.exp(c0))[:, None]).to(dt))
    w += _mm(x1.to(dt), (k1.to(tl.float32) * (b1 * tl.exp(c1))[:, None]).to(dt))
    w += _mm(x2.to(dt), (k2.to(tl.float32) * (b2 * tl.exp(c2))[:, None]).to(dt))
    w += _mm(x3.to(dt), (k3.to(tl.float32) * (b3 * tl.exp(c3))[:, None]).to(dt))
    rows = rows0 + idx
    ok = rows < T
    tl.store(w_out + b * sw_b + rows[:, None].to(tl.int64) * sw_t + head * sw_h + keys[None, :],
             w.to(w_out.dtype.element_ty), mask=ok[:, None] & (keys < K)[None, :])
    u = tl.zeros([16, BV], dtype=tl.float32)
    for j in tl.static_range(4):
        x_j = x0 if j == 0 else (x1 if j == 1 else (x2 if j == 2 else x3))
        beta_j = b0 if j == 0 else (b1 if j == 1 else (b2 if j == 2 else b3))
        src = rows0 - rows0 % 64 + j * 16 + idx
        v_j = tl.load(v + b * sv_b + src[:, None].to(tl.int64) * sv_t + head * sv_h + vals[None, :],
                      mask=(src < T)[:, None] & (vals < V)[None, :], other=0.0).to(tl.float32)
        u += _mm(x_j.to(dt), (v_j * beta_j[:, None]).to(dt))
    tl.store(u_out + b * sv_b + rows[:, None].to(tl.int64) * sv_t + head * sv_h + vals[None, :],
             u.to(u_out.dtype.element_ty), mask=ok[:, None] & (vals < V)[None, :])


# NPU budget: q, k [BT, BK] and P [BT, BT] fp32 = 80 KiB at BT = 64, BK = 128 (hence multi-buffering off
# there), then 16-row blocks: four keys blocks [16, BK] bf16 16 KiB, [16, 16] inverse blocks 10 KiB, a
# [16, BV] value block 8 KiB.
@jit
def _chunk_prepare_kernel(q, k, v, g, beta, q_out, k_out, w_out, u_out, p_out, g_cum, T, HV, GROUP, n_tasks, scale,
                          sk_b, sk_t, sk_h, sw_b, sw_t, sw_h, sv_b, sv_t, sv_h, sg_b, sg_t, sp_b, sp_h,
                          K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          L2NORM: tl.constexpr):
    n_chunks = (T + BT - 1) // BT
    idx = tl.arange(0, BT)
    i16 = tl.arange(0, 16)
    keys = tl.arange(0, BK)
    dt = k.dtype.element_ty
    for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        chunk = task % n_chunks
        head = (task // n_chunks) % HV
        b = tl.cast(task // n_chunks // HV, tl.int64)
        key_head = head // GROUP
        rows = chunk * BT + idx
        row_ok = rows < T
        rows64 = rows.to(tl.int64)
        cum = tl.cumsum(tl.load(g + b * sg_b + rows64 * sg_t + head, mask=row_ok, other=0.0).to(tl.float32), 0)
        tl.store(g_cum + b * sg_b + rows64 * sg_t + head, cum, mask=row_ok)

        # P = (q k^T) * exp(G_t - G_s) on and below the diagonal, and the unit-norm q, k
        kt_ok = row_ok[:, None] & (keys < K)[None, :]
        qk_at = b * sk_b + rows64[:, None] * sk_t + key_head * sk_h + keys[None, :]
        k_d = _unit_rows(tl.load(k + qk_at, mask=kt_ok, other=0.0).to(tl.float32), L2NORM).to(dt)
        q_d = (_unit_rows(tl.load(q + qk_at, mask=kt_ok, other=0.0).to(tl.float32), L2NORM) * scale).to(dt)
        if head % GROUP == 0:  # one value head per key head writes them
            tl.store(q_out + qk_at, q_d, mask=kt_ok)
            tl.store(k_out + qk_at, k_d, mask=kt_ok)
        causal = idx[:, None] >= idx[None, :]
        p = tl.dot(q_d, tl.trans(k_d), input_precision="ieee")
        p = tl.where(causal, p * tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)
        tl.store(p_out + b * sp_b + head * sp_h + rows64[:, None] * BT + idx[None, :], p.to(dt),
                 mask=row_ok[:, None])

        # X = (I + A)^-1 by 16 x 16 blocks: diagonal blocks by a product of powers, then
        # X_ij = -X_ii sum_{j <= m < i} A_im X_mj below them.
        r0 = chunk * BT
        k0, c0, b0, g1 = _block16(k, g, beta, b, head, key_head, r0 + i16, T, sk_b, sk_t, sk_h, sg_b, sg_t, 0.0,
                                  K, BK, L2NORM)
        k1, c1, b1, g2 = _block16(k, g, beta, b, head, key_head, r0 + 16 + i16, T, sk_b, sk_t, sk_h, sg_b, sg_t,
                                  g1, K, BK, L2NORM)
        k2, c2, b2, g3 = _block16(k, g, beta, b, head, key_head, r0 + 32 + i16, T, sk_b, sk_t, sk_h, sg_b, sg_t,
                                  g2, K, BK, L2NORM)
        k3, c3, b3, _ = _block16(k, g, beta, b, head, key_head, r0 + 48 + i16, T, sk_b, sk_t, sk_h, sg_b, sg_t,
                                 g3, K, BK, L2NORM)
        x00 = _diag_inverse(k0, c0, b0, i16)
        x11 = _diag_inverse(k1, c1, b1, i16)
        x22 = _diag_inverse(k2, c2, b2, i16)
        x33 = _diag_inverse(k3, c3, b3, i16)
        a10 = _a_block(k1, c1, b1, k0, c0)
        a20 = _a_block(k2, c2, b2, k0, c0)
        a21 = _a_block(k2, c2, b2, k1, c1)
        a30 = _a_block(k3, c3, b3, k0, c0)
        a31 = _a_block(k3, c3, b3, k1, c1)
        a32 = _a_block(k3, c3, b3, k2, c2)
        x10 = -_mm(x11, _mm(a10, x00))
        x21 = -_mm(x22, _mm(a21, x11))
        x20 = -_mm(x22, _mm(a20, x00) + _mm(a21, x10))
        x32 = -_mm(x33, _mm(a32, x22))
        x31 = -_mm(x33, _mm(a31, x11) + _mm(a32, x21))
        x30 = -_mm(x33, _mm(a30, x00) + _mm(a31, x10) + _mm(a32, x20))
        zero = tl.zeros([16, 16], dtype=tl.float32)
        _store_wu(w_out, u_out, v, x00, zero, zero, zero, k0, k1, k2, k3, c0, c1, c2, c3, b0, b1, b2, b3, r0, b,
                  head, T, sw_b, sw_t, sw_h, sv_b, sv_t, sv_h, K, V, BK, BV)
        _store_wu(w_out, u_out, v, x10, x11, zero, zero, k0, k1, k2, k3, c0, c1, c2, c3, b0, b1, b2, b3, r0 + 16,
                  b, head, T, sw_b, sw_t, sw_h, sv_b, sv_t, sv_h, K, V, BK, BV)
        _store_wu(w_out, u_out, v, x20, x21, x22, zero, k0, k1, k2, k3, c0, c1, c2, c3, b0, b1, b2, b3, r0 + 32,
                  b, head, T, sw_b, sw_t, sw_h, sv_b, sv_t, sv_h, K, V, BK, BV)
        _store_wu(w_out, u_out, v, x30, x31, x32, x33, k0, k1, k2, k3, c0, c1, c2, c3, b0, b1, b2, b3, r0 + 48,
                  b, head, T, sw_b, sw_t, sw_h, sv_b, sv_t, sv_h, K, V, BK, BV)


# NPU budget: S [BK, BV] fp32 32 KiB, q, k, w [BT, BK] bf16 48 KiB, u / v_new [BT, BV] fp32 and P [BT, BT]
# bf16 24 KiB (BT = BV = 64, BK = 128): over 70 KiB, so the NPU launch turns multi-buffering off.
@jit
def _chunk_state_kernel(q, k, w, u, p, g_cum, initial, final, out, T, HV, GROUP, n_tasks,
                        sq_b, sq_t, sq_h, sw_b, sw_t, sw_h, sv_b, sv_t, sv_h, sg_b, sg_t, sp_b, sp_h,
                        K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        HAS_INITIAL: tl.constexpr):
    n_v = (V + BV - 1) // BV
    n_chunks = (T + BT - 1) // BT
    idx = tl.arange(0, BT)
    keys = tl.arange(0, BK)
    key_ok = keys < K
    dt = q.dtype.element_ty
    for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        head = (task // n_v) % HV
        b = tl.cast(task // n_v // HV, tl.int64)
        vals = task % n_v * BV + tl.arange(0, BV)
        val_ok = vals < V
        state_base = (b * HV + head) * K * V
        if HAS_INITIAL:
            s = tl.load(initial + state_base + keys[:, None] * V + vals[None, :],
                        mask=key_ok[:, None] & val_ok[None, :], other=0.0).to(tl.float32)
        else:
            s = tl.zeros([BK, BV], dtype=tl.float32)
        for chunk in range(n_chunks):
            rows = chunk * BT + idx
            row_ok = rows < T
            rows64 = rows[:, None].to(tl.int64)
            kt_ok = row_ok[:, None] & key_ok[None, :]
            vt_ok = row_ok[:, None] & val_ok[None, :]
            q_c = tl.load(q + b * sq_b + rows64 * sq_t + (head // GROUP) * sq_h + keys[None, :], mask=kt_ok, other=0.0)
            k_c = tl.load(k + b * sq_b + rows64 * sq_t + (head // GROUP) * sq_h + keys[None, :], mask=kt_ok, other=0.0)
            w_c = tl.load(w + b * sw_b + rows64 * sw_t + head * sw_h + keys[None, :], mask=kt_ok, other=0.0)
            u_c = tl.load(u + b * sv_b + rows64 * sv_t + head * sv_h + vals[None, :], mask=vt_ok, other=0.0)
            p_c = tl.load(p + b * sp_b + head * sp_h + rows64 * BT + idx[None, :], mask=row_ok[:, None], other=0.0)
            cum = tl.load(g_cum + b * sg_b + rows.to(tl.int64) * sg_t + head, mask=row_ok, other=0.0)
            last = tl.minimum(chunk * BT + BT, T) - 1
            cum_last = tl.load(g_cum + b * sg_b + tl.cast(last, tl.int64) * sg_t + head)

            s_d = s.to(dt)
            v_new = u_c.to(tl.float32) - tl.dot(w_c, s_d, input_precision="ieee")
            o = tl.dot(q_c, s_d, input_precision="ieee") * tl.exp(cum)[:, None]
            o += tl.dot(p_c, v_new.to(dt), input_precision="ieee")
            tl.store(out + b * sv_b + rows64 * sv_t + head * sv_h + vals[None, :], o.to(out.dtype.element_ty),
                     mask=vt_ok)
            # (k_s exp(G_last - G_s))^T v_new_s, with the decay on the narrower v_new tile
            v_decayed = (v_new * tl.exp(cum_last - cum)[:, None]).to(dt)
            s = s * tl.exp(cum_last) + tl.dot(tl.trans(k_c), v_decayed, input_precision="ieee")
        tl.store(final + state_base + keys[:, None] * V + vals[None, :], s, mask=key_ok[:, None] & val_ok[None, :])


@dataclass(frozen=True)
class ChunkConfig:
    """Launch choices of the chunked prefill: the state kernel's value block, warps and stages, and the
    prepare kernel's warps."""

    state_bv: int = 32
    state_warps: int = 4
    state_stages: int = 3
    prepare_warps: int = 4


def chunk_config(batch: int, hv: int, v_dim: int, device: torch.device) -> ChunkConfig:
    """The state kernel is one sequential walk per (request, head, value block): wide [K, 64] blocks do the
    most per chunk, narrow [K, 32] ones give twice the programs. Take the wide ones unless that leaves the
    multiprocessors much emptier (measured on an H200: HV = 32 wants 32, HV = 48 wants 64; bench/RESULTS.md)."""
    units = multiprocessor_count(device)

    def filled(bv: int) -> float:
        programs = batch * hv * -(-v_dim // bv)
        return programs / (-(-programs // units) * units)

    if filled(64) >= 0.9 * filled(32):
        return ChunkConfig(state_bv=64, state_warps=4, state_stages=2)
    return ChunkConfig(state_bv=32, state_warps=4, state_stages=3)


def chunk_gated_delta_rule_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    config: ChunkConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernels behind chunk_gated_delta_rule (any device; CPU tensors run in Triton's
    interpreter). chunk_size is the reference's; the kernels use chunks of 64 tokens."""
    cfg = config or chunk_config(q.shape[0], v.shape[2], v.shape[3], v.device)
    parts = chunk_prepare(q, k, v, g, beta, use_qk_l2norm, cfg)
    return chunk_states(parts, initial_state, cfg)


CHUNK = 64  # tokens per chunk: the prepare kernel inverts (I + A) in 4 blocks of 16


@dataclass
class ChunkParts:
    """What the prepare kernel leaves for the state kernel: unit-norm q (scaled), k [B, T, H, K]; W [B, T, HV, K];
    U [B, T, HV, V]; P [B, HV, T, CHUNK] (row t: its chunk's columns); cumulative log decays [B, T, HV]."""

    q: torch.Tensor
    k: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    p: torch.Tensor
    g_cum: torch.Tensor


def chunk_prepare(q, k, v, g, beta, use_qk_l2norm: bool = True, config: ChunkConfig | None = None) -> ChunkParts:
    """The first kernel of chunk_gated_delta_rule_triton: everything that does not depend on the state."""
    cfg = config or ChunkConfig()
    b, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    v, g, beta = v.contiguous(), g.contiguous(), beta.contiguous()
    dt = v.dtype
    q, k = q.to(dt).contiguous(), k.to(dt).contiguous()
    parts = ChunkParts(torch.empty_like(q), torch.empty_like(k), torch.empty(b, t, hv, kd, dtype=dt, device=v.device),
                       torch.empty_like(v), torch.empty(b, hv, t, CHUNK, dtype=dt, device=v.device),
                       torch.empty(b, t, hv, dtype=torch.float32, device=v.device))
    n_tasks = b * hv * -(-t // CHUNK)
    w, p = parts.w, parts.p
    launch(_chunk_prepare_kernel, persistent_grid(v.device, n_tasks, "cube"), q, k, v, g, beta, parts.q, parts.k, w,
           parts.u, p, parts.g_cum, t, hv, hv // h, n_tasks, kd**-0.5, k.stride(0), k.stride(1), k.stride(2),
           w.stride(0), w.stride(1), w.stride(2), v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1),
           p.stride(0), p.stride(1), K=kd, V=vd, BT=CHUNK, BK=max(16, next_power_of_2(kd)),
           BV=max(16, next_power_of_2(vd)), L2NORM=use_qk_l2norm,
           **launch_options(v.device, num_warps=cfg.prepare_warps, num_stages=1, npu={"multibuffer": False}))
    return parts


def chunk_states(parts: ChunkParts, initial_state: torch.Tensor | None = None,
                 config: ChunkConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The second kernel: the walk over chunks. Returns o [B, T, HV, V] and the final state [B, HV, K, V]."""
    cfg = config or chunk_config(parts.u.shape[0], parts.u.shape[2], parts.u.shape[3], parts.u.device)
    q, w, u, p = parts.q, parts.w, parts.u, parts.p
    b, t, h, kd = q.shape
    hv, vd = u.shape[2], u.shape[3]
    out = torch.empty_like(u)
    final = torch.empty(b, hv, kd, vd, dtype=torch.float32, device=u.device)
    initial = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    bv = min(cfg.state_bv, max(16, next_power_of_2(vd)))
    n_tasks = b * hv * -(-vd // bv)
    launch(_chunk_state_kernel, persistent_grid(u.device, n_tasks, "cube"), q, parts.k, w, u, p, parts.g_cum,
           initial, final, out, t, hv, hv // h, n_tasks, q.stride(0), q.stride(1), q.stride(2), w.stride(0),
           w.stride(1), w.stride(2), u.stride(0), u.stride(1), u.stride(2), parts.g_cum.stride(0),
           parts.g_cum.stride(1), p.stride(0), p.stride(1), K=kd, V=vd, BT=CHUNK, BK=max(16, next_power_of_2(kd)),
           BV=bv, HAS_INITIAL=initial is not None,
           **launch_options(u.device, num_warps=cfg.state_warps, num_stages=cfg.state_stages,
                            npu={"multibuffer": False}))
    return out, final
