"""RMSNorm with Qwen3.5's (1 + w) scale through npu_gemma_rms_norm (Gemma's form), with the residual add in front."""

from __future__ import annotations

import torch

from npuport.kernels.npu import operators as ops
from npuport.kernels.npu.operators import FLOATS, documented_dtype, first_refusal


def rms_norm_refusal(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """The documented constraint of npu_gemma_rms_norm that rms_norm(x, weight) breaks, or None."""
    return first_refusal(
        (documented_dtype(x.dtype, FLOATS), f"npu_gemma_rms_norm takes bf16 / fp16 / fp32, not {x.dtype}"),
        (weight.dtype == x.dtype, "npu_gemma_rms_norm wants gamma in the input's dtype"),
        (1 <= x.dim() <= 8 and x.numel() > 0, "npu_gemma_rms_norm takes 1-8 dims, not empty"),
    )


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] (zero-centred: the scale is 1 + w) -> [..., N] in x's dtype (contiguous)."""
    return ops.npu_operators().npu_gemma_rms_norm(x.contiguous(), weight.contiguous(), epsilon=eps)[0]


def add_rms_norm_refusal(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> str | None:
    """The constraint add_rms_norm(x, residual, weight) breaks (the add's and npu_gemma_rms_norm's), or None."""
    if x.dtype != residual.dtype or x.shape != residual.shape:
        return "the residual add wants x and residual of one dtype and shape"
    return rms_norm_refusal(x, weight)


def add_rms_norm_native(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the sum rounded to x's dtype (a plain add), then npu_gemma_rms_norm
    (torch-npu's add-and-norm operators scale by w, not 1 + w)."""
    summed = x + residual
    return rms_norm_native(summed, weight, eps), summed
