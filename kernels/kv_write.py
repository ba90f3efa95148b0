"""Writing a decode / verify step's keys and values into static KV caches: one launch for both, without a
host synchronisation (a step that writes can be captured as a graph), instead of the index arithmetic and two
index_put launches of the PyTorch reference beside it."""

from __future__ import annotations

import torch

from npuport.kernels.implementations import TRITON, runnable
from npuport.kernels.launch import (
    jit,
    launch,
    launch_options,
    next_power_of_2,
    persistent_grid,
    tl,
    unit_last_stride,
    use_triton,
)


def write_kv(cache_k: torch.Tensor, cache_v: torch.Tensor, start: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """cache_k, cache_v [B, S, Hkv, D] (contiguous); k, v [B, T, Hkv, D] (any strides, the last 1); start [B]:
    writes token t of request b at position min(start[b] + t, S - 1), cast to the caches' dtype. A step's
    positions always lie inside the capacity; the clamp only keeps a stray one from writing out of bounds."""
    triton = use_triton(cache_k, k) and cache_k.is_contiguous() and cache_v.is_contiguous()
    if runnable("kv_write", k.device, None, triton) == TRITON:  # no native form: Triton on an NPU too
        write_kv_triton(cache_k, cache_v, start, k, v)
    else:
        write_kv_reference(cache_k, cache_v, start, k, v)


def write_kv_reference(cache_k: torch.Tensor, cache_v: torch.Tensor, start: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor) -> None:
    b, t = k.shape[:2]
    pos = (start[:, None] + torch.arange(t, device=k.device)).clamp_max(cache_k.shape[1] - 1)
    rows = torch.arange(b, device=k.device)[:, None].expand(b, t)
    cache_k[rows, pos] = k.to(cache_k.dtype)
    cache_v[rows, pos] = v.to(cache_v.dtype)


# NPU budget: one token's keys and values of one head, [BD] twice (D = 256 bf16: 1 KiB).
@jit
def _write_kv_kernel(cache_k, cache_v, start, k, v, n_rows, T, H, S, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                     D: tl.constexpr, BD: tl.constexpr):
    """Row r = (b, t, h): cache_k[b, min(start[b] + t, S - 1), h] = k[b, t, h], the same for v."""
    d = tl.arange(0, BD)
    ok = d < D
    dt = cache_k.dtype.element_ty
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        at = tl.cast(row, tl.int64)
        h, t, b = at % H, (at // H) % T, at // (H * T)
        pos = tl.minimum(tl.load(start + b) + t, S - 1)
        dest = ((b * S + pos) * H + h) * D + d
        tl.store(cache_k + dest, tl.load(k + b * sk_b + t * sk_t + h * sk_h + d, mask=ok).to(dt), mask=ok)
        tl.store(cache_v + dest, tl.load(v + b * sv_b + t * sv_t + h * sv_h + d, mask=ok).to(dt), mask=ok)


def write_kv_triton(cache_k: torch.Tensor, cache_v: torch.Tensor, start: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
    """The Triton kernel behind write_kv (any device; CPU tensors run in Triton's interpreter)."""
    b, t, h, d = k.shape
    k, v = unit_last_stride(k), unit_last_stride(v)
    rows = b * t * h
    launch(_write_kv_kernel, persistent_grid(k.device, rows), cache_k, cache_v, start, k, v, rows, t, h,
           cache_k.shape[1], k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
           D=d, BD=next_power_of_2(d), **launch_options(k.device, num_warps=1))
