"""W8A8_DYNAMIC in plain PyTorch: per-token int8 quantization and the exact int8 product with its rescale, the
references the Triton kernels of this package (and of fused_moe) are tested against."""

from __future__ import annotations

import torch

from npuport.kernels.launch import is_cpu

QMAX = 127
# An all-zero row would get scale 0; any positive scale quantizes it to zeros, so floor it.
SCALE_FLOOR = 1e-12


def quantize_per_token_int8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    scale = scale_from_amax_reference(xf.abs().amax(dim=-1, keepdim=True))
    return quantize_with_scale_reference(xf, scale), scale


def scale_from_amax_reference(amax: torch.Tensor) -> torch.Tensor:
    """Per-token scales fp32 [M, 1] from each row's absolute maximum fp32 [M, 1]: amax / 127, floored."""
    # A true division: on CUDA, dividing by a Python number multiplies by its reciprocal instead (an ulp off).
    return (amax / torch.full_like(amax, QMAX)).clamp_min(SCALE_FLOOR)


def quantize_with_scale_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> int8 [M, K]: round(x / scale) (half to even) with the given per-token scales fp32 [M, 1]."""
    return (x.float() / scale).round().clamp(-QMAX - 1, QMAX).to(torch.int8)


def int8_matmul_rescale_reference(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    # int32 accumulation is exact for K < 2**31 / 128**2 = 131072, far beyond any hidden size here. GPUs have
    # no int32 matmul in torch: there float64 holds the same sums exactly (|sum| < 2**31 < 2**53).
    if is_cpu(x_q.device):
        acc = x_q.to(torch.int32) @ w_q.to(torch.int32).T  # [M, N] int32
    else:
        acc = (x_q.double() @ w_q.double().T).to(torch.int32)
    rescale = torch.promote_types(out_dtype, torch.float32)
    y = acc.to(rescale) * x_scale.to(rescale) * w_scale.to(rescale).T
    return y.to(out_dtype)
