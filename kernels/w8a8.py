"""W8A8_DYNAMIC matmul: per-token symmetric int8 activation quantization, int8 x int8 -> int32 matmul, and the
rescale by activation and weight scales (CONTRACT.md: x_q = round(x / s_x), s_x = max|x_row| / 127,
y = (x_q @ W_q^T) * s_x * s_w).
"""

from __future__ import annotations

import torch

QMAX = 127
# An all-zero row would get scale 0; any positive scale quantizes it to zeros, so floor it.
SCALE_FLOOR = 1e-12


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> x_q int8 [M, K], x_scale fp32 [M, 1] (round half to even)."""
    return quantize_per_token_int8_reference(x)


def int8_matmul_rescale(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """x_q int8 [M, K], x_scale fp32 [M, 1], w_q int8 [N, K], w_scale fp32 [N, 1] -> y [M, N] in out_dtype:
    the exact int32 product, rescaled in fp32 (float64 for a float64 out_dtype)."""
    return int8_matmul_rescale_reference(x_q, x_scale, w_q, w_scale, out_dtype)


def quantize_per_token_int8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / QMAX).clamp_min(SCALE_FLOOR)
    x_q = (xf / scale).round().clamp(-QMAX - 1, QMAX).to(torch.int8)
    return x_q, scale


def int8_matmul_rescale_reference(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    # int32 accumulation is exact for K < 2**31 / 128**2 = 131072, far beyond any hidden size here.
    acc = x_q.to(torch.int32) @ w_q.to(torch.int32).T  # [M, N] int32
    rescale = torch.promote_types(out_dtype, torch.float32)
    y = acc.to(rescale) * x_scale.to(rescale) * w_scale.to(rescale).T
    return y.to(out_dtype)
