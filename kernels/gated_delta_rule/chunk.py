"""The chunked gated delta rule for prefill: two Triton kernels (what does not depend on the state, then
the walk over chunks carrying it) and their dispatcher."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from npuport.devices import multiprocessor_count
from npuport.kernels.gated_delta_rule.l2norm import unit_rows
from npuport.kernels.gated_delta_rule.naive import chunk_gated_delta_rule_reference
from npuport.kernels.implementations import NATIVE, TRITON, runnable
from npuport.kernels.launch import jit, launch, launch_options, next_power_of_2, persistent_grid, tl, use_triton
from npuport.kernels.npu import gdn as native


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
    chosen = runnable("gdn_chunk", q.device, lambda: native.gdn_chunk_refusal(q, v), use_triton(q, k, v))
    if chosen == NATIVE:
        return native.gdn_chunk_native(q, k, v, g, beta, initial_state, use_qk_l2norm)
    if chosen == TRITON:
        return chunk_gated_delta_rule_triton(q, k, v, g, beta, initial_state, use_qk_l2norm, chunk_size)
    return chunk_gated_delta_rule_reference(q, k, v, g, beta, initial_state, use_qk_l2norm, chunk_size)


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
    return unit_rows(k_b, L2NORM).to(k.dtype.element_ty), cum, beta_b, g_before + tl.sum(gates, 0)


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
        k_d = unit_rows(tl.load(k + qk_at, mask=kt_ok, other=0.0).to(tl.float32), L2NORM).to(dt)
        q_d = (unit_rows(tl.load(q + qk_at, mask=kt_ok, other=0.0).to(tl.float32), L2NORM) * scale).to(dt)
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


def chunk_config(batch: int, hv: int, v_dim: int, device: torch.device, element_size: int = 2) -> ChunkConfig:
    """The state kernel is one sequential walk per (request, head, value block): wide [K, 64] blocks do the
    most per chunk, narrow [K, 32] ones give twice the programs. Take the wide ones unless that leaves the
    multiprocessors much emptier (measured on an H200: HV = 32 wants 32, HV = 48 wants 64; bench/RESULTS.md).
    Float32 tiles (element_size 4) take twice the shared memory per pipeline stage: one stage only (with three
    the HV = 32 launch asked an H200 for 262 KB of its 232 KB)."""
    units = multiprocessor_count(device)

    def filled(bv: int) -> float:
        programs = batch * hv * -(-v_dim // bv)
        return programs / (-(-programs // units) * units)

    wide = filled(64) >= 0.9 * filled(32)
    stages = 1 if element_size > 2 else 2 if wide else 3
    return ChunkConfig(state_bv=64 if wide else 32, state_warps=4, state_stages=stages)


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
    cfg = config or chunk_config(q.shape[0], v.shape[2], v.shape[3], v.device, v.element_size())
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
    cfg = config or chunk_config(parts.u.shape[0], parts.u.shape[2], parts.u.shape[3], parts.u.device,
                                 parts.u.element_size())
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
