"""RMSNorm as Qwen3.5 computes it: y = x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32 (float64 for float64
inputs), rounded once to x's dtype - one Triton launch per call instead of the half-dozen elementwise and
reduction kernels of the PyTorch version beside it. Rows are independent: a row's result does not depend on
how many rows are in the call."""

from __future__ import annotations

import torch

from npuport.kernels.launch import jit, launch, launch_options, next_power_of_2, persistent_grid, tl, use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] (the zero-centred weight: the scale is 1 + w) -> [..., N] in x's dtype."""
    if use_triton(x, weight):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    wide = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(wide)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.to(wide))).to(x.dtype)


# NPU budget: one row of up to 8192 values in fp32 and the weight: 64 KiB at N = 8192, 40 KiB at 5120.
@jit
def _rms_norm_kernel(x, w, out, M, N, sx_m, so_m, eps, BN: tl.constexpr):
    cols = tl.arange(0, BN)
    ok = cols < N
    scale = 1.0 + tl.load(w + cols, mask=ok, other=0.0).to(tl.float32)
    for row in range(tl.program_id(0), M, tl.num_programs(0)):
        xf = tl.load(x + tl.cast(row, tl.int64) * sx_m + cols, mask=ok, other=0.0).to(tl.float32)
        y = xf * tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
        tl.store(out + tl.cast(row, tl.int64) * so_m + cols, (y * scale).to(out.dtype.element_ty), mask=ok)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton kernel behind rms_norm (any device; CPU tensors run in Triton's interpreter)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    block = next_power_of_2(n)
    launch(_rms_norm_kernel, persistent_grid(x.device, rows.shape[0]), rows, weight, out, rows.shape[0], n,
           rows.stride(0), out.stride(0), eps, BN=block,
           **launch_options(x.device, num_warps=8 if block >= 4096 else 4 if block >= 1024 else 1))
    return out.view(x.shape)
