"""RMSNorm as Qwen3.5 computes it: y = x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32 (float64 for float64
inputs), rounded once to x's dtype - one Triton launch per call instead of the half-dozen elementwise and
reduction kernels of the PyTorch version beside it. Rows are independent: a row's result does not depend on
how many rows are in the call.

add_rms_norm fuses the residual add in front of it, the same way. sum_of_squares / inverse_rms are the row
statistic of the bit-exact fused norms (gated_rms_norm.py, rope.py): fp32 sums added in the order of PyTorch's
CPU sum, so that those kernels equal their references bit for bit."""

from __future__ import annotations

import torch

from npuport.kernels.implementations import NATIVE, TRITON, runnable
from npuport.kernels.launch import (
    jit,
    launch,
    launch_options,
    next_power_of_2,
    persistent_grid,
    tl,
    unit_last_stride,
    use_triton,
)
from npuport.kernels.npu import norms as native


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] (the zero-centred weight: the scale is 1 + w) -> [..., N] in x's dtype."""
    chosen = runnable("rms_norm", x.device, lambda: native.rms_norm_refusal(x, weight), use_triton(x, weight))
    if chosen == NATIVE:
        return native.rms_norm_native(x, weight, eps)
    if chosen == TRITON:
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    wide = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(wide)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.to(wide))).to(x.dtype)


# NPU budget: one row of up to 8192 values of x, the residual (when added) and the weight in fp32: 96 KiB at
# N = 8192, 60 KiB at 5120 - over the ~70 KiB multi-buffering leaves, so the NPU launch turns it off.
@jit
def _rms_norm_kernel(x, res, w, out, summed, M, N, sx_m, sr_m, so_m, ss_m, eps, BN: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr):
    """Per row: out = rms_norm(x) - or, HAS_RESIDUAL, summed = x + res rounded to summed's dtype (as PyTorch
    adds) and out = rms_norm(summed). A tree sum over the whole row, one pass."""
    cols = tl.arange(0, BN)
    ok = cols < N
    scale = 1.0 + tl.load(w + cols, mask=ok, other=0.0).to(tl.float32)
    for row in range(tl.program_id(0), M, tl.num_programs(0)):
        at = tl.cast(row, tl.int64)
        xf = tl.load(x + at * sx_m + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            s = (xf + tl.load(res + at * sr_m + cols, mask=ok, other=0.0).to(tl.float32)).to(summed.dtype.element_ty)
            tl.store(summed + at * ss_m + cols, s, mask=ok)
            xf = s.to(tl.float32)
        y = xf * tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
        tl.store(out + at * so_m + cols, (y * scale).to(out.dtype.element_ty), mask=ok)


def _rms_norm_rows(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """_rms_norm_kernel over the rows of x [..., N] (and residual, when given): (normed, summed or None)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    rows = unit_last_stride(rows)
    res = None if residual is None else unit_last_stride(residual.reshape(-1, n))
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    summed = None if res is None else torch.empty_like(out)
    block = next_power_of_2(n)
    launch(_rms_norm_kernel, persistent_grid(x.device, rows.shape[0]), rows, res, weight, out, summed,
           rows.shape[0], n, rows.stride(0), 0 if res is None else res.stride(0), out.stride(0),
           0 if summed is None else summed.stride(0), eps, BN=block, HAS_RESIDUAL=res is not None,
           **launch_options(x.device, num_warps=8 if block >= 4096 else 4 if block >= 1024 else 1,
                            npu={"multibuffer": False}))
    return out.view(x.shape), None if summed is None else summed.view(x.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton kernel behind rms_norm (any device; CPU tensors run in Triton's interpreter)."""
    return _rms_norm_rows(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., N] of one dtype, weight [N] (zero-centred) -> (rms_norm(x + residual), x + residual),
    both [..., N] in x's dtype; the sum is rounded to that dtype before it is normalised (as PyTorch adds)."""
    chosen = runnable("add_rms_norm", x.device, lambda: native.add_rms_norm_refusal(x, residual, weight),
                      use_triton(x, residual, weight) and x.dtype == residual.dtype and x.shape == residual.shape)
    if chosen == NATIVE:
        return native.add_rms_norm_native(x, residual, weight, eps)
    if chosen == TRITON:
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return rms_norm_reference(s, weight, eps), s


# PyTorch's CPU sum (ATen's SumKernel.cpp: on x86 its AVX2 kernel, which machines with AVX-512 run for sums
# too) adds a contiguous fp32 row as 8-lane vectors, 4 vectors a step, the steps in blocks of 16 whose sums
# cascade into coarser accumulators (blocks of 16 for rows under 2^24 values); then the leftover vectors, the
# 4 partial vectors, the tail past the last whole vector and the 8 lanes, one after the other. sum_of_squares
# adds in that order: fp32 additions round correctly on every device (on a GPU, once a multiply and an add are
# kept apart: exact_launch_options), so its sums, and so the kernels that use it, equal the references' bit for
# bit. tests/test_fused_norms.py pins the order: a PyTorch that sums otherwise fails it.
SUM_LANES = 8


@jit
def row_values(x, offs, ok):
    """fp32 values of a row at offs."""
    return tl.load(x + offs, mask=ok, other=0.0).to(tl.float32)


@jit
def _pick(v, index, i):
    """v[i] along axis 0 (index: that axis' arange, broadcastable to v): a sum of v[i] and zeros, so exact."""
    return tl.sum(tl.where(index == i, v, 0.0), axis=0)


@jit
def sum_of_squares(x, N: tl.constexpr):
    """The fp32 sum of squares of one row of N >= 8 values at x, in PyTorch's CPU order."""
    STEPS: tl.constexpr = N // 32
    BLOCKS: tl.constexpr = STEPS // 16
    vec = tl.arange(0, 4)[:, None]
    lane = tl.arange(0, 8)
    step = vec * 8 + lane[None, :]  # [4, 8]: the 4 vectors of 8 lanes one step adds
    step_ok = step < 32
    acc1 = tl.zeros([4, 8], dtype=tl.float32)
    acc2 = tl.zeros([4, 8], dtype=tl.float32)
    acc3 = tl.zeros([4, 8], dtype=tl.float32)
    # unrolled, so that a GPU issues every load of the row up front; only the adds wait on each other
    for block in tl.static_range(BLOCKS):
        acc0 = tl.zeros([4, 8], dtype=tl.float32)
        for j in tl.static_range(16):
            v = row_values(x, (block * 16 + j) * 32 + step, step_ok)
            acc0 += v * v
        acc1 += acc0
        if (block + 1) % 16 == 0:  # every 16 blocks acc1 moves into acc2, every 256 acc2 into acc3
            acc2 += acc1
            acc1 = tl.zeros([4, 8], dtype=tl.float32)
            if (block + 1) % 256 == 0:
                acc3 += acc2
                acc2 = tl.zeros([4, 8], dtype=tl.float32)
    acc0 = tl.zeros([4, 8], dtype=tl.float32)
    for j in tl.static_range(BLOCKS * 16, STEPS):
        v = row_values(x, j * 32 + step, step_ok)
        acc0 += v * v
    acc0 = acc0 + acc1
    acc0 = acc0 + acc2
    acc0 = acc0 + acc3
    partial = _pick(acc0, vec, 0)  # [8]
    for j in tl.static_range(STEPS * 4, N // 8):  # the 0-3 whole vectors after the last step
        v = row_values(x, j * 8 + lane, lane < 8)
        partial += v * v
    partial = partial + _pick(acc0, vec, 1)
    partial = partial + _pick(acc0, vec, 2)
    partial = partial + _pick(acc0, vec, 3)
    total = 0.0
    if N % 8 != 0:
        v = row_values(x, (N // 8) * 8 + lane, lane < N % 8)
        tail = v * v
        for j in tl.static_range(N % 8):
            total += _pick(tail, lane, j)
    for j in tl.static_range(8):
        total += _pick(partial, lane, j)
    return total


@jit
def inverse_rms(total, N: tl.constexpr, eps, lanes):
    """rsqrt(total / N + eps) as PyTorch's CPU mean and rsqrt round it: a true division by N, then 1 / sqrt,
    each correctly rounded (div_rn and sqrt_rn: the default GPU division and rsqrt are approximate) - the same value
    in every lane of `lanes` (the arange of the row's tiles): triton-ascend's adapter cannot lower a correctly
    rounded division of scalars, and Triton folds a tile of one splatted value back into a scalar one."""
    total = tl.where(lanes >= 0, total, 0.0)
    mean = tl.div_rn(total, tl.full([], N, tl.float32))
    return tl.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(mean + eps))


def exact_launch_options(device: torch.device, num_warps: int) -> dict:
    """launch_options for the bit-exact kernels: on a GPU, without fusing a multiply and an add into an fma
    (the references round the product first)."""
    return launch_options(device, num_warps=num_warps, contract=False)


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel behind add_rms_norm (any device; CPU tensors run in Triton's interpreter): rms_norm's
    kernel with the add in front, one pass over each row (within fp32 rounding of the reference, the same
    whatever the other rows; the exact-order sum of sum_of_squares took 2-4x longer on an H100)."""
    return _rms_norm_rows(x, residual, weight, eps)
