"""y = x W^T with every row's bits independent of the batch: the same whether the row is computed alone or
among any number of others, at any position. cuBLAS picks its algorithm - and with it the order in which a dot
product's terms are added - by the number of rows, so a verify step of k + 1 tokens per request and a decode step
of one round differently, and greedy speculative decoding drifts from plain greedy decoding (issue: batch
invariance). Here one tile shape per weight shape - BM rows, BN columns, a K step of BK - is used for every M; an
output element is the fp32 sum of its K tiles in order, each tile's products through one tl.dot (whose lanes
are per element: the other rows of the tile do not enter), no split-K. float32 inputs use IEEE products (no
TF32).

The reference beside it computes each row alone with F.linear - batch-invariant by construction, and what the
CPU runs in the invariant mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from npuport.kernels.implementations import TRITON, runnable
from npuport.kernels.launch import jit, launch, launch_options, tl, unit_last_stride, use_triton

# Output columns per program when the layer is wide enough to fill the GPU with them, else half as many.
WIDE_BN, NARROW_BN = 64, 32
BM = 16  # rows per program: a decode / verify step's rows usually fit one tile


def invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K], weight [N, K] (x's dtype) -> [..., N] in x's dtype, each row independent of the others."""
    # No native form: a vendor GEMM's rows are what this kernel exists to replace (Triton on an NPU too).
    if runnable("invariant_linear", x.device, None, use_triton(x, weight)) == TRITON:
        return invariant_linear_triton(x, weight)
    return invariant_linear_reference(x, weight)


def invariant_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    rows = [F.linear(flat[i : i + 1], weight) for i in range(flat.shape[0])]
    out = torch.cat(rows) if rows else flat.new_empty(0, weight.shape[0])
    return out.view(*x.shape[:-1], weight.shape[0])


def invariant_tiles(n: int, k: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BM, BN, BK) for a weight [N, K]: a function of the weight alone, never of the rows."""
    bk = 32 if dtype == torch.float32 else 128
    bn = WIDE_BN if n >= 64 * WIDE_BN else NARROW_BN
    return BM, bn, bk


# NPU budget: x tile [16, 128] and weight tile [64, 128] bf16 (4 + 16 KiB) and the fp32 accumulator [16, 64]
# (4 KiB).
@jit
def _invariant_linear_kernel(x, w, y, M, N, K, sx_m, sw_n, sy_m, BM: tl.constexpr, BN: tl.constexpr,
                             BK: tl.constexpr, IEEE: tl.constexpr):
    """Program (column tile, row tile): y[rows, cols] = sum over K tiles, in order, of x_tile @ w_tile^T."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    m_ok, n_ok = rm < M, rn < N
    x_rows = x + rm[:, None].to(tl.int64) * sx_m
    w_rows = w + rn[:, None].to(tl.int64) * sw_n
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = k0 + rk < K
        a = tl.load(x_rows + k0 + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_rows + k0 + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    tl.store(y + rm[:, None].to(tl.int64) * sy_m + rn[None, :], acc.to(y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def invariant_linear_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The Triton kernel behind invariant_linear (any device; CPU tensors run in Triton's interpreter)."""
    lead, k = x.shape[:-1], x.shape[-1]
    flat = unit_last_stride(x.reshape(-1, k))
    weight = unit_last_stride(weight)
    m, n = flat.shape[0], weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk = invariant_tiles(n, k, x.dtype)
    if m:
        launch(_invariant_linear_kernel, (_cdiv(n, bn), _cdiv(m, bm)), flat, weight, y, m, n, k,
               flat.stride(0), weight.stride(0), y.stride(0), BM=bm, BN=bn, BK=bk, IEEE=x.dtype == torch.float32,
               **launch_options(x.device, num_warps=4, num_stages=4))
    return y.view(*lead, n)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
