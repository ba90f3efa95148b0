"""The GatedDeltaNet output norm of Qwen3.5: weight * rmsnorm(x) * silu(gate), with a plain weight (not 1 + w)
- one Triton launch instead of a dozen PyTorch kernels, equal to the PyTorch reference beside it bit for bit.

The reference rounds three times: the normalised x to x's dtype, its product with the weight to the product's
dtype (bf16 * bf16 is bf16 in PyTorch), and the fp32 product with silu(gate) once more to x's dtype. Its silu
is PyTorch's CPU one, whose exp the kernel repeats (sleef_expf) - except that PyTorch computes the last
(count mod 32) values of a contiguous run (the tail of a gate row of 48) with glibc's expf, which differs in
the last bit now and then: there float32 outputs can differ in the last bit, as the reference's own do between
two layouts of one gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from npuport.kernels.implementations import TRITON, runnable
from npuport.kernels.launch import jit, launch, next_power_of_2, persistent_grid, tl, unit_last_stride, use_triton
from npuport.kernels.rms_norm import SUM_LANES, exact_launch_options, inverse_rms, sum_of_squares


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [..., N] (gate may be a strided view, e.g. a slice of a stacked projection), weight [N] ->
    weight * rms_norm(x) * silu(gate), [..., N] in x's dtype."""
    triton = use_triton(x, gate, weight) and x.shape == gate.shape and x.shape[-1] >= SUM_LANES
    if runnable("gated_rms_norm", x.device, None, triton) == TRITON:  # no native form: Triton on an NPU too
        return gated_rms_norm_triton(x, gate, weight, eps)
    return gated_rms_norm_reference(x, gate, weight, eps)


def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    wide = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(wide)
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y * F.silu(gate.to(wide))).to(x.dtype)


# SLEEF's expf (the u10 version), which PyTorch's vectorized CPU kernels call for exp: a range reduction by
# ln 2 in two parts and a degree-6 polynomial, every multiply-add an fma. The constants are its fp32 values.
@jit
def sleef_expf(d):
    """exp(d) for fp32 d, bit for bit as SLEEF's Sleef_expf*_u10 computes it (0 below -104, inf above 100)."""
    in_range = (d >= -104.0) & (d <= 100.0)
    dd = tl.where(in_range, d, 0.0)
    t = dd * 1.4426950216293335
    q = (t + 12582912.0) - 12582912.0  # round to nearest even (1.5 * 2^23: |t| < 2^22)
    s = tl.fma(q, -0.693145751953125, dd)
    s = tl.fma(q, -1.428606765330187e-06, s)
    u = tl.fma(s, 0.00019852761761285365, 0.0013930435525253415)
    u = tl.fma(u, s, 0.008333360776305199)
    u = tl.fma(u, s, 0.041666485369205475)
    u = tl.fma(u, s, 0.1666666716337204)
    u = tl.fma(u, s, 0.5)
    u = 1.0 + tl.fma(s * s, u, s)
    # u * 2^q, as two exact multiplications by powers of two (2^q alone may not be a normal float)
    qi = q.to(tl.int32)
    half = qi >> 1
    u = u * ((half + 127) << 23).to(tl.float32, bitcast=True)
    u = u * ((qi - half + 127) << 23).to(tl.float32, bitcast=True)
    u = tl.where(d < -104.0, 0.0, u)
    return tl.where(d > 100.0, float("inf"), u)


@jit
def silu(x):
    """x / (1 + exp(-x)) in fp32, as PyTorch's vectorized CPU silu computes it."""
    return tl.div_rn(x, 1.0 + sleef_expf(-x))


# NPU budget: a chunk of up to 1024 columns of x, gate, weight and the output in fp32 (16 KiB) and the
# [4, 8] accumulators of the sum; N = 128 for Qwen3.5's value heads.
@jit
def _gated_rms_norm_kernel(x, gate, w, out, M, H, sx_a, sx_h, sg_a, sg_h, eps, N: tl.constexpr,
                           BLOCK: tl.constexpr, ROUND_PRODUCT: tl.constexpr):
    dtype = out.dtype.element_ty
    for row in range(tl.program_id(0), M, tl.num_programs(0)):
        a, h = tl.cast(row // H, tl.int64), tl.cast(row % H, tl.int64)
        x_row, g_row, o_row = x + a * sx_a + h * sx_h, gate + a * sg_a + h * sg_h, out + tl.cast(row, tl.int64) * N
        rinv = inverse_rms(sum_of_squares(x_row, N), N, eps, tl.arange(0, BLOCK))
        for start in tl.static_range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < N
            normed = (tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32) * rinv).to(dtype).to(tl.float32)
            y = tl.load(w + cols, mask=ok, other=0.0).to(tl.float32) * normed
            if ROUND_PRODUCT:  # weight and x of x's dtype (or a narrower one): PyTorch rounds their product
                y = y.to(dtype).to(tl.float32)
            g = tl.load(g_row + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(o_row + cols, (y * silu(g)).to(dtype), mask=ok)


def _as_heads(t: torch.Tensor) -> torch.Tensor:
    """t [..., N] as [A, H, N] with a unit last stride: a view where the leading dims allow one (the heads of
    a projection's slice do), else a copy."""
    t = t.reshape(1, 1, -1) if t.dim() == 1 else t if t.dim() > 2 else t.unsqueeze(1)
    t = t.flatten(0, -3)
    return unit_last_stride(t)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton kernel behind gated_rms_norm (any device; CPU tensors run in Triton's interpreter)."""
    n = x.shape[-1]
    xs, gs = _as_heads(x), _as_heads(gate)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = xs.shape[0] * xs.shape[1]
    launch(_gated_rms_norm_kernel, persistent_grid(x.device, rows), xs, gs, weight, out, rows, xs.shape[1],
           xs.stride(0), xs.stride(1), gs.stride(0), gs.stride(1), eps, N=n, BLOCK=min(next_power_of_2(n), 1024),
           ROUND_PRODUCT=torch.promote_types(weight.dtype, x.dtype) == x.dtype,
           **exact_launch_options(x.device, num_warps=4 if n >= 1024 else 1))
    return out
