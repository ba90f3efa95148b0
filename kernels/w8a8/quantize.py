"""Per-token symmetric int8 quantization of activations: the Triton kernel, its launch choices and dispatcher."""

from __future__ import annotations

import torch

from npuport.kernels.implementations import NATIVE, TRITON, runnable
from npuport.kernels.launch import (
    dependent_launch,
    is_gpu,
    jit,
    launch,
    launch_options,
    next_power_of_2,
    persistent_grid,
    start_dependent_kernel,
    tl,
    unit_last_stride,
    use_triton,
)
from npuport.kernels.npu import w8a8 as native
from npuport.kernels.w8a8.naive import quantize_per_token_int8_reference


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> x_q int8 [M, K], x_scale fp32 [M, 1] (round half to even)."""
    chosen = runnable("w8a8_quantize", x.device, lambda: native.quantize_refusal(x), use_triton(x))
    if chosen == NATIVE:
        return native.quantize_per_token_int8_native(x)
    if chosen == TRITON:
        return quantize_per_token_int8_triton(x)
    return quantize_per_token_int8_reference(x)


@jit
def _div_rn(x, y):
    """x / y rounded to nearest, as the reference's IEEE division, from a GPU's division (within a few ulps):
    two corrections of the quotient by its exact residual x - q y (an fma)."""
    q = x / y
    inv = 1.0 / y
    q = tl.fma(tl.fma(-q, y, x), inv, q)
    return tl.fma(tl.fma(-q, y, x), inv, q)


@jit
def token_scale(amax):
    """A row's scale from its absolute maximum (fp32): amax / 127 rounded as IEEE division, floored at 1e-12."""
    return tl.maximum(_div_rn(amax, 127.0), 1e-12)


@jit
def to_int8_values(x, scale):
    """x (fp32) / scale rounded half to even and clamped to [-128, 127], as int32: the reference's quantized
    values, exactly (y - floor(y) is exact for |y| <= 128)."""
    y = _div_rn(x, scale)
    whole = tl.floor(y)
    frac = y - whole
    q = whole.to(tl.int32)
    q += ((frac > 0.5) | ((frac == 0.5) & ((q & 1) == 1))).to(tl.int32)
    return tl.minimum(tl.maximum(q, -128), 127)


# NPU budget: one [BLOCK_K] fp32 row slice, 4096 x 4 B x 3 live = 48 KiB.
@jit
def _quantize_kernel(x, x_q, x_scale, M, K, sx_m, sq_m, BLOCK_K: tl.constexpr, START_GEMM: tl.constexpr):
    """START_GEMM (GPU only): let the GEMM launched after it as dependent start right away."""
    if START_GEMM:
        start_dependent_kernel()
    cols = tl.arange(0, BLOCK_K)
    for row in range(tl.program_id(0), M, tl.num_programs(0)):
        x_row = x + tl.cast(row, tl.int64) * sx_m
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            part = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(part))
        scale = token_scale(tl.max(amax, 0))
        tl.store(x_scale + row, scale)
        for k0 in range(0, K, BLOCK_K):
            ok = k0 + cols < K
            q = to_int8_values(tl.load(x_row + k0 + cols, mask=ok, other=0.0).to(tl.float32), scale)
            tl.store(x_q + tl.cast(row, tl.int64) * sq_m + k0 + cols, q.to(tl.int8), mask=ok)


def quantize_per_token_int8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel behind quantize_per_token_int8 (any device; CPU tensors run in Triton's interpreter)."""
    x = unit_last_stride(x)
    m, k = x.shape
    x_q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    x_scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    block_k, warps = quantize_launch(m, k, x.device)
    launch(_quantize_kernel, persistent_grid(x.device, m), x, x_q, x_scale, m, k, x.stride(0), x_q.stride(0),
           BLOCK_K=block_k, START_GEMM=gemm_overlaps_quantization(m, x.device),
           **launch_options(x.device, num_warps=warps))
    return x_q, x_scale


# Up to this many rows a GPU quantizes with few, wide programs (one per row, latency-bound), and the GEMM
# overlaps the quantization where the GPU can (gemm_overlaps_quantization).
FEW_ROWS = 64


def gemm_overlaps_quantization(m: int, device: torch.device) -> bool:
    """Whether the GEMM of M rows launches as dependent on the quantization before it (launch.dependent_launch):
    with few rows on a GPU that can. With many rows the waiting GEMM programs would hold SMs the quantization
    needs (measured: slower from M = 128..256 on, bench/RESULTS.md)."""
    return m <= FEW_ROWS and dependent_launch(device)


def quantize_launch(m: int, k: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_K, warps) of the quantization of [M, K]. Slices of at most 4096 on 4-8 warps; on a GPU with few rows
    the row in one or two slices of up to 8192 on 16 or 32 warps, which took 2-7% off quantize + GEMM at
    M = 1..64 on an H200 (bench/RESULTS.md). The NPU keeps 4096 (its on-chip budget, at the kernel)."""
    full = max(16, next_power_of_2(k))
    if is_gpu(device) and m <= FEW_ROWS:
        return (min(8192, full), 16) if k <= 8192 else (4096, 32)
    block_k = min(4096, full)
    return block_k, 8 if block_k >= 2048 else 4
