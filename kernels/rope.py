"""Rotate-half RoPE on the first rotary_dim dims of each head, and rms_norm_rope: Qwen3.5's per-head q/k
RMSNorm with the RoPE after it in one Triton launch, equal to the PyTorch reference beside it bit for bit
(the norm rounded to x's dtype, then each RoPE product rounded, then their sum)."""

from __future__ import annotations

import torch

from npuport.kernels.implementations import NATIVE, TRITON, runnable
from npuport.kernels.launch import jit, launch, next_power_of_2, persistent_grid, tl, unit_last_stride, use_triton
from npuport.kernels.npu import rope as native
from npuport.kernels.rms_norm import SUM_LANES, exact_launch_options, inverse_rms, rms_norm_reference, sum_of_squares


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first rotary_dim dims of x [B, T, heads, head_dim]; the rest pass through.
    cos, sin [B, T, rotary_dim] in x's dtype. No Triton kernel of its own (the model's RoPE is rms_norm_rope's)."""
    if runnable("rope", x.device, lambda: native.rope_refusal(x, cos, sin), False) == NATIVE:
        return native.apply_rope_native(x, cos, sin)
    return apply_rope_reference(x, cos, sin)


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    xr, rest = x[..., :rot], x[..., rot:]
    rotated = torch.cat([-xr[..., rot // 2 :], xr[..., : rot // 2]], dim=-1)
    c, s = cos[:, :, None], sin[:, :, None]
    return torch.cat([xr * c + rotated * s, rest], dim=-1)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, D] (any strides: e.g. the q half of a [B, T, heads, 2D] projection), weight [D] (the
    zero-centred weight of rms_norm), cos, sin [B, T, rot] in x's dtype (rot <= D, even) ->
    apply_rope(rms_norm(x, weight, eps), cos, sin), a contiguous [B, T, heads, D] in x's dtype."""
    triton = (use_triton(x, weight, cos, sin) and x.dim() == 4 and cos.dtype == sin.dtype == x.dtype
              and cos.shape == sin.shape == (*x.shape[:2], cos.shape[-1]) and x.shape[-1] >= SUM_LANES)
    chosen = runnable("rms_norm_rope", x.device, lambda: native.rms_norm_rope_refusal(x, weight, cos, sin), triton)
    if chosen == NATIVE:
        return native.rms_norm_rope_native(x, weight, eps, cos, sin)
    if chosen == TRITON:
        return rms_norm_rope_triton(x, weight, eps, cos, sin)
    return rms_norm_rope_reference(x, weight, eps, cos, sin)


def rms_norm_rope_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                            sin: torch.Tensor) -> torch.Tensor:
    return apply_rope_reference(rms_norm_reference(x, weight, eps), cos, sin)


# NPU budget: one head of D values (D = 256 for Qwen3.5): x twice (itself and its rotation partner), the two
# scales, cos and sin in fp32 - 6 KiB - and the [4, 8] accumulators of the sum.
@jit
def _rms_norm_rope_kernel(x, w, cos, sin, out, M, T, H, sx_b, sx_t, sx_h, sc_b, sc_t, ss_b, ss_t, eps,
                          D: tl.constexpr, ROT: tl.constexpr, BD: tl.constexpr):
    dtype = out.dtype.element_ty
    d = tl.arange(0, BD)
    ok = d < D
    rotary = d < ROT
    first_half = d < ROT // 2
    partner = tl.where(first_half, d + ROT // 2, d - ROT // 2)  # whose value rotate-half brings to d
    scale = 1.0 + tl.load(w + d, mask=ok, other=0.0).to(tl.float32)
    partner_scale = 1.0 + tl.load(w + partner, mask=rotary, other=0.0).to(tl.float32)
    for row in range(tl.program_id(0), M, tl.num_programs(0)):
        at = tl.cast(row, tl.int64)
        h, t, b = at % H, (at // H) % T, at // (H * T)
        x_row = x + b * sx_b + t * sx_t + h * sx_h
        rinv = inverse_rms(sum_of_squares(x_row, D), D, eps, d)
        y = (tl.load(x_row + d, mask=ok, other=0.0).to(tl.float32) * rinv * scale).to(dtype).to(tl.float32)
        yp = tl.load(x_row + partner, mask=rotary, other=0.0).to(tl.float32) * rinv * partner_scale
        yp = yp.to(dtype).to(tl.float32)
        c = tl.load(cos + b * sc_b + t * sc_t + d, mask=rotary, other=0.0).to(tl.float32)
        s = tl.load(sin + b * ss_b + t * ss_t + d, mask=rotary, other=0.0).to(tl.float32)
        rotated = tl.where(first_half, -yp, yp)
        roped = (y * c).to(dtype).to(tl.float32) + (rotated * s).to(dtype).to(tl.float32)
        tl.store(out + at * D + d, tl.where(rotary, roped, y).to(dtype), mask=ok)


def rms_norm_rope_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                         sin: torch.Tensor) -> torch.Tensor:
    """The Triton kernel behind rms_norm_rope (any device; CPU tensors run in Triton's interpreter)."""
    b, t, h, d = x.shape
    rot = cos.shape[-1]
    x = unit_last_stride(x)
    cos, sin = unit_last_stride(cos), unit_last_stride(sin)
    out = torch.empty((b, t, h, d), dtype=x.dtype, device=x.device)
    rows = b * t * h
    launch(_rms_norm_rope_kernel, persistent_grid(x.device, rows), x, weight, cos, sin, out, rows, t, h,
           x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), eps,
           D=d, ROT=rot, BD=next_power_of_2(d), **exact_launch_options(x.device, num_warps=1 if d <= 256 else 4))
    return out
