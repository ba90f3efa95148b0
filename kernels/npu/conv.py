"""The depthwise causal conv1d in front of a GatedDeltaNet through npu_fused_causal_conv1d, SiLU after it (the
operator's activation is documented as not supported yet). npuport's window [B, D, L] stays npuport's: the operator
gets a copy of its newest K - 1 columns as its conv states [B, K - 1, D], and the window is shifted here as the
reference shifts it. The documentation fixes K at 3 and lists only the Ascend 950: Qwen3.5's conv has width 4, so its
models step down to Triton; the wrapper serves a width-3 conv."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from npuport.kernels.npu import operators as ops
from npuport.kernels.npu.operators import BF16_FP16, documented_dtype, first_refusal

CONV_WIDTH = 3  # npu_fused_causal_conv1d: "K fixed at 3"
CHANNEL_ALIGN = 128  # dim % 128 == 0


def causal_conv1d_refusal(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor) -> str | None:
    """The documented constraint of npu_fused_causal_conv1d that a conv of x [B, T, D] with weight [D, W] over the
    window [B, D, L] breaks, or None."""
    return first_refusal(
        (weight.shape[1] == CONV_WIDTH, f"npu_fused_causal_conv1d has width {CONV_WIDTH}, not {weight.shape[1]}"),
        (x.shape[-1] % CHANNEL_ALIGN == 0, f"npu_fused_causal_conv1d wants channels a multiple of {CHANNEL_ALIGN}"),
        (documented_dtype(x.dtype, BF16_FP16) and weight.dtype == x.dtype,
         f"npu_fused_causal_conv1d takes bf16 / fp16, not {x.dtype}"),
        (window.shape[-1] >= CONV_WIDTH - 1, "the window holds fewer than K - 1 inputs"),
    )


def _conv_silu(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """silu(conv) [B, T, D] of x [B, T, D] after the window's newest W - 1 columns (left as they are)."""
    states = window[..., window.shape[-1] - (weight.shape[1] - 1):].transpose(1, 2).contiguous()  # [B, W - 1, D]
    y = ops.npu_operators().npu_fused_causal_conv1d(x.contiguous(), weight.t().contiguous(), states)
    return F.silu(y)


def causal_conv1d_update_native(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """causal_conv1d_update's call: x [B, T, D], weight [D, W], window [B, D, L] -> silu(conv) [B, T, D]; the window
    keeps its last L inputs, the T new ones included."""
    out = _conv_silu(x, weight, window)
    length = window.shape[-1]
    window.copy_(torch.cat([window, x.transpose(1, 2).to(window.dtype)], dim=-1)[..., -length:])
    return out


def causal_conv1d_fn_native(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor, n_valid: torch.Tensor
                            ) -> torch.Tensor:
    """causal_conv1d_fn's call (a prefill of right-padded x [B, T, D], n_valid [B] real tokens per row) -> silu(conv)
    [B, T, D]; the window keeps the last L inputs up to each row's last real token."""
    out = _conv_silu(x, weight, window)
    length = window.shape[-1]
    joined = torch.cat([window, x.transpose(1, 2).to(window.dtype)], dim=-1)  # [B, D, L + T]
    cols = n_valid.to(torch.long)[:, None] + torch.arange(length, device=x.device)  # [B, L]
    window.copy_(joined.gather(-1, cols[:, None, :].expand(-1, joined.shape[1], -1)))
    return out
