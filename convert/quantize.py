"""The W8A8_DYNAMIC weight math, bit for bit as msModelSlim computes it (CONTRACT.md): per output
channel, symmetric int8, min-max, every step rounded to the weight's own dtype (BF16 for Qwen3.5).

Each BF16 step is computed in float32 and rounded once to BF16. For a division of two BF16 numbers that
is the correctly rounded BF16 quotient: float32 carries 24 significand bits >= 2 * 8 + 2, so rounding
twice cannot differ from rounding once. This is also how torch evaluates a BF16 division.
"""

from __future__ import annotations

import torch

SCALE_FLOOR = 2.0**-23  # float32 machine epsilon; exact in bf16
QMIN, QMAX = -128, 127


def per_channel_scale(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> scale [N] in w's dtype: max(round(max|w_row| / 127), 2**-23)."""
    m = w.abs().amax(dim=1)  # exact: absolute value and maximum never round
    scale = (m.float() / QMAX).to(w.dtype)
    return scale.clamp_min(SCALE_FLOOR)


def quantize_rows(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w [N, K], scale [N] -> int8 [N, K]: round_half_even(round_to_dtype(w / scale)), clamped to int8."""
    y = (w.float() / scale.float()[:, None]).to(w.dtype)  # the quotient is rounded BEFORE integer rounding
    return y.float().round_().clamp_(QMIN, QMAX).to(torch.int8)  # torch.round is half-to-even


def quantize_per_channel_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (BF16) -> (weight int8 [N, K], weight_scale float32 [N, 1], weight_offset float32 [N, 1] zeros)."""
    scale = per_channel_scale(w)
    q = quantize_rows(w, scale)
    return q, scale.float()[:, None], torch.zeros(w.shape[0], 1, dtype=torch.float32)
