"""The expert MLP for few tokens (decode, verify, small batches), where grouping rows by expert costs more
than it saves: one program per (routed pair, column tile) for gate/up, one per (token, column tile) for the
down projection, which also sums the token's top-k slots in slot order - no sort, no padding, no atomics,
and each token's result independent of the others in the batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from npuport.kernels.launch import jit, launch, launch_options, persistent_grid, tl


@dataclass(frozen=True)
class FewTokensConfig:
    """Column tiles of the two mat-vec kernels, their K step and warps: weights stream in [BN, BK] tiles of
    contiguous rows through the CUDA cores."""

    gate_up_bn: int = 32
    down_bn: int = 16
    bk: int = 256
    num_warps: int = 4
    num_stages: int = 3


FEW_TOKENS = FewTokensConfig()


def few_tokens_config(pairs: int) -> FewTokensConfig:
    """Measured on an H200 at the 35B-A3B widths (bench/moe.py --sweep, bench/RESULTS.md): with up to 16 routed
    pairs (batch 1-2 at top-8) [16, 512] weight tiles on both kernels stream best (25 us vs 31 at one token);
    with more, [32, 256] for gate/up and [16, 256] for down."""
    if pairs <= 16:
        return FewTokensConfig(gate_up_bn=16, down_bn=16, bk=512)
    return FEW_TOKENS


@jit
def _row_times_tile(a_row, w_rows, k0, K, n_ok, BK: tl.constexpr, INT8: tl.constexpr):
    """sum over k in [k0, k0 + BK) of a_row[k] * w_rows[n, k] -> [BN] (int32 for int8 operands, else fp32)."""
    rk = k0 + tl.arange(0, BK)
    k_ok = rk < K
    x = tl.load(a_row + rk, mask=k_ok, other=0)
    w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
    if INT8:
        products = tl.sum(w.to(tl.int32) * x.to(tl.int32)[None, :], 1)
    else:
        products = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    return products


# NPU budget: two weight tiles [32, 256] bf16 (2 x 16 KiB) and their fp32 products: under 64 KiB.
@jit
def _pair_gate_up_kernel(a, a_scale, w, w_scale, expert_ids, out, N, K, TOP_K, n_tasks, sa_m, sw_e, sw_n, sws_e,
                         so_m, BN: tl.constexpr, BK: tl.constexpr, INT8: tl.constexpr):
    """Task t = (pair p = t // tiles_n, column tile): out[p, n] = silu(gate) * up of token p // TOP_K through
    expert expert_ids[p] (gate rows n, up rows N + n of w [E, 2N, K]), rounded as grouped_gemm's GATED
    epilogue rounds."""
    tiles_n = (N + BN - 1) // BN
    for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        p = task // tiles_n
        token = p // TOP_K
        expert = tl.load(expert_ids + p).to(tl.int64)
        rn = task % tiles_n * BN + tl.arange(0, BN)
        n_ok = rn < N
        a_row = a + tl.cast(token, tl.int64) * sa_m
        gate_rows = w + expert * sw_e + rn[:, None].to(tl.int64) * sw_n
        up_rows = gate_rows + tl.cast(N, tl.int64) * sw_n
        acc_type = tl.int32 if INT8 else tl.float32
        acc = tl.zeros([BN], dtype=acc_type)
        acc_up = tl.zeros([BN], dtype=acc_type)
        for k0 in range(0, K, BK):
            acc += _row_times_tile(a_row, gate_rows, k0, K, n_ok, BK, INT8)
            acc_up += _row_times_tile(a_row, up_rows, k0, K, n_ok, BK, INT8)
        dt = out.dtype.element_ty
        if INT8:
            x_s = tl.load(a_scale + token)
            w_s = w_scale + expert * sws_e
            gate = (acc.to(tl.float32) * x_s * tl.load(w_s + rn, mask=n_ok, other=0.0)).to(dt)
            up = (acc_up.to(tl.float32) * x_s * tl.load(w_s + N + rn, mask=n_ok, other=0.0)).to(dt)
        else:
            gate, up = acc.to(dt), acc_up.to(dt)
        g = gate.to(tl.float32)
        h = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * up.to(tl.float32)).to(dt)
        tl.store(out + tl.cast(p, tl.int64) * so_m + rn, h, mask=n_ok)


# NPU budget: one weight tile [16, 256] bf16 (8 KiB) and its fp32 products (16 KiB).
@jit
def _token_down_kernel(h, h_scale, w, w_scale, expert_ids, route_weight, add_to, out, N, K, TOP_K, n_tasks, sh_m,
                       sw_e, sw_n, sws_e, so_m, BN: tl.constexpr, BK: tl.constexpr, INT8: tl.constexpr,
                       ADD: tl.constexpr):
    """Task t = (token m = t // tiles_n, column tile): out[m, n] = the sum over slots s = 0..TOP_K-1, in that
    order and in fp32, of round(round(h[p] @ w[e, n]) * route_weight[p]) with p = m TOP_K + s, e = expert_ids[p]
    (each product rounded to out's dtype as grouped_gemm's ROUTED epilogue rounds), starting from add_to[m, n]
    when ADD (else 0), rounded once at the end."""
    tiles_n = (N + BN - 1) // BN
    dt = out.dtype.element_ty
    for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        m = task // tiles_n
        rn = task % tiles_n * BN + tl.arange(0, BN)
        n_ok = rn < N
        total = tl.zeros([BN], dtype=tl.float32)
        if ADD:
            total += tl.load(add_to + tl.cast(m, tl.int64) * so_m + rn, mask=n_ok, other=0.0).to(tl.float32)
        for s in range(0, TOP_K):
            p = m * TOP_K + s
            expert = tl.load(expert_ids + p).to(tl.int64)
            h_row = h + tl.cast(p, tl.int64) * sh_m
            w_rows = w + expert * sw_e + rn[:, None].to(tl.int64) * sw_n
            acc = tl.zeros([BN], dtype=tl.int32 if INT8 else tl.float32)
            for k0 in range(0, K, BK):
                acc += _row_times_tile(h_row, w_rows, k0, K, n_ok, BK, INT8)
            if INT8:
                y = (acc.to(tl.float32) * tl.load(h_scale + p)
                     * tl.load(w_scale + expert * sws_e + rn, mask=n_ok, other=0.0)).to(dt)
            else:
                y = acc.to(dt)
            total += (y.to(tl.float32) * tl.load(route_weight + p).to(tl.float32)).to(dt).to(tl.float32)
        tl.store(out + tl.cast(m, tl.int64) * so_m + rn, total.to(dt), mask=n_ok)


def pair_gate_up(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor | None,
                 expert_ids: torch.Tensor, out_dtype: torch.dtype, config: FewTokensConfig = FEW_TOKENS
                 ) -> torch.Tensor:
    """a [M, K] (bf16, or int8 with a_scale [M]); w [E, 2N, K] (w_scale [E, 2N] for int8); expert_ids
    [M, top_k] -> [M * top_k, N]: silu(gate) * up of each routed pair (row token * top_k + slot)."""
    m, top_k = expert_ids.shape
    n, k = w.shape[1] // 2, w.shape[2]
    int8 = w.dtype == torch.int8
    out = torch.empty(m * top_k, n, dtype=out_dtype, device=a.device)
    n_tasks = m * top_k * -(-n // config.gate_up_bn)
    launch(_pair_gate_up_kernel, persistent_grid(a.device, n_tasks), a, a_scale, w, w_scale, expert_ids, out, n, k,
           top_k, n_tasks, a.stride(0), w.stride(0), w.stride(1), w_scale.stride(0) if int8 else 0, out.stride(0),
           BN=config.gate_up_bn, BK=config.bk, INT8=int8,
           **launch_options(a.device, num_warps=config.num_warps, num_stages=config.num_stages))
    return out


def token_down(h: torch.Tensor, h_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor | None,
               expert_ids: torch.Tensor, route_weight: torch.Tensor, out_dtype: torch.dtype,
               config: FewTokensConfig = FEW_TOKENS, add_to: torch.Tensor | None = None) -> torch.Tensor:
    """h [M * top_k, K] (bf16, or int8 with h_scale [M * top_k]); w [E, N, K]; expert_ids, route_weight
    [M, top_k] -> [M, N]: each token's routed outputs weighted and summed over its slots, added to add_to
    [M, N] (contiguous, out_dtype) when given."""
    m, top_k = expert_ids.shape
    n, k = w.shape[1], w.shape[2]
    int8 = w.dtype == torch.int8
    out = torch.empty(m, n, dtype=out_dtype, device=h.device)
    n_tasks = m * -(-n // config.down_bn)
    if add_to is not None and (add_to.shape != out.shape or add_to.stride() != out.stride()):
        raise ValueError(f"add_to must be a contiguous {tuple(out.shape)} tensor, got {tuple(add_to.shape)}")
    launch(_token_down_kernel, persistent_grid(h.device, n_tasks), h, h_scale, w, w_scale, expert_ids,
           route_weight, add_to, out, n, k, top_k, n_tasks, h.stride(0), w.stride(0), w.stride(1),
           w_scale.stride(0) if int8 else 0, out.stride(0), BN=config.down_bn, BK=config.bk, INT8=int8,
           ADD=add_to is not None,
           **launch_options(h.device, num_warps=config.num_warps, num_stages=config.num_stages))
    return out
