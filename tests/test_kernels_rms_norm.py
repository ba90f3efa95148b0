"""RMSNorm's Triton kernel against its PyTorch reference, through Triton's interpreter: fp32 sums in another
order, so equal to a few fp32 ulps, and the same bf16 values but for rare rounding boundaries."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from npuport.kernels.rms_norm import rms_norm_reference, rms_norm_triton  # noqa: E402


@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 2048), (2, 7, 4, 256), (17, 5120), (2, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel_equals_the_reference(shape, dtype):
    gen = torch.Generator().manual_seed(shape[-1])
    x = (3 * torch.randn(shape, generator=gen)).to(dtype)
    w = (0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    got, want = rms_norm_triton(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:
        assert (got == want).float().mean() >= 0.99
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=8e-3)


def test_a_non_contiguous_input_is_normalised_by_rows():
    x = torch.randn(4, 6, 32).transpose(0, 1)  # rows of 32 in a strided view
    w = torch.randn(32) * 0.1
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), rtol=2e-6, atol=2e-6)
