"""W8A8_DYNAMIC through npu_dynamic_quant (per-token int8 quantization) and npu_quant_matmul (the int8 product with
the per-token and per-channel rescale)."""

from __future__ import annotations

import torch

from npuport.kernels.npu import operators as ops
from npuport.kernels.npu.operators import BF16_FP16, documented_dtype, first_refusal
from npuport.kernels.w8a8.naive import SCALE_FLOOR

# npu_quant_matmul: the last dim of x1 (K) and of x2 (N) at most this.
QUANT_MATMUL_MAX_DIM = 65535


def quantize_refusal(x: torch.Tensor) -> str | None:
    """The documented constraint of npu_dynamic_quant that quantize_per_token_int8(x) breaks, or None."""
    return first_refusal(
        (documented_dtype(x.dtype, BF16_FP16), f"npu_dynamic_quant takes bf16 / fp16, not {x.dtype}"),
        (x.dim() == 2, "npu_dynamic_quant wants x of more than one dim; npuport's is [M, K]"),
    )


def quantize_per_token_int8_native(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> x_q int8 [M, K], x_scale fp32 [M, 1] (an all-zero row's scale floored, as npuport's contract
    says: its values are zeros either way)."""
    values, scale = ops.npu_operators().npu_dynamic_quant(x)
    return values, scale.reshape(-1, 1).clamp_min(SCALE_FLOOR)


def matmul_refusal(x_q: torch.Tensor, w_q: torch.Tensor, out_dtype: torch.dtype) -> str | None:
    """The documented constraint of npu_quant_matmul (per-token case) that int8_matmul_rescale breaks, or None."""
    return first_refusal(
        (x_q.dtype == w_q.dtype == torch.int8 and x_q.dim() == w_q.dim() == 2, "npu_quant_matmul takes int8 [M, K]"),
        (documented_dtype(out_dtype, BF16_FP16), f"npu_quant_matmul with pertoken_scale outputs bf16 / fp16, not "
                                                 f"{out_dtype}"),
        (x_q.shape[1] <= QUANT_MATMUL_MAX_DIM and w_q.shape[0] <= QUANT_MATMUL_MAX_DIM,
         "npu_quant_matmul takes K and N of at most 65535"),
    )


def int8_matmul_rescale_native(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                               out_dtype: torch.dtype) -> torch.Tensor:
    """x_q int8 [M, K], x_scale fp32 [M, 1], w_q int8 [N, K], w_scale fp32 [N, 1] -> [M, N] in out_dtype: the weight
    goes in as its transpose [K, N] (a view, as the documentation's examples pass it), the scales as 1-D."""
    return ops.npu_operators().npu_quant_matmul(x_q, w_q.t(), w_scale.reshape(-1).float(),
                                                pertoken_scale=x_scale.reshape(-1).float(), output_dtype=out_dtype)
