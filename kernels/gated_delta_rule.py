"""The gated delta rule of a GatedDeltaNet layer: chunked prefill and a recurrent step that keeps the state
after every token (for speculative verify).

Shapes: q, k [B, T, H, K]; v [B, T, HV, V]; g (log decay), beta [B, T, HV]; value head j reads key head
j // (HV // H). The recurrent state of one value head is S [K, V] (keys along rows, values along columns),
so a batch of states is [B, HV, K, V], always in fp32 (float64 for float64 inputs) - the one orientation
used everywhere: prefill, chunked prefill, verify and commit. Per token, with q, k l2-normalized and
q scaled by K^-0.5:

    S = exp(g_t) * S;  u = beta_t * (v_t - S^T k_t);  S = S + k_t u^T;  o_t = S^T q_t
"""

from __future__ import annotations

import torch

from npuport.kernels.gdn_gating import state_dtype

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
    return chunk_gated_delta_rule_reference(q, k, v, g, beta, initial_state, use_qk_l2norm, chunk_size)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    read_slot: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Decode / verify of T tokens. states [B, S, HV, K, V] fp32 (S >= T slots): starts from
    states[b, read_slot[b]] and writes the state after token t into states[b, t]. Returns o [B, T, HV, V]."""
    return fused_recurrent_gated_delta_rule_reference(q, k, v, g, beta, states, read_slot, use_qk_l2norm)


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
    states: torch.Tensor,
    read_slot: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    qh, kh, vh, gh, bh = _prepare(q, k, v, g, beta, use_qk_l2norm)
    batch = torch.arange(states.shape[0], device=states.device)
    state = states[batch, read_slot].to(vh.dtype)  # [B, HV, K, V], a copy: the slots are written below
    out = torch.empty_like(vh)
    for t in range(vh.shape[2]):
        state = state * gh[:, :, t].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, kh[:, :, t])
        u = bh[:, :, t, None] * (vh[:, :, t] - predicted)
        state = state + kh[:, :, t, :, None] * u[:, :, None, :]
        out[:, :, t] = torch.einsum("bhkv,bhk->bhv", state, qh[:, :, t])
        states[:, t] = state
    return out.transpose(1, 2).to(v.dtype)
