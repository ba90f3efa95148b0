"""W8A8_DYNAMIC matmul: per-token symmetric int8 activation quantization, int8 x int8 -> int32 matmul, and the
rescale by activation and weight scales (CONTRACT.md: x_q = round(x / s_x), s_x = max|x_row| / 127,
y = (x_q @ W_q^T) * s_x * s_w).

One module a kernel (quantize.py, gemm.py), the references in naive.py; imports kernels.launch and
npuport.devices. The Triton path is two kernels: the quantization, and the GEMM with the rescale in its epilogue
(bf16 out). A split-K tile config (GemmConfig.split_k > 1) has the GEMM store int32 partial sums over K slices to
a workspace instead, and a third kernel adds them up (integer addition: exact) and applies the same epilogue. With
few rows (M <= FEW_ROWS) on a GPU that has dependent launch (Hopper on), the GEMM starts while the quantization
still runs, asks the L2 for the first PREFETCH_BYTES of each weight row it will read first, and then waits for the
quantization's results: the weight streams during the quantization instead of after it. All are bit-exact against
the references. On an H200 (bench/RESULTS.md) quantize + GEMM matches or beats BF16 F.linear at every size
measured at the 27B shapes (M = 1..16384: 0.98-1.85x), so there is no fallback; nor would one help: with only int8
weights in memory no faster exact path exists - a BF16 copy of the weight would double its memory, a bf16 GEMM on
the int8 values sums in fp32, exact only while every partial sum stays below 2^24, and torch._int_mm (cuBLASLt's
int8 GEMM) plus the rescale was slower than these kernels at every size tried.
"""

from npuport.kernels.w8a8.gemm import (
    GPU_CANDIDATES,
    PREFETCH_BYTES,
    TUNING_CALLS,
    TUNING_ROUNDS,
    GemmConfig,
    gemm_candidates,
    gemm_config,
    int8_matmul_rescale,
    int8_matmul_rescale_triton,
    tuning_key,
    tuning_times,
)
from npuport.kernels.w8a8.naive import (
    QMAX,
    SCALE_FLOOR,
    int8_matmul_rescale_reference,
    quantize_per_token_int8_reference,
)
from npuport.kernels.w8a8.quantize import (
    FEW_ROWS,
    gemm_overlaps_quantization,
    quantize_launch,
    quantize_per_token_int8,
    quantize_per_token_int8_triton,
)

__all__ = [
    "FEW_ROWS", "GPU_CANDIDATES", "PREFETCH_BYTES", "QMAX", "SCALE_FLOOR", "TUNING_CALLS", "TUNING_ROUNDS",
    "GemmConfig", "gemm_candidates", "gemm_config", "gemm_overlaps_quantization", "int8_matmul_rescale",
    "int8_matmul_rescale_reference", "int8_matmul_rescale_triton", "quantize_launch", "quantize_per_token_int8",
    "quantize_per_token_int8_reference", "quantize_per_token_int8_triton", "tuning_key", "tuning_times",
]
