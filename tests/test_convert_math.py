"""The W8A8_DYNAMIC weights equal an independent re-implementation of CONTRACT.md's math, written here
in float64 numpy with explicit round-to-bf16 (frexp), not in torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from npuport.convert.quantize import quantize_per_channel_int8


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Round float64 values to the nearest bfloat16 (8 significant bits), ties to even.
    float64 holds every exact quotient to 53 bits (>= 2*8+2), so this equals rounding the real value."""
    mant, exp = np.frexp(x)  # x = mant * 2**exp, 0.5 <= |mant| < 1
    return np.ldexp(np.round(mant * 256.0), exp - 8)  # np.round is half-to-even


def reference_w8a8(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """CONTRACT.md, step by step: (int8 [N, K], float32 scale [N, 1])."""
    x = w.float().numpy().astype(np.float64)  # bf16 -> float64 is exact
    m = np.maximum(-np.minimum(x, 0), np.maximum(x, 0)).max(axis=1)
    scale = np.maximum(bf16_round(m / 127.0), 2.0**-23)
    y = bf16_round(x / scale[:, None])
    q = np.clip(np.round(y), -128, 127).astype(np.int8)
    return q, scale.astype(np.float32)[:, None]


def crafted_weight() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    w[0] = 0  # all-zero row: scale 2**-23 and zeros, never NaN
    w[1] = torch.tensor([-1.0, 0.5, 0.25] * 32)  # max |w| at a negative value
    w[2] = torch.linspace(-3, 3, 96).to(torch.bfloat16)
    w[3, :] = 1e-30  # tiny row: scale floored at 2**-23
    return w


def test_quantized_weight_equals_reference_bit_for_bit():
    w = crafted_weight()
    q, scale, offset = quantize_per_channel_int8(w)
    ref_q, ref_scale = reference_w8a8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and offset.dtype == torch.float32
    np.testing.assert_array_equal(q.numpy(), ref_q)
    np.testing.assert_array_equal(scale.numpy().view(np.int32), ref_scale.view(np.int32))
    assert not offset.any()
    assert scale[0, 0] == 2.0**-23 and not q[0].any()
    assert scale[3, 0] == 2.0**-23


def test_reference_is_sensitive_to_the_documented_pitfalls():
    """Half-away rounding or a float32 quotient would change many values, so the equality above means something."""
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q, scale, _ = quantize_per_channel_int8(w)
    x = w.float().numpy().astype(np.float64)
    y = bf16_round(x / scale.numpy().astype(np.float64))
    half_away = np.clip(np.sign(y) * np.floor(np.abs(y) + 0.5), -128, 127)
    f32_quotient = np.clip(np.round((x / scale.numpy()).astype(np.float32)), -128, 127)
    assert (half_away != q.numpy()).mean() > 0.05
    assert (f32_quotient != q.numpy()).mean() > 0.05
    assert (q == -128).any(), "scales rounding below max/127 make -128 occur"
    np.testing.assert_array_equal(q.numpy(), reference_w8a8(w)[0])


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (130, 33)])
def test_odd_shapes(shape):
    w = (torch.randn(*shape, generator=torch.Generator().manual_seed(3)) * 5).to(torch.bfloat16)
    q, scale, _ = quantize_per_channel_int8(w)
    ref_q, ref_scale = reference_w8a8(w)
    np.testing.assert_array_equal(q.numpy(), ref_q)
    np.testing.assert_array_equal(scale.numpy(), ref_scale)
