"""The batch-invariant linear kernel (kernels/invariant_linear.py), in Triton's interpreter: each row's bits are the
same alone and among any number of other rows at any position, and the values are PyTorch's F.linear within
the rounding of the output dtype. float32 only for its values here: the interpreter runs an fp32 tl.dot through
numpy's BLAS, whose micro-kernels treat a tile's rows by their position; the GPU test checks its bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from npuport.kernels.invariant_linear import invariant_linear_reference, invariant_linear_triton


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "k"), [(70, 200), (8, 64)])
def test_a_row_has_the_same_bits_alone_and_in_any_batch(dtype, n, k):
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(40, k, generator=gen).to(dtype)
    alone = torch.cat([invariant_linear_triton(x[i : i + 1], weight) for i in range(len(x))])
    want = F.linear(x.double(), weight.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(alone.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    if dtype == torch.float32:
        return
    for rows in (slice(0, 1), slice(0, 3), slice(5, 22), slice(0, 40), slice(23, 40)):
        assert torch.equal(invariant_linear_triton(x[rows], weight), alone[rows]), rows
    shuffled = torch.randperm(len(x), generator=gen)
    assert torch.equal(invariant_linear_triton(x[shuffled], weight), alone[shuffled])


def test_the_reference_is_f_linear_row_by_row_and_keeps_leading_dims():
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(12, 16, generator=gen), torch.randn(2, 3, 16, generator=gen)
    got = invariant_linear_reference(x, weight)
    assert got.shape == (2, 3, 12)
    assert torch.equal(got[1, 2], F.linear(x[1, 2][None], weight)[0])
    assert torch.equal(invariant_linear_triton(x, weight)[1], invariant_linear_triton(x[1], weight))
