"""The grouped expert GEMM: one launch multiplies every block of routed rows by its expert's weight, BF16 or
W8A8 (int8 x int8 -> exact int32 sums, rescaled per token and per channel in the epilogue). Two epilogues make
the expert MLP: GATED pairs gate and up columns and stores silu(gate) * up (the gate/up projection), ROUTED
multiplies each row by its routing weight (the down projection).

W4A8 experts (INT4: int8 bytes of int4 row pairs, StackedExperts.int4) are read packed, half the bytes of int8:
each K step loads a [BK, BN/2] tile of bytes, sign-extends its low nibbles (even weight rows) and its high ones (odd
rows) into two int8 tiles and multiplies each, and the two int32 sums are interleaved into the BN columns' order
after the K loop - the int8 kernel's sums on the unpacked weights, bit for bit (integer sums are exact), and then
its epilogue."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from npuport.devices import is_gpu, shared_memory_per_block
from npuport.kernels.fused_moe.int4_tiles import load_nibbles
from npuport.kernels.fused_moe.routing import BlockRouting
from npuport.kernels.launch import jit, launch, launch_options, persistent_grid, stages_within, tl, unit_last_stride


@dataclass(frozen=True)
class GroupedConfig:
    """Tiles of the grouped GEMM: block rows per expert block (the routing's padding), output columns, K step."""

    block: int
    bn: int
    bk: int
    num_warps: int = 4
    num_stages: int = 3


def grouped_config(pairs: int, num_experts: int, device: torch.device) -> GroupedConfig:
    """Decode (a few rows per expert): 16-row blocks, the least padding tensor cores allow, narrow column tiles
    so that the few experts touched still spread over many programs. Prefill (many rows per expert): 64-row
    blocks and wide tiles, to reuse each weight tile over many rows. Off a GPU (interpreter, NPU) the small
    tiles: the NPU's on-chip budget and the interpreter's speed both want them."""
    rows_per_expert = pairs / max(1, min(num_experts, pairs))
    if not is_gpu(device) or rows_per_expert <= 16:
        return GroupedConfig(block=16, bn=64, bk=128, num_warps=4, num_stages=4)
    if rows_per_expert <= 64:
        return GroupedConfig(block=32, bn=64, bk=128, num_warps=4, num_stages=4)
    return GroupedConfig(block=64, bn=128, bk=64, num_warps=4, num_stages=4)


def grouped_stages(config: GroupedConfig, element_bytes: int, gated: bool, shared_bytes: int) -> int:
    """config's pipeline stages, fewer where float32 tiles (element_bytes 4) would overflow the GPU's shared
    memory per block (shared_bytes): a stage holds the activation tile [block, BK] and one weight tile [BK, BN]
    per output half (two when gated)."""
    stage = (config.block + (2 if gated else 1) * config.bn) * config.bk * element_bytes
    return stages_within(shared_bytes, config.num_stages, stage)


@jit
def _int4_sums(a_ptrs, r_ok, w_e, n0, N, K, sw_n, BLOCK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               GATED: tl.constexpr):
    """(acc, acc_up) int32 [BLOCK, BN]: the int8 rows at a_ptrs times weight rows [n0, n0 + BN) of one expert's
    int4 row pairs w_e (byte row j: rows 2j, 2j + 1; GATED: the up rows' pairs from byte row N / 2), summed over K;
    acc_up is zeros unless GATED."""
    rk = tl.arange(0, BK)
    rp = n0 // 2 + tl.arange(0, BN // 2)
    p_ok = rp < N // 2
    p_ptrs = w_e + rp[None, :].to(tl.int64) * sw_n + rk[:, None]
    up_ptrs = p_ptrs + tl.cast(N // 2, tl.int64) * sw_n
    even = tl.zeros([BLOCK, BN // 2], dtype=tl.int32)
    odd = tl.zeros([BLOCK, BN // 2], dtype=tl.int32)
    up_even = tl.zeros([BLOCK, BN // 2], dtype=tl.int32)
    up_odd = tl.zeros([BLOCK, BN // 2], dtype=tl.int32)
    for k0 in range(0, K, BK):
        k_ok = k0 + rk < K
        x = tl.load(a_ptrs + k0, mask=r_ok[:, None] & k_ok[None, :], other=0)
        low, high = load_nibbles(p_ptrs + k0, k_ok[:, None] & p_ok[None, :])  # the tile's even and odd columns
        even = tl.dot(x, low.to(tl.int8), even, out_dtype=tl.int32)
        odd = tl.dot(x, high.to(tl.int8), odd, out_dtype=tl.int32)
        if GATED:
            low, high = load_nibbles(up_ptrs + k0, k_ok[:, None] & p_ok[None, :])
            up_even = tl.dot(x, low.to(tl.int8), up_even, out_dtype=tl.int32)
            up_odd = tl.dot(x, high.to(tl.int8), up_odd, out_dtype=tl.int32)
    return tl.interleave(even, odd), tl.interleave(up_even, up_odd)


@jit
def _dense_sums(a_ptrs, r_ok, w_e, rn, n_ok, N, K, sw_n, BLOCK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                INT8: tl.constexpr, GATED: tl.constexpr):
    """(acc, acc_up) [BLOCK, BN], int32 (INT8) or fp32: the rows at a_ptrs times weight rows rn of one expert's
    w_e [*, K] (GATED: and rows N + rn), summed over K; acc_up is zeros unless GATED."""
    rk = tl.arange(0, BK)
    w_ptrs = w_e + rn[None, :].to(tl.int64) * sw_n + rk[:, None]
    acc_type = tl.int32 if INT8 else tl.float32
    acc = tl.zeros([BLOCK, BN], dtype=acc_type)
    acc_up = tl.zeros([BLOCK, BN], dtype=acc_type)
    for k0 in range(0, K, BK):
        k_ok = k0 + rk < K
        x = tl.load(a_ptrs + k0, mask=r_ok[:, None] & k_ok[None, :], other=0)
        wt = tl.load(w_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0)
        acc = tl.dot(x, wt, acc, out_dtype=acc_type, input_precision="ieee")
        if GATED:
            wu = tl.load(w_ptrs + k0 + N.to(tl.int64) * sw_n, mask=k_ok[:, None] & n_ok[None, :], other=0)
            acc_up = tl.dot(x, wu, acc_up, out_dtype=acc_type, input_precision="ieee")
    return acc, acc_up


# NPU budget (block 16, BN 64, BK 128): the activation tile [16, 128] and two weight tiles [128, 64] in bf16
# (4 + 2 x 16 KiB) and two fp32 / int32 accumulators [16, 64] (2 x 4 KiB): under 48 KiB. INT4: two byte tiles
# [128, 32] (2 x 4 KiB), their int32 nibbles while unpacked (2 x 16 KiB) and four int32 accumulators [16, 32].
@jit
def _grouped_gemm_kernel(a, a_scale, w, w_scale, route_weight, rows, block_expert, out,
                         N, K, PAIRS, A_DIV, n_tasks, sa_m, sw_e, sw_n, sws_e, so_m,
                         BLOCK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, INT8: tl.constexpr,
                         GATED: tl.constexpr, ROUTED: tl.constexpr, INT4: tl.constexpr):
    """Task t = (block t // tiles_n, column tile t % tiles_n). The block's rows r (sentinel PAIRS: none) read
    activation row r // A_DIV of a (A_DIV = top_k for the per-token input of gate/up, 1 for the per-row
    intermediate) and expert e = block_expert[block]'s weight rows n of w [E, *, K] (GATED: rows n and N + n;
    INT4: w holds int4 row pairs, byte row j rows 2j and 2j + 1, GATED's up rows from byte row N / 2).
    out [PAIRS, N] row r, columns n: the rescaled product rounded to out's dtype; GATED: silu(gate) * up with
    gate and up each rounded first, as separate layers round them; ROUTED: times route_weight[r], rounded."""
    tiles_n = (N + BN - 1) // BN
    rk = tl.arange(0, BK)
    for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        blk = task // tiles_n
        expert = tl.load(block_expert + blk)
        if expert >= 0:
            r = tl.load(rows + blk * BLOCK + tl.arange(0, BLOCK))
            r_ok = r < PAIRS
            src = tl.where(r_ok, r // A_DIV, 0)
            n0 = task % tiles_n * BN
            rn = n0 + tl.arange(0, BN)
            n_ok = rn < N
            w_e = w + expert.to(tl.int64) * sw_e
            a_ptrs = a + src[:, None].to(tl.int64) * sa_m + rk[None, :]
            if INT4:
                acc, acc_up = _int4_sums(a_ptrs, r_ok, w_e, n0, N, K, sw_n, BLOCK, BN, BK, GATED)
            else:
                acc, acc_up = _dense_sums(a_ptrs, r_ok, w_e, rn, n_ok, N, K, sw_n, BLOCK, BN, BK, INT8, GATED)
            dt = out.dtype.element_ty
            if INT8:
                x_s = tl.load(a_scale + src, mask=r_ok, other=0.0)
                w_s = w_scale + expert.to(tl.int64) * sws_e
                y = (acc.to(tl.float32) * x_s[:, None] * tl.load(w_s + rn, mask=n_ok, other=0.0)[None, :]).to(dt)
                if GATED:
                    w_up = tl.load(w_s + N + rn, mask=n_ok, other=0.0)
                    up = (acc_up.to(tl.float32) * x_s[:, None] * w_up[None, :]).to(dt)
            else:
                y = acc.to(dt)
                if GATED:
                    up = acc_up.to(dt)
            if GATED:
                g = y.to(tl.float32)
                y = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * up.to(tl.float32)).to(dt)
            if ROUTED:
                rw = tl.load(route_weight + r, mask=r_ok, other=0.0).to(tl.float32)
                y = (y.to(tl.float32) * rw[:, None]).to(dt)
            tl.store(out + r[:, None].to(tl.int64) * so_m + rn[None, :], y, mask=r_ok[:, None] & n_ok[None, :])


def grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor | None,
                 routing: BlockRouting, a_div: int, out_dtype: torch.dtype, config: GroupedConfig,
                 gated: bool = False, route_weight: torch.Tensor | None = None, int4: bool = False) -> torch.Tensor:
    """The grouped product over routing's rows: a [A, K] (bf16, or int8 with a_scale [A] fp32) read at row
    r // a_div; w [E, N or 2N (gated), K] (bf16, or int8 with w_scale [E, N or 2N]; int4: int8 bytes of int4 row
    pairs, [E, N / 2 or N (gated), K], w_scale as int8's). Returns [pairs, N] in out_dtype; rows no block holds are
    left uninitialised (every real row is in a block)."""
    int8 = w.dtype == torch.int8
    if (a.dtype == torch.int8) != int8:
        raise ValueError(f"the grouped GEMM takes int8 tokens with int8 experts only, got {a.dtype} and {w.dtype}")
    if int4 and (not int8 or config.bn % 2):
        raise ValueError(f"int4 experts are int8 bytes read in column tiles of whole row pairs, got {w.dtype} and "
                         f"tiles of {config.bn}")
    rows = w.shape[1] * (2 if int4 else 1)  # of the unpacked weight
    n = rows // 2 if gated else rows
    k = w.shape[2]
    a = unit_last_stride(a)
    out = torch.empty(routing.pairs, n, dtype=out_dtype, device=a.device)
    n_tasks = routing.block_expert.numel() * -(-n // config.bn)
    launch(_grouped_gemm_kernel, persistent_grid(a.device, n_tasks, "cube"), a, a_scale, w, w_scale,
           route_weight, routing.rows, routing.block_expert, out, n, k, routing.pairs, a_div, n_tasks, a.stride(0),
           w.stride(0), w.stride(1), w_scale.stride(0) if int8 else 0, out.stride(0), BLOCK=routing.block,
           BN=config.bn, BK=config.bk, INT8=int8, GATED=gated, ROUTED=route_weight is not None, INT4=int4,
           **launch_options(a.device, num_warps=config.num_warps,
                            num_stages=grouped_stages(config, w.element_size(), gated,
                                                      shared_memory_per_block(a.device)),
                            npu={"multibuffer": False}))
    return out
