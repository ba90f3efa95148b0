"""The W8A8_DYNAMIC weight math, bit for bit as msModelSlim computes it (CONTRACT.md): per output
channel, symmetric int8, min-max, every step rounded to the weight's own dtype (BF16 for Qwen3.5).

The steps are torch operations in the weight's dtype, as msModelSlim runs them. torch evaluates a BF16
division in float32 and rounds once to BF16, which is the correctly rounded BF16 quotient (float32 carries
24 significand bits >= 2 * 8 + 2, so rounding twice cannot differ from rounding once); the tests check
this against a float64 reference.
"""

from __future__ import annotations

import torch

SCALE_FLOOR = 2.0**-23  # float32 machine epsilon; exact in bf16
QMIN, QMAX = -128, 127


def per_channel_scale(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> scale [N] in w's dtype: max(round(max|w_row| / 127), 2**-23)."""
    m = w.abs().amax(dim=1)  # exact: absolute value and maximum never round
    return (m / QMAX).clamp_min(SCALE_FLOOR)


def quantize_rows(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w [N, K], scale [N] -> int8 [N, K]: round_half_even(round_to_dtype(w / scale)), clamped to int8."""
    y = w / scale[:, None]  # rounded to w's dtype BEFORE integer rounding
    return y.round_().clamp_(QMIN, QMAX).to(torch.int8)  # half-to-even; integers up to 256 are exact in bf16


def quantize_per_channel_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (BF16) -> (weight int8 [N, K], weight_scale float32 [N, 1], weight_offset float32 [N, 1] zeros)."""
    scale = per_channel_scale(w)
    q = quantize_rows(w, scale)
    return q, scale.float()[:, None], torch.zeros(w.shape[0], 1, dtype=torch.float32)
