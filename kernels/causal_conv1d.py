"""The depthwise causal conv1d (no bias) + SiLU in front of a GatedDeltaNet, with a window of past inputs.

A window holds the last L inputs of each channel, oldest first: `window [B, D, L]` (D channels, L columns,
L >= W - 1 for a kernel of width W). The conv of a new token reads the W - 1 newest columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from npuport.kernels.implementations import NATIVE, TRITON, runnable
from npuport.kernels.launch import jit, launch, launch_options, next_power_of_2, persistent_grid, tl, use_triton
from npuport.kernels.npu import conv as native


def causal_conv1d_fn(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor, n_valid: torch.Tensor
) -> torch.Tensor:
    """Prefill. x [B, T, D] new inputs (right-padded), weight [D, W], window [B, D, L] the inputs before x,
    n_valid [B] real tokens per row. Returns silu(conv) [B, T, D] (rows past n_valid are junk) and
    leaves in `window` the last L inputs up to each row's last real token."""
    chosen = runnable("causal_conv1d", x.device, lambda: native.causal_conv1d_refusal(x, weight, window),
                      use_triton(x, window))
    if chosen == NATIVE:
        return native.causal_conv1d_fn_native(x, weight, window, n_valid)
    if chosen == TRITON:
        return causal_conv1d_fn_triton(x, weight, window, n_valid)
    return causal_conv1d_fn_reference(x, weight, window, n_valid)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Decode / verify. x [B, T, D] new inputs, weight [D, W], window [B, D, L]. Returns silu(conv) [B, T, D];
    `window` keeps the last L inputs, the T new ones included (first in, first out). Committing n of the T
    (GDNState.commit) shifts the window back right by T - n."""
    chosen = runnable("causal_conv1d", x.device, lambda: native.causal_conv1d_refusal(x, weight, window),
                      use_triton(x, window))
    if chosen == NATIVE:
        return native.causal_conv1d_update_native(x, weight, window)
    if chosen == TRITON:
        return causal_conv1d_update_triton(x, weight, window)
    return causal_conv1d_update_reference(x, weight, window)


def _conv_silu(history: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(conv) of x [B, T, D] given the W - 1 inputs before it, history [B, D, W - 1]."""
    d = weight.shape[0]
    full = torch.cat([history, x.transpose(1, 2)], dim=-1)  # [B, D, W - 1 + T]
    out = F.conv1d(full, weight.unsqueeze(1), groups=d)  # [B, D, T]
    return F.silu(out).transpose(1, 2)


def causal_conv1d_fn_reference(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor, n_valid: torch.Tensor
) -> torch.Tensor:
    length, w = window.shape[-1], weight.shape[1]
    out = _conv_silu(window[..., length - (w - 1):], x, weight)
    joined = torch.cat([window, x.transpose(1, 2).to(window.dtype)], dim=-1)  # [B, D, L + T]
    cols = n_valid.to(torch.long)[:, None] + torch.arange(length, device=x.device)  # [B, L]
    window.copy_(joined.gather(-1, cols[:, None, :].expand(-1, joined.shape[1], -1)))
    return out


def causal_conv1d_update_reference(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    all_valid = torch.full((x.shape[0],), x.shape[1], dtype=torch.long, device=x.device)
    return causal_conv1d_fn_reference(x, weight, window, all_valid)


# Inputs are addressed as one joined sequence per channel: window columns 0..L-1, then the new tokens
# x[0..T-1] at L..L+T-1. Both kernels compute out[t] = silu(sum_i w[i] * joined[L + t - (W - 1) + i]).


@jit
def _joined(x, window, b, rows, chans, chan_ok, T, L, sx_b, sx_t, sw_b, sw_d):
    """joined[rows, chans] as a [len(rows), len(chans)] fp32 tile; rows outside 0..L+T-1 read as 0."""
    in_window = (rows >= 0) & (rows < L)
    in_x = (rows >= L) & (rows < L + T)
    from_window = tl.load(window + b * sw_b + chans[None, :].to(tl.int64) * sw_d + rows[:, None],
                          mask=in_window[:, None] & chan_ok[None, :], other=0.0)
    from_x = tl.load(x + b * sx_b + (rows[:, None] - L).to(tl.int64) * sx_t + chans[None, :],
                     mask=in_x[:, None] & chan_ok[None, :], other=0.0)
    return from_window.to(tl.float32) + from_x.to(tl.float32)


@jit
def _conv_tile(x, weight, window, b, t0, chans, chan_ok, T, L, sx_b, sx_t, sw_b, sw_d, s_wt,
               W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """silu(conv) of tokens t0..t0+BLOCK_T-1 for the channels `chans`: [BLOCK_T, BLOCK_D] fp32."""
    tokens = t0 + tl.arange(0, BLOCK_T)
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(W):
        tap = tl.load(weight + chans * s_wt + i, mask=chan_ok, other=0.0).to(tl.float32)
        acc += tap[None, :] * _joined(x, window, b, L + tokens - (W - 1) + i, chans, chan_ok, T, L,
                                      sx_b, sx_t, sw_b, sw_d)
    return acc / (1.0 + tl.exp(-acc))


# NPU budget: per tap a [BLOCK_T, BLOCK_D] fp32 tile twice (window and x parts) plus the accumulator,
# 32 x 128 x 4 B x 3 = 48 KiB.
@jit
def _conv_prefill_kernel(x, weight, window, out, T, D, L, sx_b, sx_t, sw_b, sw_d, s_wt, so_b, so_t, n_tasks,
                         W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    n_t = (T + BLOCK_T - 1) // BLOCK_T
    n_d = (D + BLOCK_D - 1) // BLOCK_D
    for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        b = tl.cast(task // (n_t * n_d), tl.int64)
        t0 = (task // n_d) % n_t * BLOCK_T
        chans = task % n_d * BLOCK_D + tl.arange(0, BLOCK_D)
        chan_ok = chans < D
        y = _conv_tile(x, weight, window, b, t0, chans, chan_ok, T, L, sx_b, sx_t, sw_b, sw_d, s_wt,
                       W, BLOCK_T, BLOCK_D)
        tokens = t0 + tl.arange(0, BLOCK_T)
        tl.store(out + b * so_b + tokens[:, None].to(tl.int64) * so_t + chans[None, :],
                 y.to(out.dtype.element_ty), mask=(tokens < T)[:, None] & chan_ok[None, :])


# NPU budget: one [BLOCK_L, BLOCK_D] tile, 8 x 128 x 4 B x 3 = 12 KiB.
@jit
def _window_shift_kernel(x, window, shift, T, D, L, sx_b, sx_t, sw_b, sw_d, n_tasks,
                         BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    """window[b, :, c] = joined[shift[b] + c]: keep the last L inputs up to token shift[b] - 1 of x."""
    n_d = (D + BLOCK_D - 1) // BLOCK_D
    cols = tl.arange(0, BLOCK_L)
    for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        b = tl.cast(task // n_d, tl.int64)
        chans = task % n_d * BLOCK_D + tl.arange(0, BLOCK_D)
        chan_ok = chans < D
        kept = _joined(x, window, b, tl.load(shift + b) + cols, chans, chan_ok, T, L, sx_b, sx_t, sw_b, sw_d)
        tl.debug_barrier()  # every thread has read the old window before any overwrites it
        tl.store(window + b * sw_b + chans[None, :].to(tl.int64) * sw_d + cols[:, None],
                 kept.to(window.dtype.element_ty), mask=(cols < L)[:, None] & chan_ok[None, :])


# NPU budget: W taps of [BLOCK_T, BLOCK_D] plus the [BLOCK_L, BLOCK_D] window tile, all fp32:
# (8 x 3 + 8) x 128 x 4 B = 16 KiB.
@jit
def _conv_update_kernel(x, weight, window, out, T, D, L, sx_b, sx_t, sw_b, sw_d, s_wt, so_b, so_t, n_tasks,
                        W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    n_d = (D + BLOCK_D - 1) // BLOCK_D
    cols = tl.arange(0, BLOCK_L)
    tokens = tl.arange(0, BLOCK_T)
    for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        b = tl.cast(task // n_d, tl.int64)
        chans = task % n_d * BLOCK_D + tl.arange(0, BLOCK_D)
        chan_ok = chans < D
        y = _conv_tile(x, weight, window, b, 0, chans, chan_ok, T, L, sx_b, sx_t, sw_b, sw_d, s_wt, W, BLOCK_T, BLOCK_D)
        kept = _joined(x, window, b, T + cols, chans, chan_ok, T, L, sx_b, sx_t, sw_b, sw_d)
        tl.debug_barrier()  # every thread has read the old window before any overwrites it
        tl.store(out + b * so_b + tokens[:, None].to(tl.int64) * so_t + chans[None, :],
                 y.to(out.dtype.element_ty), mask=(tokens < T)[:, None] & chan_ok[None, :])
        tl.store(window + b * sw_b + chans[None, :].to(tl.int64) * sw_d + cols[:, None],
                 kept.to(window.dtype.element_ty), mask=(cols < L)[:, None] & chan_ok[None, :])


def _check(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor) -> None:
    if x.stride(-1) != 1 or window.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("causal_conv1d: x, weight and window need a contiguous last dimension")
    if window.shape[-1] < weight.shape[1] - 1:
        raise ValueError(f"a window of {window.shape[-1]} columns cannot feed a conv of width {weight.shape[1]}")


def causal_conv1d_fn_triton(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor, n_valid: torch.Tensor
) -> torch.Tensor:
    """The Triton kernels behind causal_conv1d_fn (any device; CPU tensors run in Triton's interpreter)."""
    _check(x, weight, window)
    b, t, d = x.shape
    length, w = window.shape[-1], weight.shape[1]
    out = torch.empty_like(x)
    block_t, block_d = 32, 128
    n_tasks = b * -(-t // block_t) * -(-d // block_d)
    launch(_conv_prefill_kernel, persistent_grid(x.device, n_tasks), x, weight, window, out, t, d, length,
           x.stride(0), x.stride(1), window.stride(0), window.stride(1), weight.stride(0), out.stride(0),
           out.stride(1), n_tasks, W=w,
           BLOCK_T=block_t, BLOCK_D=block_d, **launch_options(x.device, num_warps=4))
    n_tasks = b * -(-d // block_d)
    launch(_window_shift_kernel, persistent_grid(x.device, n_tasks), x, window, n_valid.to(torch.int32), t, d,
           length, x.stride(0), x.stride(1), window.stride(0), window.stride(1), n_tasks,
           BLOCK_L=next_power_of_2(length), BLOCK_D=block_d, **launch_options(x.device, num_warps=4))
    return out


def causal_conv1d_update_triton(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """The Triton kernel behind causal_conv1d_update (any device; CPU tensors run in Triton's interpreter)."""
    _check(x, weight, window)
    b, t, d = x.shape
    length, w = window.shape[-1], weight.shape[1]
    out = torch.empty_like(x)
    block_d = 128
    n_tasks = b * -(-d // block_d)
    launch(_conv_update_kernel, persistent_grid(x.device, n_tasks), x, weight, window, out, t, d, length,
           x.stride(0), x.stride(1), window.stride(0), window.stride(1), weight.stride(0), out.stride(0),
           out.stride(1), n_tasks, W=w, BLOCK_T=next_power_of_2(t), BLOCK_L=next_power_of_2(length),
           BLOCK_D=block_d, **launch_options(x.device, num_warps=4))
    return out
