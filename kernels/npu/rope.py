"""Rotate-half RoPE on the first rotary dims of each head through npu_rotary_mul, and Qwen3.5's per-head q / k
RMSNorm before it through npu_gemma_rms_norm."""

from __future__ import annotations

import torch

from npuport.kernels.npu import operators as ops
from npuport.kernels.npu.norms import rms_norm_native, rms_norm_refusal
from npuport.kernels.npu.operators import FLOATS, documented_dtype, first_refusal

# npu_rotary_mul's documented limits in half mode (jit_compile=False): D < 896 and even, B and N below 1000.
ROTARY_MAX_DIM = 896
ROTARY_MAX_BATCH_HEADS = 1000


def rope_refusal(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """The documented constraint of npu_rotary_mul that apply_rope(x, cos, sin) breaks, or None."""
    rot = cos.shape[-1]
    return first_refusal(
        (x.dim() == 4 and cos.shape == sin.shape == (*x.shape[:2], rot), "npu_rotary_mul takes BSND with BS1D tables"),
        (documented_dtype(x.dtype, FLOATS) and cos.dtype == sin.dtype == x.dtype,
         f"npu_rotary_mul takes bf16 / fp16 / fp32 alike, not {x.dtype} with {cos.dtype} tables"),
        (rot % 2 == 0 and 0 < rot < ROTARY_MAX_DIM and rot <= x.shape[-1], f"npu_rotary_mul needs an even D < 896, "
                                                                           f"not {rot}"),
        (x.shape[0] < ROTARY_MAX_BATCH_HEADS and x.shape[2] < ROTARY_MAX_BATCH_HEADS,
         "npu_rotary_mul takes B and N below 1000"),
    )


def apply_rope_native(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, D] with its first rot = cos.shape[-1] dims rotated (cos, sin [B, T, rot]), the rest passed
    through: npu_rotary_mul on the rotary dims (a contiguous copy), the tables as [B, T, 1, rot]."""
    rot = cos.shape[-1]
    rotated = ops.npu_operators().npu_rotary_mul(x[..., :rot].contiguous(), cos[:, :, None], sin[:, :, None])
    if rot == x.shape[-1]:
        return rotated
    return torch.cat([rotated, x[..., rot:]], dim=-1)


def rms_norm_rope_refusal(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                          ) -> str | None:
    return rms_norm_refusal(x, weight) or rope_refusal(x, cos, sin)


def rms_norm_rope_native(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
                         ) -> torch.Tensor:
    """apply_rope(rms_norm(x, weight, eps), cos, sin) for x [B, T, heads, D] (any strides): two operators, the norm
    rounded to x's dtype in between (as the reference rounds it)."""
    return apply_rope_native(rms_norm_native(x, weight, eps), cos, sin)
