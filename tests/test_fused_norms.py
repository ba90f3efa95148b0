"""The fused norms' Triton kernels (add + RMSNorm, the gated GDN output norm, per-head RMSNorm + RoPE) against
their PyTorch references, through Triton's interpreter. The gated norm and the q/k norm + RoPE bit for bit,
torch.equal, in bf16 and float32 - they add the sum of squares in the order of PyTorch's CPU sum and compute exp
as its vectorized silu does; add + RMSNorm (a tree sum, for speed) its sum exactly and its norm within rounding.

The gated norm's rows are multiples of 32 values: PyTorch's CPU silu takes glibc's expf, not SLEEF's, for the
last (count mod 32) values of a contiguous run, so in float32 the reference itself gives other bits for the
same gate in another layout there (bf16 rounds the difference away)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import npuport.kernels.gated_rms_norm as gated_module  # noqa: E402
import npuport.kernels.launch as launch_module  # noqa: E402
import npuport.kernels.rms_norm as rms_norm_module  # noqa: E402
import npuport.kernels.rope as rope_module  # noqa: E402
from npuport.kernels.gated_rms_norm import gated_rms_norm, gated_rms_norm_reference, gated_rms_norm_triton  # noqa: E402
from npuport.kernels.rms_norm import add_rms_norm, add_rms_norm_reference, add_rms_norm_triton  # noqa: E402
from npuport.kernels.rope import rms_norm_rope, rms_norm_rope_reference, rms_norm_rope_triton  # noqa: E402

EPS = 1e-6
DTYPES = [torch.bfloat16, torch.float32]


def random(gen: torch.Generator, *shape: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (scale * torch.randn(shape, generator=gen)).to(dtype)


def assert_normed_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """add_rms_norm's normalised output: a tree sum, so within fp32 rounding of the reference (float32), or
    the same bf16 value but for a rare rounding-boundary neighbour (bf16)."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:
        assert (got == want).float().mean() >= 0.99
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("rows, n", [(1, 32), (3, 64), (17, 128), (3, 48), (2, 2048), (1, 5)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_kernel_equals_the_reference(rows, n, dtype):
    """The sum exactly (one rounding, as PyTorch adds), the norm within rounding; each row the same alone."""
    gen = torch.Generator().manual_seed(rows * n)
    x, residual = random(gen, rows, n, scale=3, dtype=dtype), random(gen, rows, n, scale=3, dtype=dtype)
    w = random(gen, n, scale=0.1, dtype=dtype)
    (normed, summed), (want_normed, want_summed) = (add_rms_norm_triton(x, residual, w, EPS),
                                                    add_rms_norm_reference(x, residual, w, EPS))
    assert normed.dtype == summed.dtype == dtype and normed.shape == summed.shape == x.shape
    assert torch.equal(summed, want_summed)
    assert_normed_close(normed, want_normed)
    alone = add_rms_norm_triton(x[-1:], residual[-1:], w, EPS)
    assert torch.equal(alone[0], normed[-1:]) and torch.equal(alone[1], summed[-1:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_takes_strided_rows(dtype):
    gen = torch.Generator().manual_seed(1)
    x = random(gen, 2, 3, 96, scale=3, dtype=dtype)[..., :64]  # rows 96 apart
    residual = random(gen, 3, 2, 64, scale=3, dtype=dtype).transpose(0, 1)
    w = random(gen, 64, scale=0.1, dtype=dtype)
    got, want = add_rms_norm_triton(x, residual, w, EPS), add_rms_norm_reference(x, residual, w, EPS)
    assert torch.equal(got[1], want[1])
    assert_normed_close(got[0], want[0])


# Value heads of 32 to 128 dims; 96 is the width that is not a power of two (see the module docstring).
@pytest.mark.parametrize("rows, heads, n", [(1, 1, 32), (3, 1, 64), (17, 1, 128), (3, 1, 96), (2, 3, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_kernel_equals_the_reference_bit_for_bit(rows, heads, n, dtype):
    gen = torch.Generator().manual_seed(rows * heads * n)
    x = random(gen, rows, heads, n, dtype=dtype)
    # the gate as the model slices it out of a stacked projection: heads of n values, rows further apart
    stacked = random(gen, rows, heads * n + 16, scale=3, dtype=dtype)
    gate = stacked[:, 16:].view(rows, heads, n)
    w = random(gen, n, dtype=dtype) * 0.1 + 1
    got, want = gated_rms_norm_triton(x, gate, w, EPS), gated_rms_norm_reference(x, gate, w, EPS)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, want)
    contiguous = gate.contiguous()
    assert torch.equal(gated_rms_norm_triton(x, contiguous, w, EPS), gated_rms_norm_reference(x, contiguous, w, EPS))


def test_gated_rms_norm_rounds_a_float32_weight_product_as_pytorch_does():
    """bf16 activations with a float32 weight: the product is float32, not rounded to bf16."""
    gen = torch.Generator().manual_seed(2)
    x, gate = random(gen, 3, 64, dtype=torch.bfloat16), random(gen, 3, 64, scale=3, dtype=torch.bfloat16)
    w = random(gen, 64) * 0.1 + 1
    assert torch.equal(gated_rms_norm_triton(x, gate, w, EPS), gated_rms_norm_reference(x, gate, w, EPS))


# Qwen3.5 rotates a quarter of each head (head_dim 256, rotary 64): D = 64 with rot 16, and a full rotation.
@pytest.mark.parametrize("d, rot", [(64, 16), (32, 32)])
@pytest.mark.parametrize("b, t, heads", [(1, 1, 2), (1, 3, 2), (2, 17, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rope_kernel_equals_the_reference_bit_for_bit(d, rot, b, t, heads, dtype):
    gen = torch.Generator().manual_seed(d * rot + b * t * heads)
    q_gate = random(gen, b, t, heads, 2 * d, scale=3, dtype=dtype)
    q = q_gate[..., :d]  # the q half of a [B, T, heads, 2D] projection, as Attention slices it
    w = random(gen, d, scale=0.1, dtype=dtype)
    angles = random(gen, b, t, rot, scale=4)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got, want = rms_norm_rope_triton(q, w, EPS, cos, sin), rms_norm_rope_reference(q, w, EPS, cos, sin)
    assert got.dtype == dtype and got.shape == q.shape and got.is_contiguous()
    assert torch.equal(got, want)
    k = q.contiguous()
    assert torch.equal(rms_norm_rope_triton(k, w, EPS, cos, sin), rms_norm_rope_reference(k, w, EPS, cos, sin))


def test_float16_takes_the_same_roundings():
    gen = torch.Generator().manual_seed(3)
    x, r, w = (random(gen, 3, 48, scale=3, dtype=torch.float16), random(gen, 3, 48, scale=3, dtype=torch.float16),
               random(gen, 48, scale=0.1, dtype=torch.float16))
    got, want = add_rms_norm_triton(x, r, w, EPS), add_rms_norm_reference(x, r, w, EPS)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2e-3, atol=2e-3)
    gate = random(gen, 3, 48, scale=3, dtype=torch.float16)
    assert torch.equal(gated_rms_norm_triton(x, gate, w + 1, EPS), gated_rms_norm_reference(x, gate, w + 1, EPS))
    q = x.view(1, 3, 1, 48)
    cos, sin = random(gen, 1, 3, 12).cos().half(), random(gen, 1, 3, 12).sin().half()
    assert torch.equal(rms_norm_rope_triton(q, w, EPS, cos, sin), rms_norm_rope_reference(q, w, EPS, cos, sin))


@pytest.mark.parametrize("dtype, takes_the_kernel", [(torch.float64, False), (torch.float32, True)])
def test_the_dispatchers_take_the_kernels_except_for_float64(monkeypatch, dtype, takes_the_kernel):
    """With CPU tensors counted as a Triton device: float64 goes to the references, float32 to the kernels."""
    monkeypatch.setattr(launch_module, "runs_triton", lambda device: True)
    monkeypatch.setattr("npuport.kernels.implementations.runs_triton", lambda device: True)  # CPU as a Triton device
    calls = []
    for module, name in [(rms_norm_module, "add_rms_norm_triton"), (gated_module, "gated_rms_norm_triton"),
                         (rope_module, "rms_norm_rope_triton")]:
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, _kernel=kernel, _name=name: calls.append(_name) or
                            _kernel(*args))
    gen = torch.Generator().manual_seed(4)
    x, r, w = random(gen, 2, 32, dtype=dtype), random(gen, 2, 32, dtype=dtype), random(gen, 32, scale=0.1, dtype=dtype)
    got, want = add_rms_norm(x, r, w, EPS), add_rms_norm_reference(x, r, w, EPS)
    assert torch.equal(got[1], want[1])
    if takes_the_kernel:
        assert_normed_close(got[0], want[0])
    else:
        assert torch.equal(got[0], want[0])
    assert torch.equal(gated_rms_norm(x, r, w, EPS), gated_rms_norm_reference(x, r, w, EPS))
    q, cos, sin = x.view(1, 2, 1, 32), random(gen, 1, 2, 8, dtype=dtype), random(gen, 1, 2, 8, dtype=dtype)
    assert torch.equal(rms_norm_rope(q, w, EPS, cos, sin), rms_norm_rope_reference(q, w, EPS, cos, sin))
    assert len(calls) == (3 if takes_the_kernel else 0)
