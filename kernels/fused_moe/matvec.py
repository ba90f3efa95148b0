"""The matvec path of the MoE experts, for few routed pairs (decode, verify, small batches), where grouping rows by
expert costs more than it saves: one program per (routed pair, column tile) for gate/up, one per (token, column
tile) for the down projection, which also sums the token's top-k slots in slot order - no sort, no padding, no
atomics, and each token's result independent of the others in the batch. A MoE layer's shared expert can ride
along as one more slot after the routed ones (experts.shares_layout): no launches of its own.

The kernels read each operand's kind from its pointer's type (int8 or float weights, int8 tokens or float ones
to quantize here) and whether an optional operand was given from None; one flag says what a pointer's type cannot:
INT4, the routed experts' int8 bytes hold int4 pairs of rows (StackedExperts.int4, W4A8). Those are read as
packed, half the bytes of int8: each [BN/2, BK] tile of byte rows gives the int32 sums of its even rows (low
nibbles) and of its odd rows (high nibbles), interleaved into the BN rows' order once the K loop is done, and then
the int8 experts' epilogue - so the routed slots give the int8 kernels' results on the unpacked weights, bit for
bit (integer sums are exact whatever their grouping). A float shared expert riding along sums its products in the
order the compiled kernel picks, which may differ between the int4 and int8 kernels by a rounding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from npuport.kernels.fused_moe.experts import StackedExperts
from npuport.kernels.fused_moe.int4_tiles import load_nibbles
from npuport.kernels.launch import is_npu, jit, launch, launch_options, persistent_grid, tl
from npuport.kernels.w8a8.quantize import to_int8_values, token_scale


@dataclass(frozen=True)
class MatvecConfig:
    """Column tiles of the two matvec kernels, their K step and warps: weights stream in [BN, BK] tiles of
    contiguous rows through the CUDA cores. The defaults: a GPU's tiles for more than 16 routed pairs."""

    gate_up_bn: int = 32
    down_bn: int = 8
    bk: int = 512
    num_warps: int = 4
    num_stages: int = 3


def matvec_config(pairs: int, device: torch.device | None = None, int4: bool = False) -> MatvecConfig:
    """Measured on an H100 at the 35B-A3B widths (bench/moe.py --sweep, bench/RESULTS.md, run P2): with up to 16
    routed pairs (batch 1-2 at top-8) [4, 512] weight tiles on both kernels stream best - one token's 8 experts in
    24.9 us against 27.4 for [16, 512] (BF16; W8A8 21.7 against 24.4), a lone shared expert in 7.1 us against
    9.4: small column tiles give enough programs to fill the GPU; with more pairs, [32, 512] for gate/up and
    [8, 512] for down (8 tokens: 135 us BF16, 77 us W8A8, within 2% of the best tile of each). An NPU (`device`;
    None: the GPU's tiles, which the interpreter runs too) takes [8, 512] on both, unmeasured: two [32, 512] tiles
    and their fp32 products fill a 910B core's 192 KiB unified buffer, twice over with multi-buffering. int4 experts
    (`int4`) on a GPU: [16, 512] on both at any count (H200, 35B-A3B widths, bench/moe.py --sweep: 16.6 / 62.8 /
    208 us at 1 / 8 / 32 tokens, within 2% of the best tile of each; the int8 tiles above left the int4 kernels
    slower than the int8 ones at one token)."""
    if device is not None and is_npu(device):
        return MatvecConfig(gate_up_bn=8, down_bn=8, bk=512)
    if int4:
        return MatvecConfig(gate_up_bn=16, down_bn=16, bk=512)
    if pairs <= 16:
        return MatvecConfig(gate_up_bn=4, down_bn=4, bk=512)
    return MatvecConfig()


@jit
def _row_times_tile(a_row, w_rows, k0, K, n_ok, BK: tl.constexpr, a_scale):
    """sum over k in [k0, k0 + BK) of a_row[k] * w_rows[n, k] -> [BN]: int32 for int8 weights, else fp32. A float
    a_row into int8 weights is quantized with a_scale on the way in (the values quantize_per_token_int8 would give
    with that scale)."""
    rk = k0 + tl.arange(0, BK)
    k_ok = rk < K
    x = tl.load(a_row + rk, mask=k_ok, other=0)
    w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
    if w_rows.dtype.element_ty == tl.int8:
        if a_row.dtype.element_ty != tl.int8:
            x_int = to_int8_values(x.to(tl.float32), a_scale)
        else:
            x_int = x.to(tl.int32)
        products = tl.sum(w.to(tl.int32) * x_int[None, :], 1)
    else:
        products = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    return products


@jit
def _row_scale(a_row, K, BK: tl.constexpr):
    """The per-token int8 scale of the float row a_row[0:K] (quantize_per_token_int8's)."""
    rk = tl.arange(0, BK)
    amax = tl.zeros([BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        amax = tl.maximum(amax, tl.abs(tl.load(a_row + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)))
    return token_scale(tl.max(amax, 0))


@jit
def _row_tile_int8(a_row, k0, K, BK: tl.constexpr, a_scale):
    """a_row[k0:k0 + BK] as int32 int8 values (0 past K): an int8 row as is, a float row quantized with a_scale."""
    rk = k0 + tl.arange(0, BK)
    x = tl.load(a_row + rk, mask=rk < K, other=0)
    if a_row.dtype.element_ty != tl.int8:
        x_int = to_int8_values(x.to(tl.float32), a_scale)
    else:
        x_int = x.to(tl.int32)
    return x_int


@jit
def _pairs_times_tile(x_int, w_pairs, k0, K, pair_ok, BK: tl.constexpr):
    """(even, odd) int32 [BN/2]: sum over k in [k0, k0 + BK) of x_int[k] times the low, and the high, signed
    nibble of byte w_pairs[j, k] - rows 2j and 2j + 1 of the unpacked weight."""
    rk = k0 + tl.arange(0, BK)
    low, high = load_nibbles(w_pairs + rk[None, :], pair_ok[:, None] & (rk < K)[None, :])
    return tl.sum(low * x_int[None, :], 1), tl.sum(high * x_int[None, :], 1)


@jit
def _pairs_of(rn, n_ok, BN: tl.constexpr):
    """The byte rows holding rows rn (a tile of BN consecutive rows from an even one) and which of them are in
    range: rows 2j, 2j + 1 -> byte row j."""
    # Arithmetic on the tile's first row and its count of rows in range (a prefix of the tile), not a split of rn:
    # triton-ascend's adapter lowers no multi-result op (tl.split) into address or mask computation.
    local = 2 * tl.arange(0, BN // 2)
    return (tl.min(rn, 0) + local) // 2, local < tl.sum(n_ok.to(tl.int32), 0)


@jit
def _float_gate_up(a_row, gate_rows, up_rows, K, n_ok, BN: tl.constexpr, BK: tl.constexpr, dt):
    """(gate, up) [BN] in dt of a float row through float weight rows (a float shared expert)."""
    acc = tl.zeros([BN], dtype=tl.float32)
    acc_up = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        acc += _row_times_tile(a_row, gate_rows, k0, K, n_ok, BK, 1.0)
        acc_up += _row_times_tile(a_row, up_rows, k0, K, n_ok, BK, 1.0)
    return acc.to(dt), acc_up.to(dt)


@jit
def _int8_gate_up(a_row, a_scale, token, gate_rows, up_rows, w_s, N, K, n_ok, BN: tl.constexpr, BK: tl.constexpr,
                  dt):
    """(gate, up) [BN] in dt of a row (int8 with its scale at a_scale[token], or float, quantized here) through
    int8 weight rows with per-channel scales w_s (gate) and w_s + N (up)."""
    if a_row.dtype.element_ty != tl.int8:
        x_s = _row_scale(a_row, K, BK)
    else:
        x_s = tl.load(a_scale + token)
    acc = tl.zeros([BN], dtype=tl.int32)
    acc_up = tl.zeros([BN], dtype=tl.int32)
    for k0 in range(0, K, BK):
        acc += _row_times_tile(a_row, gate_rows, k0, K, n_ok, BK, x_s)
        acc_up += _row_times_tile(a_row, up_rows, k0, K, n_ok, BK, x_s)
    gate = (acc.to(tl.float32) * x_s * tl.load(w_s, mask=n_ok, other=0.0)).to(dt)
    up = (acc_up.to(tl.float32) * x_s * tl.load(w_s + N, mask=n_ok, other=0.0)).to(dt)
    return gate, up


@jit
def _int4_gate_up(a_row, a_scale, token, w_e, w_s, rn, N, K, sw_n, n_ok, BN: tl.constexpr, BK: tl.constexpr, dt):
    """_int8_gate_up through packed int4 weights: w_e [N, K] int8 bytes (row stride sw_n), byte rows [0, N/2) the
    gate's row pairs, [N/2, N) the up's; the row's tile quantized once per K step for both."""
    if a_row.dtype.element_ty != tl.int8:
        x_s = _row_scale(a_row, K, BK)
    else:
        x_s = tl.load(a_scale + token)
    rp, pair_ok = _pairs_of(rn, n_ok, BN)
    gate_pairs = w_e + rp[:, None].to(tl.int64) * sw_n
    up_pairs = gate_pairs + tl.cast(N // 2, tl.int64) * sw_n
    gate_even = tl.zeros([BN // 2], dtype=tl.int32)
    gate_odd = tl.zeros([BN // 2], dtype=tl.int32)
    up_even = tl.zeros([BN // 2], dtype=tl.int32)
    up_odd = tl.zeros([BN // 2], dtype=tl.int32)
    for k0 in range(0, K, BK):
        x_int = _row_tile_int8(a_row, k0, K, BK, x_s)
        even, odd = _pairs_times_tile(x_int, gate_pairs, k0, K, pair_ok, BK)
        gate_even += even
        gate_odd += odd
        even, odd = _pairs_times_tile(x_int, up_pairs, k0, K, pair_ok, BK)
        up_even += even
        up_odd += odd
    acc = tl.interleave(gate_even, gate_odd)
    acc_up = tl.interleave(up_even, up_odd)
    gate = (acc.to(tl.float32) * x_s * tl.load(w_s, mask=n_ok, other=0.0)).to(dt)
    up = (acc_up.to(tl.float32) * x_s * tl.load(w_s + N, mask=n_ok, other=0.0)).to(dt)
    return gate, up


@jit
def _expert_gate_up(a_row, a_scale, token, w_e, w_scale_e, rn, N, K, sw_n, n_ok, BN: tl.constexpr, BK: tl.constexpr,
                    dt, INT4: tl.constexpr):
    """(gate, up) [BN] in dt of a row through one expert: its weight w_e [2N, K] (row stride sw_n; gate rows rn, up
    rows N + rn), int8 with per-channel scales w_scale_e [2N], or float (w_scale_e unused); INT4: w_e [N, K], the
    int8 bytes of int4 row pairs (scales as int8's)."""
    if INT4:
        gate, up = _int4_gate_up(a_row, a_scale, token, w_e, w_scale_e + rn, rn, N, K, sw_n, n_ok, BN, BK, dt)
    else:
        gate_rows = w_e + rn[:, None].to(tl.int64) * sw_n
        up_rows = gate_rows + tl.cast(N, tl.int64) * sw_n
        if w_e.dtype.element_ty == tl.int8:
            gate, up = _int8_gate_up(a_row, a_scale, token, gate_rows, up_rows, w_scale_e + rn, N, K, n_ok, BN, BK,
                                     dt)
        else:
            gate, up = _float_gate_up(a_row, gate_rows, up_rows, K, n_ok, BN, BK, dt)
    return gate, up


@jit
def _routed_gate_up(a_row, a_scale, token, slot, expert_ids, w, w_scale, rn, N, K, TOP_K, sw_e, sw_n, sws_e, n_ok,
                    BN: tl.constexpr, BK: tl.constexpr, dt, INT4: tl.constexpr):
    """_expert_gate_up through the expert of routed slot `slot` of the token (expert_ids [M, TOP_K])."""
    expert = tl.load(expert_ids + token * TOP_K + slot).to(tl.int64)
    if w.dtype.element_ty == tl.int8:
        w_scale_e = w_scale + expert * sws_e
    else:
        w_scale_e = w_scale
    return _expert_gate_up(a_row, a_scale, token, w + expert * sw_e, w_scale_e, rn, N, K, sw_n, n_ok, BN, BK, dt,
                           INT4)


# NPU budget (the NPU's tiles, matvec_config): two weight tiles [8, 512] (2 x 8 KiB bf16, 2 x 16 KiB fp32) and their
# fp32 products (2 x 16 KiB); int4: two byte tiles [4, 512] (2 x 2 KiB) and their int32 nibbles and products (2 x 2
# x 8 KiB).
@jit
def _matvec_gate_up_kernel(a, a_scale, w, w_scale, shared_w, shared_scale, expert_ids, out, N, K, TOP_K, n_tasks,
                           sa_m, sw_e, sw_n, sws_e, so_m, BN: tl.constexpr, BK: tl.constexpr, INT4: tl.constexpr):
    """Task t = (pair p = t // tiles_n, column tile): out[p, n] = silu(gate) * up of token p // SLOTS through
    the expert of slot p % SLOTS (gate rows n, up rows N + n of w [E, 2N, K]), rounded as grouped_gemm's GATED
    epilogue rounds. SLOTS = TOP_K routed slots (expert_ids [M, TOP_K]), plus, with shared_w, slot TOP_K: the
    shared expert shared_w [2N, K] (same row stride as w) - of w's kind, or a float one beside int8 routed
    experts. Float tokens a into int8 experts are quantized per token here (the row's scale from its absolute
    maximum, as quantize_per_token_int8) - no quantization launch, and the float row at hand for a float shared
    expert. The shared slot takes a branch of its own rather than choosing between its pointers and a routed
    expert's with tl.where, which triton-ascend's adapter cannot lower. INT4: w holds int4 row pairs, w [E, N, K]
    int8 bytes (the shared expert never does)."""
    SHARED: tl.constexpr = shared_w is not None
    tiles_n = (N + BN - 1) // BN
    slots = TOP_K + SHARED
    dt = out.dtype.element_ty
    for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        p = task // tiles_n
        token, slot = p // slots, p % slots
        rn = task % tiles_n * BN + tl.arange(0, BN)
        n_ok = rn < N
        a_row = a + tl.cast(token, tl.int64) * sa_m
        if SHARED:
            if slot == TOP_K:
                gate, up = _expert_gate_up(a_row, a_scale, token, shared_w, shared_scale, rn, N, K, sw_n, n_ok, BN,
                                           BK, dt, False)
            else:
                gate, up = _routed_gate_up(a_row, a_scale, token, slot, expert_ids, w, w_scale, rn, N, K, TOP_K,
                                           sw_e, sw_n, sws_e, n_ok, BN, BK, dt, INT4)
        else:
            gate, up = _routed_gate_up(a_row, a_scale, token, slot, expert_ids, w, w_scale, rn, N, K, TOP_K, sw_e,
                                       sw_n, sws_e, n_ok, BN, BK, dt, INT4)
        g = gate.to(tl.float32)
        h = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * up.to(tl.float32)).to(dt)
        tl.store(out + tl.cast(p, tl.int64) * so_m + rn, h, mask=n_ok)


@jit
def _down_product(h_row, h_scale, p, w_rows, w_s, K, n_ok, BN: tl.constexpr, BK: tl.constexpr,
                  ONE_K_TILE: tl.constexpr, dt):
    """h_row @ w_rows^T -> [BN] in dt: float, or int8 weights (per-channel scales w_s) with h_row int8 (its scale
    h_scale[p]) or float and quantized here."""
    INT8: tl.constexpr = w_rows.dtype.element_ty == tl.int8
    if INT8:
        if h_row.dtype.element_ty != tl.int8:
            x_s = _row_scale(h_row, K, BK)
        else:
            x_s = tl.load(h_scale + p)
    else:
        x_s = 1.0
    if ONE_K_TILE:  # no inner loop: the slot loop is innermost, and the compiler pipelines its loads
        acc = _row_times_tile(h_row, w_rows, 0, K, n_ok, BK, x_s)
    else:
        acc = tl.zeros([BN], dtype=tl.int32 if INT8 else tl.float32)
        for k0 in range(0, K, BK):
            acc += _row_times_tile(h_row, w_rows, k0, K, n_ok, BK, x_s)
    if INT8:
        return (acc.to(tl.float32) * x_s * tl.load(w_s, mask=n_ok, other=0.0)).to(dt)
    return acc.to(dt)


@jit
def _int4_down_product(h_row, h_scale, p, w_e, w_s, rn, K, sw_n, n_ok, BN: tl.constexpr, BK: tl.constexpr,
                       ONE_K_TILE: tl.constexpr, dt):
    """_down_product through packed int4 weights: w_e the expert's int8 bytes of row pairs (row stride sw_n), rows
    rn of the unpacked weight, per-channel scales w_s [BN]."""
    if h_row.dtype.element_ty != tl.int8:
        x_s = _row_scale(h_row, K, BK)
    else:
        x_s = tl.load(h_scale + p)
    rp, pair_ok = _pairs_of(rn, n_ok, BN)
    pairs = w_e + rp[:, None].to(tl.int64) * sw_n
    if ONE_K_TILE:
        even, odd = _pairs_times_tile(_row_tile_int8(h_row, 0, K, BK, x_s), pairs, 0, K, pair_ok, BK)
    else:
        even = tl.zeros([BN // 2], dtype=tl.int32)
        odd = tl.zeros([BN // 2], dtype=tl.int32)
        for k0 in range(0, K, BK):
            tile_even, tile_odd = _pairs_times_tile(_row_tile_int8(h_row, k0, K, BK, x_s), pairs, k0, K, pair_ok, BK)
            even += tile_even
            odd += tile_odd
    acc = tl.interleave(even, odd)
    return (acc.to(tl.float32) * x_s * tl.load(w_s, mask=n_ok, other=0.0)).to(dt)


@jit
def _routed_down(h_row, h_scale, p, routed, expert_ids, route_weight, w, w_scale, rn, K, sw_e, sw_n, sws_e, n_ok,
                 BN: tl.constexpr, BK: tl.constexpr, ONE_K_TILE: tl.constexpr, dt, INT4: tl.constexpr):
    """(the product of routed pair `routed` (expert_ids' flat index) through its expert's rows rn, its weight);
    INT4: the expert's weight int4 row pairs (_int4_down_product)."""
    expert = tl.load(expert_ids + routed).to(tl.int64)
    if w.dtype.element_ty == tl.int8:
        w_s = w_scale + expert * sws_e + rn
    else:
        w_s = w_scale
    if INT4:
        y = _int4_down_product(h_row, h_scale, p, w + expert * sw_e, w_s, rn, K, sw_n, n_ok, BN, BK, ONE_K_TILE, dt)
    else:
        y = _down_product(h_row, h_scale, p, w + expert * sw_e + rn[:, None].to(tl.int64) * sw_n, w_s, K, n_ok, BN,
                          BK, ONE_K_TILE, dt)
    return y, tl.load(route_weight + routed).to(tl.float32)


# NPU budget (the NPU's tiles, matvec_config): one weight tile [8, 512] (8 KiB bf16, 16 KiB fp32) and its fp32
# products (16 KiB); int4: one byte tile [4, 512] (2 KiB), its int32 nibbles and products (2 x 8 KiB).
@jit
def _matvec_down_kernel(h, h_scale, w, w_scale, shared_w, shared_scale, expert_ids, route_weight, shared_weight,
                        add_to, out, N, K, TOP_K, n_tasks, sh_m, sw_e, sw_n, sws_e, so_m, BN: tl.constexpr,
                        BK: tl.constexpr, ONE_K_TILE: tl.constexpr, INT4: tl.constexpr):
    """Task t = (token m = t // tiles_n, column tile): out[m, n] = the sum over slots s = 0..SLOTS-1, in that
    order and in fp32, of round(round(h[p] @ w_s[n]) * weight_s) with p = m SLOTS + s (each product rounded to
    out's dtype as grouped_gemm's ROUTED epilogue rounds), starting from add_to[m, n] when given (else 0),
    rounded once at the end. Slots s < TOP_K: expert expert_ids[m, s] of w [E, N, K], weight route_weight[m, s];
    slot TOP_K with shared_w: the shared expert shared_w [N, K] (w's row stride), weight shared_weight[m] - of
    w's kind, or float beside int8 routed experts, in a branch of its own (as _matvec_gate_up_kernel's). Float
    rows h into int8 experts are quantized per token here (no quantization launch). ONE_K_TILE: K <= BK. INT4:
    w holds int4 row pairs, w [E, N/2, K] int8 bytes (the shared expert never does)."""
    SHARED: tl.constexpr = shared_w is not None
    tiles_n = (N + BN - 1) // BN
    slots = TOP_K + SHARED
    dt = out.dtype.element_ty
    for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        m = task // tiles_n
        rn = task % tiles_n * BN + tl.arange(0, BN)
        n_ok = rn < N
        total = tl.zeros([BN], dtype=tl.float32)
        if add_to is not None:
            total += tl.load(add_to + tl.cast(m, tl.int64) * so_m + rn, mask=n_ok, other=0.0).to(tl.float32)
        for s in range(0, slots):
            p = m * slots + s
            h_row = h + tl.cast(p, tl.int64) * sh_m
            if SHARED:
                if s == TOP_K:
                    if shared_w.dtype.element_ty == tl.int8:
                        shared_s = shared_scale + rn
                    else:
                        shared_s = shared_scale
                    y = _down_product(h_row, h_scale, p, shared_w + rn[:, None].to(tl.int64) * sw_n, shared_s, K,
                                      n_ok, BN, BK, ONE_K_TILE, dt)
                    weight = tl.load(shared_weight + m).to(tl.float32)
                else:
                    y, weight = _routed_down(h_row, h_scale, p, m * TOP_K + s, expert_ids, route_weight, w, w_scale,
                                             rn, K, sw_e, sw_n, sws_e, n_ok, BN, BK, ONE_K_TILE, dt, INT4)
            else:
                y, weight = _routed_down(h_row, h_scale, p, m * TOP_K + s, expert_ids, route_weight, w, w_scale, rn,
                                         K, sw_e, sw_n, sws_e, n_ok, BN, BK, ONE_K_TILE, dt, INT4)
            total += (y.to(tl.float32) * weight).to(dt).to(tl.float32)
        tl.store(out + tl.cast(m, tl.int64) * so_m + rn, total.to(dt), mask=n_ok)


def _check_kinds(a: torch.Tensor, experts: StackedExperts, shared: StackedExperts | None, bn: int) -> None:
    """The kernels take int8 rows into int8 (or int4) experts only, and a float shared expert beside int8 experts
    needs the float rows (the kernels quantize them for the routed slots); int4 experts take column tiles of whole
    row pairs (bn even, a power of two as every tile), a shared expert never int4."""
    if experts.int4 and bn < 2:
        raise ValueError(f"int4 experts need column tiles of at least one row pair, got {bn}")
    if shared is not None and shared.int4:
        raise ValueError("a shared expert riding along is float or int8, never int4")
    if a.dtype == torch.int8 and not experts.quantized:
        raise ValueError(f"the matvec kernels take int8 rows with int8 experts only, got {experts.gate_up.dtype}")
    if shared is not None and a.dtype == torch.int8 and not shared.quantized:
        raise ValueError("a float shared expert beside int8 experts needs the float tokens")


def matvec_gate_up(a: torch.Tensor, a_scale: torch.Tensor | None, experts: StackedExperts, expert_ids: torch.Tensor,
                   out_dtype: torch.dtype, config: MatvecConfig, shared: StackedExperts | None = None
                   ) -> torch.Tensor:
    """silu(gate) * up of each routed pair -> [M * slots, N] (row token * slots + slot), slots = top_k, or top_k + 1
    with the shared expert (shares_layout) in the last slot.

    a [M, K] float, or int8 with a_scale [M] fp32 (int8 experts only; float tokens into int8 experts are quantized
    in the kernel); experts.gate_up [E, 2N, K] (int8: gate_up_scale [E, 2N]; int4: int8 [E, N, K] packed row
    pairs, read as such); expert_ids [M, top_k] int64."""
    m, top_k = expert_ids.shape
    w, w_scale = experts.gate_up, experts.gate_up_scale
    n, k = experts.intermediate, w.shape[2]
    _check_kinds(a, experts, shared, config.gate_up_bn)
    slots = top_k + (shared is not None)
    expert_ids = expert_ids.contiguous()
    out = torch.empty(m * slots, n, dtype=out_dtype, device=a.device)
    n_tasks = m * slots * -(-n // config.gate_up_bn)
    launch(_matvec_gate_up_kernel, persistent_grid(a.device, n_tasks), a, a_scale, w, w_scale,
           None if shared is None else shared.gate_up, None if shared is None else shared.gate_up_scale, expert_ids,
           out, n, k, top_k, n_tasks, a.stride(0), w.stride(0), w.stride(1),
           w_scale.stride(0) if experts.quantized else 0, out.stride(0), BN=config.gate_up_bn, BK=config.bk,
           INT4=experts.int4, **launch_options(a.device, num_warps=config.num_warps, num_stages=config.num_stages))
    return out


def matvec_down(h: torch.Tensor, h_scale: torch.Tensor | None, experts: StackedExperts, expert_ids: torch.Tensor,
                route_weight: torch.Tensor, out_dtype: torch.dtype, config: MatvecConfig,
                add_to: torch.Tensor | None = None, shared: StackedExperts | None = None,
                shared_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's expert outputs weighted and summed over its slots in slot order - the shared expert's last,
    when given - onto add_to when given -> [M, N] in out_dtype.

    h [M * slots, K] float, or int8 with h_scale [M * slots] fp32 (int8 experts only; float rows into int8 experts
    are quantized in the kernel); experts.down [E, N, K] (int4: int8 [E, N/2, K] packed row pairs, read as such);
    expert_ids [M, top_k] int64; route_weight [M, top_k]; shared_weight [M, 1]; add_to [M, N] contiguous,
    out_dtype."""
    m, top_k = expert_ids.shape
    w, w_scale = experts.down, experts.down_scale
    n, k = experts.hidden, w.shape[2]
    _check_kinds(h, experts, shared, config.down_bn)
    out = torch.empty(m, n, dtype=out_dtype, device=h.device)
    n_tasks = m * -(-n // config.down_bn)
    if add_to is not None and (add_to.shape != out.shape or add_to.stride() != out.stride()):
        raise ValueError(f"add_to must be a contiguous {tuple(out.shape)} tensor, got {tuple(add_to.shape)}")
    if shared_weight is not None and shared_weight.numel() != m:
        raise ValueError(f"shared_weight must hold one weight per token ({m}), got {shared_weight.numel()}")
    route_weight, expert_ids = route_weight.contiguous(), expert_ids.contiguous()
    launch(_matvec_down_kernel, persistent_grid(h.device, n_tasks), h, h_scale, w, w_scale,
           None if shared is None else shared.down, None if shared is None else shared.down_scale, expert_ids,
           route_weight, shared_weight, add_to, out, n, k, top_k, n_tasks, h.stride(0), w.stride(0), w.stride(1),
           w_scale.stride(0) if experts.quantized else 0, out.stride(0), BN=config.down_bn, BK=config.bk,
           ONE_K_TILE=k <= config.bk, INT4=experts.int4,
           **launch_options(h.device, num_warps=config.num_warps, num_stages=config.num_stages))
    return out


def matvec_experts(tokens: torch.Tensor, token_scales: torch.Tensor | None, experts: StackedExperts,
                   expert_ids: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype, config: MatvecConfig,
                   add_to: torch.Tensor | None = None, shared: StackedExperts | None = None,
                   shared_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The matvec path, two launches -> [M, H] in out_dtype: each token's weighted expert outputs summed in slot
    order (onto add_to [M, H] when given); with `shared` (shares_layout) and shared_weight [M, 1], the shared
    expert as one more slot after the routed ones. Int8 experts quantize the float intermediate in the down
    kernel.

    tokens [M, H] float, or int8 with token_scales [M] fp32 (int8 experts only); expert_ids [M, top_k] int64;
    weights [M, top_k] in out_dtype."""
    h = matvec_gate_up(tokens, token_scales, experts, expert_ids, out_dtype, config, shared=shared)
    return matvec_down(h, None, experts, expert_ids, weights, out_dtype, config, add_to=add_to, shared=shared,
                       shared_weight=shared_weight)
