"""The gated delta rule in plain PyTorch, token by token and chunk by chunk: the references every kernel of
this package is tested against (shapes and the recurrence: the package docstring)."""

from __future__ import annotations

import torch

from npuport.kernels.gated_delta_rule.l2norm import l2norm
from npuport.kernels.gated_delta_rule.verify_log import VerifyLog, check_log_room, replay_pending
from npuport.kernels.gdn_gating import fused_gdn_gating_reference, state_dtype


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
        check_log_room(log, tokens)
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
