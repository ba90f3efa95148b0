"""The Triton W8A8 kernels - per-token int8 quantization and the int8 GEMM with the rescale fused into its
epilogue - against their references, run on CPU tensors through Triton's interpreter. Both are exact: the
same int8 values and scales, the same int32 sums, the same fp32 rescale in the same order - also with split-K
(int32 partial sums over K slices, added up by a second kernel)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from npuport.kernels.w8a8 import (  # noqa: E402
    GPU_CANDIDATES,
    GemmConfig,
    int8_matmul_rescale_reference,
    int8_matmul_rescale_triton,
    quantize_launch,
    quantize_per_token_int8_reference,
    quantize_per_token_int8_triton,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k"), [(1, 64), (7, 300), (33, 5000)])
def test_quantization_kernel_is_exactly_the_reference(dtype, m, k):
    gen = torch.Generator().manual_seed(m + k)
    x = (3 * torch.randn(m, k, generator=gen)).to(dtype)
    if m > 1:
        x[1] = 0.0  # an all-zero row
    got_q, got_scale = quantize_per_token_int8_triton(x)
    want_q, want_scale = quantize_per_token_int8_reference(x)
    assert got_q.dtype == torch.int8 and got_scale.shape == (m, 1)
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_scale, want_scale)


def test_quantization_kernel_rounds_half_to_even():
    x = torch.tensor([[2.5, -127.0, 0.5, 1.5, -2.5, -0.5, 126.5, 3.5]])
    got_q, _ = quantize_per_token_int8_triton(x)
    assert got_q[0].tolist() == [2, -127, 0, 2, -2, 0, 126, 4]


def test_few_rows_on_a_gpu_quantize_in_wide_slices_exactly(monkeypatch):
    """The wide launch a GPU uses for few rows (one slice of 8192 over a row of 5000), run here in the
    interpreter: the same values as the reference."""
    from npuport.kernels.w8a8 import quantize

    monkeypatch.setattr(quantize, "is_gpu", lambda device: True)
    assert quantize_launch(3, 5000, torch.device("cpu"))[0] == 8192
    x = 3 * torch.randn(3, 5000, generator=torch.Generator().manual_seed(5))
    got_q, got_scale = quantize_per_token_int8_triton(x)
    want_q, want_scale = quantize_per_token_int8_reference(x)
    assert torch.equal(got_q, want_q) and torch.equal(got_scale, want_scale)


@pytest.mark.parametrize(("m", "k"), [(1, 5120), (64, 17408), (65, 5120), (4096, 2048)])
def test_quantization_slices_stay_in_the_npu_budget_off_a_gpu(m, k):
    """Off a GPU (an NPU, the interpreter) a slice is at most 4096 values: the kernel's on-chip budget."""
    assert quantize_launch(m, k, torch.device("cpu"))[0] <= 4096


def test_the_gemm_overlaps_the_quantization_only_with_few_rows_where_the_device_can(monkeypatch):
    """The overlap (a dependent launch and an L2 prefetch: CUDA-only instructions) is asked for only with
    M <= FEW_ROWS on a device that has it - never in the interpreter - and only GPU launches carry the option."""
    from npuport.kernels.launch import launch_options
    from npuport.kernels.w8a8 import quantize

    cpu = torch.device("cpu")
    assert not quantize.gemm_overlaps_quantization(1, cpu)
    monkeypatch.setattr(quantize, "dependent_launch", lambda device: True)
    assert quantize.gemm_overlaps_quantization(quantize.FEW_ROWS, cpu)
    assert not quantize.gemm_overlaps_quantization(quantize.FEW_ROWS + 1, cpu)
    assert launch_options(torch.device("cuda"), num_warps=4, dependent=True)["launch_pdl"] is True
    assert "launch_pdl" not in launch_options(torch.device("cuda"), num_warps=4)
    assert launch_options(cpu, num_warps=4, dependent=True) == {}


CONFIGS = [
    None,  # what gemm_config picks
    GemmConfig(bm=16, bn=32, bk=64),
    GemmConfig(bm=32, bn=16, bk=32, group_m=2),  # several row tiles per group, K not a multiple of BK
    GemmConfig(bm=16, bn=16, bk=32, group_m=1),
    # split-K: int32 partials over K slices of whole BK tiles, summed by a second kernel
    GemmConfig(bm=16, bn=32, bk=32, split_k=2),
    GemmConfig(bm=32, bn=16, bk=32, group_m=2, split_k=3),  # K not a multiple of split_k x BK, nor of BK
    GemmConfig(bm=16, bn=16, bk=64, split_k=8),  # more slices than K tiles (2..5 here): the empty ones add 0
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 100, 300), (9, 48, 256), (37, 70, 96)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gemm_kernel_is_exactly_the_reference(config, m, n, k, out_dtype):
    gen = torch.Generator().manual_seed(m * n + k)
    x_q = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
    w_q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    x_scale, w_scale = torch.rand(m, 1, generator=gen) / 50, torch.rand(n, 1, generator=gen) / 50
    got = int8_matmul_rescale_triton(x_q, x_scale, w_q, w_scale, out_dtype, config)
    want = int8_matmul_rescale_reference(x_q, x_scale, w_q, w_scale, out_dtype)
    assert got.dtype == out_dtype
    assert torch.equal(got, want)


def test_split_k_below_one_is_refused():
    with pytest.raises(ValueError, match="split_k"):
        GemmConfig(bm=16, bn=16, bk=32, split_k=0)


def test_gpu_candidates_cover_every_m_and_use_16_row_tiles_for_decode():
    limits = [limit for limit, _ in GPU_CANDIDATES]
    assert limits == sorted(limits) and limits[-1] > 2**31
    assert all(c.bm == 16 for c in GPU_CANDIDATES[0][1])
    assert all(c.bm >= 16 and c.bk >= 32 for _, cands in GPU_CANDIDATES for c in cands)  # tl.dot minimums
    # split-K is among the candidates from decode to mid M, each range short enough to time on first use
    assert all(any(c.split_k > 1 for c in cands) for limit, cands in GPU_CANDIDATES if 32 <= limit <= 2048)
    assert all(len(cands) == len(set(cands)) <= 10 for _, cands in GPU_CANDIDATES)
