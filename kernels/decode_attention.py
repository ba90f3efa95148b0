"""Decode / verify attention over a static KV cache: the model's `attend` (runtime/model.py) for a step of T <= 8
tokens per request, with the output gate `attention * sigmoid(gate)` fused in, as Triton flash-decoding over
fixed-size key splits, and the PyTorch reference beside it.

The kernel is two launches:
- _split_kernel, grid (B * Hkv, n_splits) with n_splits = ceil(S / SPLIT) fixed by the cache capacity S (the step
  is captured as a CUDA graph: the grid may not depend on the data). Program (b, kv head, j) takes the keys at
  positions [j * SPLIT, (j + 1) * SPLIT) in BLOCK_N-key blocks, in ascending order, for all GROUP = Hq / Hkv query
  heads of its kv head and all T tokens at once: a [GROUP * T rows padded to a power of 2 >= 16, D] query tile goes
  through tl.dot with each key block, so that each K / V block is read once for the whole group, and an online
  softmax in fp32 applies the causal mask per query row. Per row it writes the running max, the sum and the
  unnormalised fp32 accumulator to a workspace. A program whose keys all lie past the last position its request
  sees (start[b] + T - 1) writes empty partials (max -inf, sum 0) and loads no key.
- _combine_kernel, one program per token and kv head (b, t, kv head), for its GROUP query heads: merges each row's
  partials of the splits holding the row's keys in ascending split order, divides, rounds to q's dtype and applies
  the gate.

The workspace (per query row and split: max, sum, D accumulator floats, all fp32) is allocated per call with
torch.empty, from B, T, Hq, n_splits and D alone, which a captured graph allows.

A row's result depends on its own query, its request's cache and its position alone - not on B, T or where the row
sits in the tile (bit for bit: the tests pin it in the interpreter, and it held on an H100 for T = 1..8 and GROUP 4 to
16, bf16 and float32): the arithmetic of a tile is row by row - tl.dot, elementwise steps, a max, and the weights'
row sums in fixed point (_row_sums), which no reduction order changes; the splits and blocks start at fixed key
positions; a block that holds none of a row's keys leaves the row's running state exactly as it was (a factor
exp2(0) = 1, weights 0); and the combine takes only the splits that hold the row's keys, in ascending order. Keys
past the last visible position are never loaded (masked loads), so whatever the unused cache holds, inf or NaN,
cannot reach the result.

Precision: bf16 / fp16 values meet the fp32 weights as two 16-bit halves (_weighted_values), so that the result is
that of an fp32 softmax rounded once: on an H100 99.9% of bf16 outputs equalled the float64 result rounded to bf16,
the rest within 2 ulps (PyTorch's bf16 scaled_dot_product_attention: about 77%).
"""

from __future__ import annotations

import math

import torch

from npuport.kernels.implementations import NATIVE, TRITON, runnable
from npuport.kernels.launch import (
    is_npu,
    jit,
    launch,
    launch_options,
    next_power_of_2,
    persistent_grid,
    tl,
    unit_last_stride,
    use_triton,
)
from npuport.kernels.npu import attention as native

# Keys per split: one program's share of the cache. 256 keeps the number of programs up at short contexts (one
# request, 2 kv heads and 1k tokens still give 8 programs) and the workspace small at long ones (n_splits partial
# rows of D + 2 floats per query row: 128 splits at 32k tokens). On an H100 (bf16, Hq 16 / Hkv 2 / D 256) 128 was
# slower at every size tried and 512 within 10% either way; 32 requests at 4k tokens took 123 us, 2.1 TB/s of K / V.
SPLIT = 256
# Keys per tl.dot block inside a split: at D = 256 a [64, 256] bf16 K or V block is 32 KiB (float32 caches take
# half as many keys: block_keys).
BLOCK_N = 64
# The most tokens per request the kernel takes (decode is 1, a speculative verify a few): the query tile holds
# GROUP * T rows. Longer steps (prefill) and heads wider than MAX_HEAD_DIM go to the reference.
MAX_TOKENS = 8
MAX_HEAD_DIM = 256
LOG2E = math.log2(math.e)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor,
                     gate: torch.Tensor | None = None, plan_tokens: int | None = None) -> torch.Tensor:
    """Causal GQA attention of a decode / verify step over a whole static cache, optionally gated.

    q [B, T, Hq, D] (last dim contiguous, other strides free) at positions start[b] + t; keys, values [B, S, Hkv, D],
    position s at index s; start [B] int64. Query t of request b sees the keys at positions 0..start[b] + t; query
    head h reads kv head h // (Hq // Hkv); scale D ** -0.5; the softmax in fp32. gate: None or [B, T, Hq, D] laid out
    as q; given, the result is attention * sigmoid(gate) as PyTorch computes it in q's dtype. Returns a contiguous
    [B, T, Hq, D] in q's dtype. plan_tokens: the query tile of a step of that many tokens, whatever T is
    (batch-invariant steps: a decode step's products then take a verify step's tensor-core instructions)."""
    triton = use_triton(q, keys, values) and max(q.shape[1], plan_tokens or 0) <= MAX_TOKENS \
        and q.shape[-1] <= MAX_HEAD_DIM
    # A batch-invariant step (plan_tokens) does not take the native operator: it tiles by the call's shape, and its
    # documentation does not promise a row's bits independent of the other rows.
    refusal = None if plan_tokens is not None else lambda: native.decode_attention_refusal(q, keys, values)
    chosen = runnable("decode_attention", q.device, refusal, triton)
    if chosen == NATIVE:
        return native.decode_attention_native(q, keys, values, start, gate)
    if chosen == TRITON:
        return decode_attention_triton(q, keys, values, start, gate, plan_tokens=plan_tokens)
    return decode_attention_reference(q, keys, values, start, gate)


# The most scores (batch x heads x queries x keys) the reference holds at once: longer steps (the MTP head's prefill
# chunks) take their queries a block at a time. A serve chunk of one 16,384-token row over 16,384 positions held
# 16 GiB of fp32 scores, twice over, and its warm-up ran a server out of memory on an 80 GB GPU.
REFERENCE_SCORES = 1 << 26


def decode_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor,
                               gate: torch.Tensor | None = None) -> torch.Tensor:
    """decode_attention in PyTorch: a masked softmax per head in fp32 (float64 for float64), the weighted sum of the
    values, rounded once to q's dtype, then the gate as the model applies it. Queries go a block at a time where
    their scores would pass REFERENCE_SCORES (each query's result its own: a softmax over its own keys)."""
    b, t, hq, _ = q.shape
    block = max(1, REFERENCE_SCORES // (b * hq * keys.shape[1]))
    if t <= block:
        return _attend_block(q, keys, values, start, gate)
    return torch.cat([_attend_block(q[:, i:i + block], keys, values, start + i,
                                    None if gate is None else gate[:, i:i + block]) for i in range(0, t, block)],
                     dim=1)


def _attend_block(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor,
                  gate: torch.Tensor | None) -> torch.Tensor:
    """decode_attention_reference of one block of queries q [B, t, Hq, D] at positions start[b] + t."""
    b, t, hq, d = q.shape
    s, hkv = keys.shape[1], keys.shape[2]
    wide = torch.promote_types(q.dtype, torch.float32)
    positions = start[:, None] + torch.arange(t, device=q.device)  # [B, T]
    key_pos = torch.arange(s, device=q.device)
    visible = key_pos[None, None, :] <= positions[:, :, None]  # [B, T, S]
    # What lies past the last position a request sees is never read: zero it, garbage included.
    written = (key_pos[None, :] <= positions[:, -1:])[:, :, None, None]  # [B, S, 1, 1]
    k = torch.where(written, keys, 0).to(wide).repeat_interleave(hq // hkv, dim=2)  # [B, S, Hq, D]
    v = torch.where(written, values, 0).to(wide).repeat_interleave(hq // hkv, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.to(wide), k).mul_(d**-0.5)
    weights = torch.softmax(scores.masked_fill_(~visible[:, None], float("-inf")), dim=-1)
    out = torch.einsum("bhts,bshd->bthd", weights, v).to(q.dtype)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return out.contiguous()


@jit
def _weighted_values(p, v_block, acc):
    """acc + p @ v_block, p [BM, BLOCK_N] fp32 weights. With 16-bit values p goes in as two 16-bit halves (p's
    rounding and what it left), so that the weights keep ~16 bits rather than 8 and the result stays within the
    rounding of an fp32 softmax."""
    if v_block.dtype == tl.float32:
        return tl.dot(p, v_block, acc, input_precision="ieee")
    p_hi = p.to(v_block.dtype)
    p_lo = (p - p_hi.to(tl.float32)).to(v_block.dtype)
    acc = tl.dot(p_hi, v_block, acc, input_precision="ieee")
    return tl.dot(p_lo, v_block, acc, input_precision="ieee")


@jit
def _row_sums(p, SCALE: tl.constexpr):
    """The row sums of p [BM, BLOCK_N] (weights in [0, 1]) in fixed point: each weight rounded to a multiple of
    1 / SCALE and added as an integer, so that the sum is exact and the same in any order - a float tl.sum adds in
    an order that follows the tile's layout, and so on a GPU the tile height, which changes with T. The rounding
    costs under 1 / SCALE per weight against a row sum of at least 1 (the running max's own weight)."""
    return tl.sum((p * SCALE + 0.5).to(tl.int32), 1).to(tl.float32) * (1.0 / SCALE)


# NPU budget (D = 256, BLOCK_N = 64, BM query rows): the query tile BM x 512 B, K and V blocks 2 x 32 KiB, scores and
# weights BM x 256 B each in fp32, the accumulator BM x 1 KiB - 96 KiB at BM = 16 (decode, GROUP <= 16), 192 KiB at
# BM = 64 (GROUP 8 and T = 8), 320 KiB at BM = 128 (GROUP 16 and T = 8: too much for an NPU's 192 KiB unified buffer);
# over the ~70 KiB multi-buffering leaves from BM = 16 on, so the NPU launch turns it off.
@jit
def _split_kernel(q, k, v, start, m_ws, l_ws, acc_ws, T, Hq, Hkv, S, n_splits, sq_b, sq_t, sq_h, sk_b, sk_s, sk_h,
                  sv_b, sv_s, sv_h, qk_scale, GROUP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                  BM: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, SUM_SCALE: tl.constexpr):
    """Partials of split j for the GROUP query heads of one kv head, all T tokens of request b: per row the max of
    the scores (log2 units: qk_scale holds log2(e)), the sum of the weights exp2(score - max) and the unnormalised
    sum of the weighted values, over the keys of the split that the row sees."""
    pid, j = tl.program_id(0), tl.program_id(1)
    b, kv_head = (pid // Hkv).to(tl.int64), pid % Hkv
    rows = tl.arange(0, BM)  # row r: token r // GROUP, query head kv_head * GROUP + r % GROUP
    token = rows // GROUP
    row_ok = rows < GROUP * T
    head = kv_head * GROUP + rows % GROUP
    ws_row = ((b * T + token) * Hq + head) * n_splits + j  # [BM] int64
    first = j * SPLIT
    q_pos = tl.load(start + b) + token  # [BM]: the last key position each row sees
    end = tl.minimum(tl.minimum(tl.load(start + b) + T, S), first + SPLIT)  # past this split's last visible key
    if first < end:
        dims = tl.arange(0, BD)
        dim_ok = dims < D
        q_tile = tl.load(q + b * sq_b + token[:, None] * sq_t + head[:, None] * sq_h + dims[None, :],
                         mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        k_head = k + b * sk_b + kv_head * sk_h
        v_head = v + b * sv_b + kv_head * sv_h
        m = tl.full([BM], float("-inf"), tl.float32)
        l_sum = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, BD], tl.float32)
        for n0 in range(first, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            load_ok = (n < end)[:, None] & dim_ok[None, :]
            at = n.to(tl.int64)[:, None]
            k_block = tl.load(k_head + at * sk_s + dims[None, :], mask=load_ok, other=0.0)
            scores = tl.dot(q_tile, tl.trans(k_block), input_precision="ieee") * qk_scale
            visible = row_ok[:, None] & (n[None, :] <= q_pos[:, None]) & (n < end)[None, :]
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet stays empty
            alpha = tl.exp2(m - m_safe)
            p = tl.exp2(scores - m_safe[:, None])
            l_sum = l_sum * alpha + _row_sums(p, SUM_SCALE)
            v_block = tl.load(v_head + at * sv_s + dims[None, :], mask=load_ok, other=0.0)
            acc = _weighted_values(p, v_block, acc * alpha[:, None])
            m = m_new
        tl.store(m_ws + ws_row, m, mask=row_ok)
        tl.store(l_ws + ws_row, l_sum, mask=row_ok)
        tl.store(acc_ws + ws_row[:, None] * D + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
    else:  # no key of the split is visible to the request: empty partials, the accumulator left unwritten (the
        # combine stops at the last split that holds a row's keys, so it reads none of them)
        tl.store(m_ws + ws_row, tl.full([BM], float("-inf"), tl.float32), mask=row_ok)
        tl.store(l_ws + ws_row, tl.zeros([BM], tl.float32), mask=row_ok)


# NPU budget (D = 256, BG = GROUP padded to a power of 2): the accumulator, one split's partial and the gate, each
# [BG, 256] in fp32 - 48 KiB at GROUP = 16.
@jit
def _combine_kernel(m_ws, l_ws, acc_ws, gate, start, out, M, T, Hkv, S, n_splits, sg_b, sg_t, sg_h,
                    GROUP: tl.constexpr, D: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, SPLIT: tl.constexpr,
                    HAS_GATE: tl.constexpr):
    """Per token (b, t) and kv head, for its GROUP query heads: each row's partials merged in ascending split order
    (the splits that hold keys 0..start[b] + t), normalised, rounded to out's dtype - and, HAS_GATE, times
    sigmoid(gate) as PyTorch computes it (sigmoid in fp32 rounded to the dtype, the product in fp32 rounded to the
    dtype). Row by row: a row's result does not depend on the others."""
    dtype = out.dtype.element_ty
    dims = tl.arange(0, BD)
    in_group = tl.arange(0, BG)
    ok = (in_group < GROUP)[:, None] & (dims < D)[None, :]
    for task in range(tl.program_id(0), M, tl.num_programs(0)):
        at = tl.cast(task, tl.int64)
        kv_head, token, b = at % Hkv, (at // Hkv) % T, at // (Hkv * T)
        head = kv_head * GROUP + in_group  # [BG]
        row = (b * T + token) * (Hkv * GROUP) + head
        base = row * n_splits  # [BG]: split 0 of each row, which always holds key 0, so m is finite
        last = tl.minimum(tl.load(start + b) + token, S - 1)
        m = tl.load(m_ws + base, mask=in_group < GROUP, other=0.0)
        l_sum = tl.load(l_ws + base, mask=in_group < GROUP, other=1.0)
        acc = tl.load(acc_ws + base[:, None] * D + dims[None, :], mask=ok, other=0.0)
        for j in range(1, last // SPLIT + 1):
            m_j = tl.load(m_ws + base + j, mask=in_group < GROUP, other=0.0)
            m_new = tl.maximum(m, m_j)
            alpha, beta = tl.exp2(m - m_new), tl.exp2(m_j - m_new)
            l_sum = l_sum * alpha + tl.load(l_ws + base + j, mask=in_group < GROUP, other=0.0) * beta
            partial = tl.load(acc_ws + (base + j)[:, None] * D + dims[None, :], mask=ok, other=0.0)
            acc = acc * alpha[:, None] + partial * beta[:, None]
            m = m_new
        o = (acc / l_sum[:, None]).to(dtype)
        if HAS_GATE:
            g = tl.load(gate + b * sg_b + token * sg_t + head[:, None] * sg_h + dims[None, :], mask=ok, other=0.0)
            sig = (1.0 / (1.0 + tl.exp(-g.to(tl.float32)))).to(dtype)
            o = (o.to(tl.float32) * sig.to(tl.float32)).to(dtype)
        tl.store(out + row[:, None] * D + dims[None, :], o, mask=ok)


def block_keys(dtype: torch.dtype, device: torch.device | None = None) -> int:
    """Keys per block for a cache of this dtype: BLOCK_N for 16-bit caches, half as many for float32 ones (the same
    tile bytes); on an NPU (`device`) half as many again, so that a query tile of 64 rows (GROUP 16, T = 4) and its
    accumulator fit one core's unified buffer beside the K and V blocks in float32 too."""
    keys = BLOCK_N if dtype.itemsize <= 2 else BLOCK_N // 2
    return keys // 2 if device is not None and is_npu(device) else keys


def split_warps(rows: int) -> int:
    """Warps of the split kernel for a query tile of `rows` rows: 4, and 8 past 32 rows, where the [rows, 256] fp32
    accumulator no longer fits 4 warps' registers (on an H100, GROUP 16 and T = 8: 860 us with 4 warps, 320 with 8)."""
    return 4 if rows <= 32 else 8


def decode_attention_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor,
                            gate: torch.Tensor | None = None, *, split: int = SPLIT,
                            block_n: int | None = None, plan_tokens: int | None = None) -> torch.Tensor:
    """The Triton kernels behind decode_attention (any device; CPU tensors run in Triton's interpreter). split and
    block_n (powers of 2, 16 <= block_n <= 128 dividing split) override SPLIT and the cache's block_keys, for tests;
    plan_tokens: decode_attention's."""
    b, t, hq, d = q.shape
    s, hkv = keys.shape[1], keys.shape[2]
    block_n = block_keys(keys.dtype, q.device) if block_n is None else block_n
    if hq % hkv != 0 or split % block_n != 0 or not 16 <= block_n <= 128:
        raise ValueError(f"{hq} query heads over {hkv} kv heads, splits of {split} keys in blocks of {block_n}")
    group = hq // hkv
    q, keys, values = unit_last_stride(q), unit_last_stride(keys), unit_last_stride(values)
    gate = None if gate is None else unit_last_stride(gate)
    start = start.to(device=q.device, dtype=torch.int64)
    n_splits = -(-s // split)
    m_ws = torch.empty((b, t, hq, n_splits), dtype=torch.float32, device=q.device)
    l_ws = torch.empty_like(m_ws)
    acc_ws = torch.empty((b, t, hq, n_splits, d), dtype=torch.float32, device=q.device)
    out = torch.empty((b, t, hq, d), dtype=q.dtype, device=q.device)
    block_d = max(16, next_power_of_2(d))
    rows = max(16, next_power_of_2(group * max(t, plan_tokens or t)))
    sum_scale = 2 ** (31 - block_n.bit_length())  # block_n weights of at most sum_scale each stay under 2^31
    launch(_split_kernel, (b * hkv, n_splits), q, keys, values, start, m_ws, l_ws, acc_ws, t, hq, hkv, s, n_splits,
           q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0),
           values.stride(1), values.stride(2), d**-0.5 * LOG2E, GROUP=group, D=d, BD=block_d, BM=rows, SPLIT=split,
           BLOCK_N=block_n, SUM_SCALE=sum_scale,
           **launch_options(q.device, num_warps=split_warps(rows), num_stages=2, npu={"multibuffer": False}))
    tasks = b * t * hkv
    gate_strides = (0, 0, 0) if gate is None else (gate.stride(0), gate.stride(1), gate.stride(2))
    launch(_combine_kernel, persistent_grid(q.device, tasks), m_ws, l_ws, acc_ws, gate, start, out, tasks, t, hkv,
           s, n_splits, *gate_strides, GROUP=group, D=d, BG=next_power_of_2(group), BD=block_d, SPLIT=split,
           HAS_GATE=gate is not None, **launch_options(q.device, num_warps=4))
    return out
