"""The W4A8_DYNAMIC weight math of msModelSlim 26.1.0 (its `ssz` int4 weight method and its ascendV1 saver), bit
for bit, for one routed-expert projection (convert/plan.py calls it for each such projection a recipe asks W4A8 of).

What msModelSlim computes, for a BF16 weight W [N, K] (N output channels, K inputs), per output channel n:

1. Start scale: s0 = max(max(max_k W[n, k], 0), -min(min_k W[n, k], 0)) / 7, rounded to BF16, floored at
   2**-23 (float32's machine epsilon, exact in BF16).
2. Quantize with a scale s: q = clamp(round_half_even(bf16(W / s)), -8, 7). The quotient is rounded to BF16 before
   it is rounded to an integer.
3. Error of a scale: mse(s) = mean_k (W - float32(bf16(q * s)))**2, in float32.
4. Refinement ("ssz", no calibration data): up to 50 rounds (the recipe's weight `ext.step` when set) of the least
   squares scale for the current integers, s' = bf16(sum_k bf16(W * q)) / bf16(sum_k q * q) (sums in BF16 tensors,
   the quotient rounded to BF16; the divisor floored at 1e-30), where q are the integers of the previous round's
   scale s (round 1: s0), not of the best one. A channel keeps s' as its best scale when mse(s') is strictly lower
   than its best error so far. Before that update, the whole tensor stops when every channel has converged:
   (best - mse(s')) / max(best, 1e-4) < 1e-10 (so any worse error counts) or |best - mse(s')| < 1e-10; the round
   that stops updates nothing. The stop is global, so a channel's result depends on the others
   of the same projection: this module runs the rounds over all rows in lockstep, a block of rows at a time.
5. Output: the integers of the best scale; weight_scale = float32(best scale) [N, 1]; weight_offset = zeros [N, 1];
   scale_bias = 8 * sum over K of q * scale in float32, per output channel: one column ([N, 1]) for the column
   parallel projections (gate_proj, up_proj) and 16 columns ([N, 16]) for the row parallel one (down_proj): K cut
   into 16 equal consecutive groups, the tensor parallel count msModelSlim's saver fixes at 16, so that each rank
   holding a K slice of the row parallel projection has the bias of its own slice. Every term q * scale is exact
   in float32 and, for K <= 8192, so is every partial sum, whatever the order of summation.
6. Packing: int4 pairs along the output dimension, byte [j, k] = (q[2j+1, k] << 4) | (q[2j, k] & 0xF), int8
   [N/2, K].

The steps are torch operations in the dtypes and memory layouts msModelSlim uses, so the float32 and BF16
reductions sum in the same order.
"""

from __future__ import annotations

import torch

QMIN, QMAX = -8, 7
SCALE_FLOOR = 2.0**-23  # float32 machine epsilon, exact in BF16
DIVISOR_FLOOR = 1e-30  # floor of sum(q * q) in the least squares scale
CONVERGED = 1e-10  # relative and absolute error change below which a channel counts as converged
RELATIVE_FLOOR = 1e-4  # floor of the best error in the relative change
ITERATIONS = 50  # msModelSlim's default number of refinement rounds
TP_GROUPS = 16  # K groups of the row parallel projections' scale_bias
BLOCK_ELEMENTS = 1 << 18  # rows per block: about this many weight elements (a block's working set stays in cache)

COLUMN_PARALLEL = ("up_proj", "gate_proj", "q_proj", "k_proj", "v_proj", "w1", "w3")
ROW_PARALLEL = ("down_proj", "o_proj", "w2")


def scale_bias_groups(name: str) -> int:
    """The number of scale_bias columns msModelSlim writes for the projection of this tensor name: 1 for a column
    parallel projection (gate_proj, up_proj, ...), 16 for a row parallel one (down_proj, ...); the first list is
    checked first, on substrings, as msModelSlim does. Any other name raises ValueError (msModelSlim would write
    the unsummed [N, K] product there)."""
    if any(part in name for part in COLUMN_PARALLEL):
        return 1
    if any(part in name for part in ROW_PARALLEL):
        return TP_GROUPS
    raise ValueError(f"{name!r} is neither a column parallel nor a row parallel projection")


def _quantize(wt: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """wt [K, n] BF16 (a transposed view of rows), scale [n] BF16 -> integers in [-8, 7] as BF16 [K, n]."""
    return (wt / scale).round_().clamp_(QMIN, QMAX).to(torch.int8).to(wt.dtype)  # through int8, as msModelSlim


def _mse(wt: torch.Tensor, wt32: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 [n]: mean over K of (W - dequantized W)**2 with the integers of `scale`, those integers BF16 [K, n]);
    wt32 is wt in float32. The same float32 arithmetic as msModelSlim's pow(|W - deq|, 2) with W promoted, bit for
    bit: the promotion is exact, and the square is the difference's product with itself."""
    q = _quantize(wt, scale)
    diff = wt32 - (q * scale).float()
    return torch.mean(diff * diff, dim=0), q


def _least_squares_scale(wt: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """BF16 [n]: the scale minimising the squared error for the integers q [K, n], in BF16 arithmetic."""
    return torch.sum(wt * q, dim=0) / torch.sum(q * q, dim=0).clamp(min=DIVISOR_FLOOR)


def _blocks(n: int, k: int, block_rows: int | None) -> list[slice]:
    rows = block_rows or max(1, BLOCK_ELEMENTS // max(k, 1))
    return [slice(r, min(r + rows, n)) for r in range(0, n, rows)]


def ssz_scale(weight: torch.Tensor, *, iterations: int = ITERATIONS, block_rows: int | None = None) -> torch.Tensor:
    """weight BF16 [N, K] -> the int4 scale msModelSlim's `ssz` method picks per output channel, BF16 [N].

    `iterations`: the number of refinement rounds (50 unless the recipe's weight qconfig sets `ext.step`).
    `block_rows`: rows per block (default: about 256k weight elements a block); the result does not depend on it.
    """
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise TypeError(f"expected a 2-D BF16 weight, got {weight.dtype} {tuple(weight.shape)}")
    w = weight.contiguous()
    n, k = w.shape
    blocks = _blocks(n, k, block_rows)

    scale = torch.empty(n, dtype=torch.bfloat16)
    for b in blocks:
        wt = w[b].T
        lo = torch.amin(wt, dim=0).clamp(max=0)
        hi = torch.amax(wt, dim=0).clamp(min=0)
        scale[b] = torch.maximum(torch.maximum(-lo, hi) / float(QMAX), torch.tensor(SCALE_FLOOR, dtype=w.dtype))
    best_scale = scale.clone()
    if iterations == 0:
        return best_scale
    best_mse = torch.empty(n, dtype=torch.float32)
    ints = [None] * len(blocks)  # each block's integers [K, rows] of `scale`: the next round's least squares take them
    floats = [w[b].T.float() for b in blocks]  # each block's weights in float32, [K, rows]
    for i, b in enumerate(blocks):
        best_mse[b], ints[i] = _mse(w[b].T, floats[i], scale[b])

    for _ in range(iterations):
        candidate = torch.empty_like(scale)
        cand_mse = torch.empty_like(best_mse)
        for i, b in enumerate(blocks):
            wt = w[b].T
            candidate[b] = _least_squares_scale(wt, ints[i])
            cand_mse[b], ints[i] = _mse(wt, floats[i], candidate[b])
        gain = best_mse - cand_mse
        settled = (gain / best_mse.clamp(min=RELATIVE_FLOOR) < CONVERGED) | (gain.abs() < CONVERGED)
        if bool(settled.all()):
            break
        # a 0/1 blend rather than a select, so a NaN error spreads as in msModelSlim
        better = (cand_mse < best_mse).to(torch.int32)
        best_mse = best_mse * (1 - better) + cand_mse * better
        best_scale = best_scale * (1 - better) + candidate * better
        scale = candidate
    return best_scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] of values in [-8, 7] -> int8 [N/2, K]: byte [j, k] = (q[2j+1, k] << 4) | (q[2j, k] & 0xF)."""
    if q.dim() != 2 or q.shape[0] % 2:
        raise ValueError(f"expected [N, K] with N even, got {tuple(q.shape)}")
    q = q.to(torch.int8)
    return torch.bitwise_or(torch.bitwise_left_shift(q[1::2], 4), torch.bitwise_and(q[0::2], 0x0F)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [N/2, K] packed by pack_int4 -> int8 [N, K] of values in [-8, 7] (low nibble: even row, high: odd)."""
    if packed.dtype != torch.int8 or packed.dim() != 2:
        raise TypeError(f"expected a 2-D int8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    low = torch.bitwise_right_shift(torch.bitwise_left_shift(packed, 4), 4)  # arithmetic shift: sign-extends
    high = torch.bitwise_right_shift(packed, 4)
    return torch.stack((low, high), dim=1).reshape(2 * packed.shape[0], packed.shape[1])


def scale_bias(q: torch.Tensor, weight_scale: torch.Tensor, groups: int) -> torch.Tensor:
    """q int8 [N, K] (int4 values), weight_scale float32 [N, 1] -> scale_bias float32 [N, groups]: 8 x the sum of
    q * scale over each of `groups` equal consecutive slices of K (every product and partial sum exact in float32
    for K <= 8192)."""
    n, k = q.shape
    deq = q.float() * weight_scale  # [N, K] float32
    return 8 * deq.reshape(-1, k // groups).sum(dim=1).reshape(n, groups)


def w4a8_dynamic(
    weight: torch.Tensor,
    groups: int,
    *,
    iterations: int = ITERATIONS,
    block_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One expert projection's BF16 weight [N, K] -> the four W4A8_DYNAMIC tensors msModelSlim writes for it:
    (weight int8 [N/2, K] packed int4, weight_scale float32 [N, 1], weight_offset float32 [N, 1] zeros,
    scale_bias float32 [N, groups]).

    Besides the weight, the computation needs `groups`, the scale_bias columns (msModelSlim picks them from the
    projection's name: 1 for gate_proj / up_proj, 16 for down_proj; `scale_bias_groups(name)`), and the number of
    refinement rounds `iterations` (50, or the recipe's weight `ext.step`). N must be even and K a multiple of
    `groups`. The weight is the projection alone: for a fused `gate_up_proj [E, 2I, H]`, gate is [e, :I], up is
    [e, I:]; down_proj is [e] of `down_proj [E, H, I]`. `block_rows` bounds the working memory (rows a block);
    the result does not depend on it.
    """
    n, k = weight.shape
    if n % 2 or groups < 1 or k % groups:
        raise ValueError(f"weight {tuple(weight.shape)}: N must be even and K a multiple of groups={groups}")
    scale = ssz_scale(weight, iterations=iterations, block_rows=block_rows)
    w = weight.contiguous()
    q = torch.empty(n, k, dtype=torch.int8)
    bias = torch.empty(n, groups, dtype=torch.float32)
    weight_scale = scale.float()[:, None]
    for b in _blocks(n, k, block_rows):
        q[b] = _quantize(w[b].T, scale[b]).to(torch.int8).T
        bias[b] = scale_bias(q[b], weight_scale[b], groups)
    return pack_int4(q), weight_scale, torch.zeros_like(weight_scale), bias

