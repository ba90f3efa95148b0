"""The depthwise causal conv1d (no bias) + SiLU in front of a GatedDeltaNet, with a window of past inputs.

A window holds the last L inputs of each channel, oldest first: `window [B, D, L]` (D channels, L columns,
L >= W - 1 for a kernel of width W). The conv of a new token reads the W - 1 newest columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_fn(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor, n_valid: torch.Tensor
) -> torch.Tensor:
    """Prefill. x [B, T, D] new inputs (right-padded), weight [D, W], window [B, D, L] the inputs before x,
    n_valid [B] real tokens per row. Returns silu(conv) [B, T, D] (rows past n_valid are junk) and
    leaves in `window` the last L inputs up to each row's last real token."""
    return causal_conv1d_fn_reference(x, weight, window, n_valid)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Decode / verify. x [B, T, D] new inputs, weight [D, W], window [B, D, L]. Returns silu(conv) [B, T, D];
    `window` keeps the last L inputs, the T new ones included (first in, first out)."""
    return causal_conv1d_update_reference(x, weight, window)


def _conv_silu(history: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(conv) of x [B, T, D] given the W - 1 inputs before it, history [B, D, W - 1]."""
    d = weight.shape[0]
    full = torch.cat([history, x.transpose(1, 2)], dim=-1)  # [B, D, W - 1 + T]
    out = F.conv1d(full, weight.unsqueeze(1), groups=d)  # [B, D, T]
    return F.silu(out).transpose(1, 2)


def causal_conv1d_fn_reference(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor, n_valid: torch.Tensor
) -> torch.Tensor:
    length, w = window.shape[-1], weight.shape[1]
    out = _conv_silu(window[..., length - (w - 1):], x, weight)
    joined = torch.cat([window, x.transpose(1, 2).to(window.dtype)], dim=-1)  # [B, D, L + T]
    cols = n_valid.to(torch.long)[:, None] + torch.arange(length, device=x.device)  # [B, L]
    window.copy_(joined.gather(-1, cols[:, None, :].expand(-1, joined.shape[1], -1)))
    return out


def causal_conv1d_update_reference(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    all_valid = torch.full((x.shape[0],), x.shape[1], dtype=torch.long, device=x.device)
    return causal_conv1d_fn_reference(x, weight, window, all_valid)
