"""The int8 x int8 -> int32 GEMM with the per-token x per-channel rescale in its epilogue (split-K through an
int32 workspace and a summing kernel), its candidate tiles, their tuning, and the dispatcher."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from npuport.devices import PauseCount, timed_graph, with_index
from npuport.kernels.implementations import NATIVE, TRITON, runnable
from npuport.kernels.launch import (
    L2_LINE_BYTES,
    is_gpu,
    is_npu,
    jit,
    launch,
    launch_options,
    next_power_of_2,
    persistent_grid,
    prefetch_to_l2,
    tl,
    unit_last_stride,
    use_triton,
    wait_for_previous_kernel,
)
from npuport.kernels.npu import w8a8 as native
from npuport.kernels.w8a8.naive import int8_matmul_rescale_reference
from npuport.kernels.w8a8.quantize import gemm_overlaps_quantization

# What the overlapping GEMM asks the L2 for, per weight row of its first tile, before it waits: 512 B was the
# fastest of 128 B..8 KiB (and of bulk prefetches of 256 B..2 KiB) on an H200 at M = 1..64 of the 27B shapes
# (bench/RESULTS.md); more crowds out the loads the GEMM waits on.
PREFETCH_BYTES = 512


def int8_matmul_rescale(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """x_q int8 [M, K], x_scale fp32 [M, 1], w_q int8 [N, K], w_scale fp32 [N, 1] -> y [M, N] in out_dtype:
    the exact int32 product, rescaled in fp32 (float64 for a float64 out_dtype)."""
    chosen = runnable("w8a8_matmul", x_q.device, lambda: native.matmul_refusal(x_q, w_q, out_dtype),
                      use_triton(x_q) and out_dtype != torch.float64)
    if chosen == NATIVE:
        return native.int8_matmul_rescale_native(x_q, x_scale, w_q, w_scale, out_dtype)
    if chosen == TRITON:
        return int8_matmul_rescale_triton(x_q, x_scale, w_q, w_scale, out_dtype)
    return int8_matmul_rescale_reference(x_q, x_scale, w_q, w_scale, out_dtype)


@jit
def _tile_of(tile, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Output tile number `tile` -> rows rm [BM], columns rn [BN] and their in-bounds masks. GROUP_M row tiles
    in a row walk the same weight columns, so those stay in L2 between them."""
    tiles_m = (M + BM - 1) // BM
    tiles_n = (N + BN - 1) // BN
    in_group = GROUP_M * tiles_n
    first_m = tile // in_group * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    rm = (first_m + (tile % in_group) % group_m) * BM + tl.arange(0, BM)
    rn = (tile % in_group) // group_m * BN + tl.arange(0, BN)
    return rm, rn, rm < M, rn < N


@jit
def _int8_dot(x_q, w_q, rm, rn, m_ok, n_ok, K, sx_m, sw_n, kt_lo, kt_hi,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
    """The exact int32 [BM, BN] sum of x_q[rm, k] * w_q[rn, k] over the K tiles kt_lo <= kt < kt_hi
    (k in [kt BK, (kt + 1) BK), masked at K unless EVEN_K); zeros where kt_lo >= kt_hi."""
    rk = tl.arange(0, BK)
    x_ptrs = x_q + rm[:, None].to(tl.int64) * sx_m + rk[None, :]
    w_ptrs = w_q + rn[None, :].to(tl.int64) * sw_n + rk[:, None]
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    for kt in range(kt_lo, kt_hi):
        if EVEN_K:
            a = tl.load(x_ptrs + kt * BK, mask=m_ok[:, None], other=0)
            b = tl.load(w_ptrs + kt * BK, mask=n_ok[None, :], other=0)
        else:
            k_ok = kt * BK + rk < K
            a = tl.load(x_ptrs + kt * BK, mask=m_ok[:, None] & k_ok[None, :], other=0)
            b = tl.load(w_ptrs + kt * BK, mask=k_ok[:, None] & n_ok[None, :], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    return acc


@jit
def _rescale_store(acc, x_scale, w_scale, out, rm, rn, m_ok, n_ok, so_m):
    """The epilogue: exact int32 sums acc [BM, BN], rescaled in fp32 in the reference's order
    (acc * x_scale[rm] * w_scale[rn]), rounded once to out's dtype and stored to out[rm, rn]."""
    x_s = tl.load(x_scale + rm, mask=m_ok, other=0.0)
    w_s = tl.load(w_scale + rn, mask=n_ok, other=0.0)
    y = acc.to(tl.float32) * x_s[:, None] * w_s[None, :]
    tl.store(out + rm[:, None].to(tl.int64) * so_m + rn[None, :], y.to(out.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@jit
def _prefetch_first_weights(w_q, M, N, K, sw_n, n_tiles, k_tiles, BM: tl.constexpr, BN: tl.constexpr,
                            BK: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
                            PREFETCH_BYTES: tl.constexpr):
    """GPU only: ask the L2 for the first PREFETCH_BYTES of each weight row [BN] of this program's first task,
    from the start of its K slice (one address per L2 line, clamped to the row)."""
    task = tl.program_id(0)
    _, rn, _, _ = _tile_of(task % n_tiles, M, N, BM, BN, GROUP_M)
    k0 = task // n_tiles * k_tiles // SPLIT_K * BK
    cols = tl.minimum(k0 + tl.arange(0, PREFETCH_BYTES // L2_LINE_BYTES) * L2_LINE_BYTES, K - 1)
    prefetch_to_l2(w_q + tl.minimum(rn, N - 1)[:, None].to(tl.int64) * sw_n + cols[None, :])


# NPU budget (the launcher keeps BM x BN <= 128 x 128 there): int8 tiles [BM, BK] + [BK, BN] = 2 x 16 KiB at
# BK = 128, the int32 accumulator 64 KiB: over 70 KiB, so the NPU launch turns multi-buffering off. SPLIT_K > 1
# holds the same tiles (it stores the int32 accumulator instead of rescaling it).
@jit
def _w8a8_gemm_kernel(x_q, x_scale, w_q, w_scale, out, M, N, K, sx_m, sw_n, so_s, so_m, n_tasks,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                      EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, PREFETCH_BYTES: tl.constexpr):
    """Task t = (K slice s, output tile): s = t // n_tiles, the tile t % n_tiles. SPLIT_K = 1: out [M, N] gets
    the rescaled product. SPLIT_K > 1: out is the int32 workspace [SPLIT_K, M, N] (split stride so_s); slice s
    (K tiles s k_tiles // SPLIT_K up to (s + 1) k_tiles // SPLIT_K) stores its partial sums to out[s], plainly
    (no atomics: deterministic), and _w8a8_split_sum_kernel adds them up and rescales.
    PREFETCH_BYTES > 0 (GPU only, launched as dependent on the quantization): prefetch that much of each weight
    row of the first task into L2, then wait for the quantization before reading anything."""
    n_tiles = n_tasks // SPLIT_K
    k_tiles = (K + BK - 1) // BK
    if PREFETCH_BYTES > 0:
        _prefetch_first_weights(w_q, M, N, K, sw_n, n_tiles, k_tiles, BM, BN, BK, GROUP_M, SPLIT_K, PREFETCH_BYTES)
        wait_for_previous_kernel()
    for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        split = task // n_tiles
        rm, rn, m_ok, n_ok = _tile_of(task % n_tiles, M, N, BM, BN, GROUP_M)
        acc = _int8_dot(x_q, w_q, rm, rn, m_ok, n_ok, K, sx_m, sw_n, split * k_tiles // SPLIT_K,
                        (split + 1) * k_tiles // SPLIT_K, BM, BN, BK, EVEN_K)
        if SPLIT_K == 1:
            _rescale_store(acc, x_scale, w_scale, out, rm, rn, m_ok, n_ok, so_m)
        else:
            part = out + tl.cast(split, tl.int64) * so_s + rm[:, None].to(tl.int64) * so_m + rn[None, :]
            tl.store(part, acc, mask=m_ok[:, None] & n_ok[None, :])


# Tile of the split-K sum, an elementwise pass over the workspace.
SUM_BM, SUM_BN = 16, 256


# NPU budget: the int32 sum, one int32 partial and the fp32 result, [SUM_BM, SUM_BN] = [16, 256] each:
# 3 x 16 KiB = 48 KiB.
@jit
def _w8a8_split_sum_kernel(part, x_scale, w_scale, out, M, N, sp_s, sp_m, so_m, n_tasks,
                           SPLIT_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """out [M, N] = (sum over s of part[s]) rescaled as the GEMM's epilogue does; part int32 [SPLIT_K, M, N]
    (strides sp_s, sp_m, 1). Integer addition: exact in any order."""
    tiles_n = (N + BN - 1) // BN
    for tile in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        rm = tile // tiles_n * BM + tl.arange(0, BM)
        rn = tile % tiles_n * BN + tl.arange(0, BN)
        m_ok = rm < M
        n_ok = rn < N
        ok = m_ok[:, None] & n_ok[None, :]
        ptrs = part + rm[:, None].to(tl.int64) * sp_m + rn[None, :]
        acc = tl.load(ptrs, mask=ok, other=0)
        for _ in tl.static_range(1, SPLIT_K):
            ptrs += sp_s
            acc += tl.load(ptrs, mask=ok, other=0)
        _rescale_store(acc, x_scale, w_scale, out, rm, rn, m_ok, n_ok, so_m)


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch options of the int8 GEMM. split_k > 1 splits K into that many slices of whole BK
    tiles (as even as can be; a slice may be empty when there are fewer K tiles than slices), each computed by
    its own task into an int32 workspace [split_k, M, N] that a second kernel sums and rescales."""

    bm: int
    bn: int
    bk: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1

    def __post_init__(self):
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")


def _c(bm: int, bn: int, bk: int, warps: int, stages: int, split_k: int = 1) -> GemmConfig:
    return GemmConfig(bm, bn, bk, 8, warps, stages, split_k)


# Candidate tiles per range of M on a GPU, from sweeps on an H200 at the 27B shapes (bench/kernels.py --sweep and
# tile sweeps around the winners, bench/RESULTS.md): decode sizes stream the weight in narrow tiles of 16 rows
# (tensor cores need 16) with two warps and deep pipelines; larger M grows the tiles, and up to M = 2048 a
# 128 x 128 tile on four warps (one warp group) beats the eight-warp ones. Split-K (split_k > 1: plain int32
# partials and a summing kernel) wins where a shape has few output tiles for its weight - 17408 -> 5120 at
# M = 17..512 (N / BN = 40..160 tiles on 132 SMs) - and loses elsewhere, so each range keeps the few tiles that
# won somewhere. The first call of a shape times the candidates of its range (_tune: each as a graph of
# TUNING_CALLS calls, TUNING_ROUNDS replays) and keeps the fastest.
GPU_CANDIDATES: list[tuple[int, list[GemmConfig]]] = [
    (16, [_c(16, 32, 256, 2, 6), _c(16, 32, 256, 2, 4), _c(16, 64, 256, 2, 4), _c(16, 64, 256, 4, 4)]),
    (32, [_c(32, 32, 128, 2, 6), _c(32, 32, 256, 1, 4), _c(16, 32, 256, 2, 6), _c(32, 16, 512, 2, 4),
          _c(32, 64, 128, 2, 6), _c(32, 64, 256, 4, 4, split_k=3)]),
    (64, [_c(64, 64, 128, 4, 6), _c(64, 64, 256, 4, 5), _c(64, 32, 128, 4, 6), _c(64, 64, 128, 4, 6, split_k=2),
          _c(64, 128, 128, 4, 4, split_k=4)]),
    (256, [_c(128, 128, 128, 4, 3), _c(128, 64, 128, 4, 4), _c(64, 128, 128, 4, 4), _c(128, 128, 64, 4, 5),
           _c(64, 128, 128, 4, 4, split_k=3)]),
    (2048, [_c(128, 128, 128, 4, 3), _c(64, 128, 128, 4, 4), _c(256, 128, 128, 8, 3), _c(128, 256, 128, 8, 3),
            _c(128, 128, 64, 4, 5), _c(64, 128, 128, 4, 4, split_k=3)]),
    (1 << 62, [_c(128, 256, 128, 8, 3), _c(256, 128, 128, 8, 3), _c(128, 128, 256, 8, 3), _c(128, 128, 128, 4, 3)]),
]


def gemm_candidates(m: int, device: torch.device) -> list[GemmConfig]:
    """The tiles worth trying for an [M, K] x [K, N] int8 product on `device`, best guess first."""
    if is_npu(device):  # cube cores take 16-row fractal tiles
        return [GemmConfig(bm=min(128, max(16, next_power_of_2(m))), bn=128, bk=128)]
    return next(cands for limit, cands in GPU_CANDIDATES if m <= limit)


def gemm_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig:
    """The tiles used for this product: the tuned choice if this shape was timed, else the first candidate."""
    return _tuned.get(tuning_key(m, n, k, device)) or gemm_candidates(m, device)[0]


_tuned: dict[tuple, GemmConfig] = {}
# What the tuning measured, per key of _tuned: (candidate, its best time in ms), for benchmarks to report.
tuning_times: dict[tuple, list[tuple[GemmConfig, float]]] = {}
TUNINGS = PauseCount()  # the shapes tuned in this process and the seconds their tuning took (serve's /metrics)


def tuning_key(m: int, n: int, k: int, device: torch.device) -> tuple:
    return (with_index(device), next_power_of_2(m), n, k)


def _launch_gemm(x_q, x_scale, w_q, w_scale, out, cfg: GemmConfig) -> None:
    """out [M, N] = the rescaled product of x_q [M, K] and w_q [N, K] (scales x_scale [M], w_scale [N]): one
    GEMM launch, or with cfg.split_k > 1 a GEMM launch into an int32 workspace [split_k, M, N] (allocated here,
    so a CUDA graph capture holds it) and the launch that sums it."""
    m, k = x_q.shape
    n = w_q.shape[0]
    split = cfg.split_k > 1
    dst = torch.empty(cfg.split_k, m, n, dtype=torch.int32, device=out.device) if split else out
    n_tasks = -(-m // cfg.bm) * -(-n // cfg.bn) * cfg.split_k
    overlap = gemm_overlaps_quantization(m, x_q.device)
    launch(_w8a8_gemm_kernel, persistent_grid(x_q.device, n_tasks, "cube"), x_q, x_scale, w_q, w_scale, dst, m, n, k,
           x_q.stride(0), w_q.stride(0), dst.stride(0) if split else 0, dst.stride(-2), n_tasks, BM=cfg.bm,
           BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, EVEN_K=k % cfg.bk == 0, SPLIT_K=cfg.split_k,
           PREFETCH_BYTES=PREFETCH_BYTES if overlap else 0,
           **launch_options(x_q.device, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                            npu={"multibuffer": False}, dependent=overlap))
    if split:
        _launch_split_sum(dst, x_scale, w_scale, out)


def _launch_split_sum(part, x_scale, w_scale, out) -> None:
    """out [M, N] = the sum of the int32 partial products part [split_k, M, N], rescaled by x_scale [M] and
    w_scale [N] as in the GEMM's epilogue."""
    split_k, m, n = part.shape
    n_tasks = -(-m // SUM_BM) * -(-n // SUM_BN)
    launch(_w8a8_split_sum_kernel, persistent_grid(part.device, n_tasks), part, x_scale, w_scale, out, m, n,
           part.stride(0), part.stride(1), out.stride(0), n_tasks, SPLIT_K=split_k, BM=SUM_BM, BN=SUM_BN,
           **launch_options(part.device, num_warps=4))


# Tuning times each candidate in a graph of TUNING_CALLS calls, TUNING_ROUNDS replays in turn over the
# candidates; each keeps its best replay, so a moment of noise or a GPU clock still ramping up costs a candidate
# one sample, not the choice.
TUNING_CALLS = 16
TUNING_ROUNDS = 3


def _tune(x_q, x_scale, w_q, w_scale, out) -> GemmConfig:
    """Time the candidates on these operands (the first call of a shape, outside any graph capture) and keep the
    fastest for the shape's range of M. They are timed as captured graphs, which is how decode and verify steps
    run them: timed eagerly instead (one call at a time after an L2 flush) they ran 16-27% above their captured
    times, unevenly, and a split-K tile that wins captured lost the choice (bench/RESULTS.md)."""
    m, k = x_q.shape
    key = tuning_key(m, w_q.shape[0], k, x_q.device)
    if key not in _tuned:
        start = time.perf_counter()
        cands = gemm_candidates(m, x_q.device)
        times = [float("inf")] * len(cands)
        if len(cands) > 1:
            graphs = [timed_graph(lambda c=c: _launch_gemm(x_q, x_scale, w_q, w_scale, out, c), x_q.device,
                                  TUNING_CALLS) for c in cands]
            for _ in range(TUNING_ROUNDS):
                for i, replay_ms in enumerate(graphs):
                    times[i] = min(times[i], replay_ms())
        _tuned[key] = cands[times.index(min(times))]
        tuning_times[key] = list(zip(cands, times, strict=True))
        TUNINGS.add(time.perf_counter() - start)
    return _tuned[key]


def int8_matmul_rescale_triton(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """The Triton kernel behind int8_matmul_rescale (any device; CPU tensors run in Triton's interpreter).
    On a GPU the first call of each shape (per power of 2 of M) picks the fastest of gemm_candidates."""
    x_q, w_q = unit_last_stride(x_q), unit_last_stride(w_q)
    m, k = x_q.shape
    out = torch.empty(m, w_q.shape[0], dtype=out_dtype, device=x_q.device)
    x_scale, w_scale = x_scale.reshape(-1), w_scale.reshape(-1)
    if config is None:
        config = _tune(x_q, x_scale, w_q, w_scale, out) if is_gpu(x_q.device) else gemm_config(
            m, w_q.shape[0], k, x_q.device)
    _launch_gemm(x_q, x_scale, w_q, w_scale, out, config)
    return out
