"""The Triton gating kernel against its reference, run on CPU tensors through Triton's interpreter.
Tolerance: fp32 math on both sides, 1e-6 relative (exp / log rounding)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from npuport.kernels.gdn_gating import fused_gdn_gating_reference, fused_gdn_gating_triton  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 5, 4), (1, 1, 48), (3, 70, 6)])
def test_gating_kernel_matches_the_reference(dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    hv = shape[-1]
    a_log, dt_bias = torch.randn(hv, generator=gen), torch.randn(hv, generator=gen)
    a = (12 * torch.randn(*shape, generator=gen)).to(dtype)  # both sides of the softplus threshold
    b = (4 * torch.randn(*shape, generator=gen)).to(dtype)
    g, beta = fused_gdn_gating_triton(a_log, a, dt_bias, b)
    want_g, want_beta = fused_gdn_gating_reference(a_log, a, dt_bias, b)
    assert g.dtype == beta.dtype == torch.float32 and g.shape == shape
    torch.testing.assert_close(g, want_g, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(beta, want_beta, rtol=1e-6, atol=1e-7)


def test_softplus_threshold_passes_large_inputs_through():
    a_log, dt_bias = torch.zeros(2), torch.zeros(2)
    a = torch.tensor([[[19.5, 25.0]]])
    g, _ = fused_gdn_gating_triton(a_log, a, dt_bias, torch.zeros_like(a))
    assert g[0, 0, 1].item() == -25.0
    torch.testing.assert_close(g[0, 0, 0], -torch.log1p(torch.exp(torch.tensor(19.5))), rtol=1e-6, atol=0)
