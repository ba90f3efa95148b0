"""The KV write kernel against an independent loop, run on CPU tensors through Triton's interpreter: the
caches must hold exactly the written values (a copy and a cast: no tolerance), and nothing else may change."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from npuport.kernels.kv_write import write_kv_reference, write_kv_triton  # noqa: E402


def written_by_loop(cache: torch.Tensor, start: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    want = cache.clone()
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            want[b, min(int(start[b]) + t, cache.shape[1] - 1)] = x[b, t].to(cache.dtype)
    return want


@pytest.mark.parametrize("write", [write_kv_triton, write_kv_reference], ids=["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 3])
def test_write_kv_puts_each_token_at_its_position_and_nothing_else(write, dtype, t):
    gen = torch.Generator().manual_seed(t)
    b, s, h, d = 3, 10, 2, 24
    cache_k, cache_v = (torch.randn(b, s, h, d, generator=gen).to(dtype) for _ in range(2))
    # k, v as a projection's views: strided heads, float32 into a bf16 cache where dtype is bf16
    kv = torch.randn(b, t, h, 2 * d, generator=gen)
    k, v = kv[..., :d], kv[..., d:]
    start = torch.tensor([0, 4, s - 2])  # the last request's verify runs past the capacity: clamped
    want_k, want_v = written_by_loop(cache_k, start, k), written_by_loop(cache_v, start, v)
    write(cache_k, cache_v, start, k, v)
    assert torch.equal(cache_k, want_k) and torch.equal(cache_v, want_v)
