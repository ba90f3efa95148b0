"""The Triton causal conv1d kernels (prefill and decode / verify update) against their references, run on
CPU tensors through Triton's interpreter. Tolerances: fp32 1e-5; bf16 inputs are compared with the reference
on the same values in fp32 (the kernel rounds once, at the end): 1e-2 relative, one bf16 step. Windows are
copies and must match exactly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from npuport.kernels.causal_conv1d import (  # noqa: E402
    causal_conv1d_fn_reference,
    causal_conv1d_fn_triton,
    causal_conv1d_update_reference,
    causal_conv1d_update_triton,
)

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2}}


def inputs(gen, b, t, d, w, length, dtype):
    x = torch.randn(b, t, d, generator=gen).to(dtype)
    weight = torch.randn(d, w, generator=gen).to(dtype)
    window = torch.randn(b, d, length, generator=gen).to(dtype)
    return x, weight, window


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "d", "length"), [(37, 200, 6), (5, 64, 3), (1, 130, 7)])
def test_prefill_kernel_matches_the_reference(dtype, t, d, length):
    gen = torch.Generator().manual_seed(t * d)
    x, weight, window = inputs(gen, 3, t, d, 4, length, dtype)
    n_valid = torch.tensor([t, max(1, t // 3), 0])
    got_window, want_window = window.clone(), window.clone()
    out = causal_conv1d_fn_triton(x, weight, got_window, n_valid)
    want = causal_conv1d_fn_reference(x.float(), weight.float(), window.float().clone(), n_valid)
    causal_conv1d_fn_reference(x, weight, want_window, n_valid)
    assert out.dtype == dtype
    for b, n in enumerate(n_valid.tolist()):  # rows past n_valid are junk
        torch.testing.assert_close(out[b, :n].float(), want[b, :n], **TOL[dtype])
    assert torch.equal(got_window, want_window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "k"), [(1, 0), (1, 3), (2, 3), (4, 3), (5, 4)])
def test_update_kernel_matches_the_reference(dtype, t, k):
    gen = torch.Generator().manual_seed(10 * t + k)
    x, weight, window = inputs(gen, 2, t, 96, 4, 3 + k, dtype)  # window of (W - 1) + k columns
    got_window, want_window = window.clone(), window.clone()
    out = causal_conv1d_update_triton(x, weight, got_window)
    want = causal_conv1d_update_reference(x.float(), weight.float(), window.float().clone())
    causal_conv1d_update_reference(x, weight, want_window)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])
    assert torch.equal(got_window, want_window)


def test_update_reads_a_window_from_a_strided_batch():
    gen = torch.Generator().manual_seed(7)
    x, weight, window = inputs(gen, 4, 2, 32, 4, 5, torch.float32)
    big = torch.randn(8, 32, 5, generator=gen)
    big[::2] = window
    view = big[::2]  # every other request of a larger batch
    want_window = window.clone()
    out = causal_conv1d_update_triton(x, weight, view)
    want = causal_conv1d_update_reference(x, weight, want_window)
    torch.testing.assert_close(out, want, **TOL[torch.float32])
    torch.testing.assert_close(big[::2], want_window)
