"""Routing on the device, without a host synchronisation: the router's softmax top-k (renormalised), and the
(token, slot) rows grouped by expert and padded to the grouped kernels' block of rows, as vLLM's
moe_align_block_size lays them out. Every output has a shape known from (M, top_k, E, block) alone, the padded
worst case, so a step that routes can be captured as a graph."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from npuport.kernels.implementations import NATIVE, TRITON, runnable
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
from npuport.kernels.npu.moe import moe_routing_native, moe_routing_refusal


def route_top_k(router_logits: torch.Tensor, top_k: int, weight_dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [M, E] -> (weights [M, top_k] in weight_dtype, expert ids [M, top_k] int64): softmax in
    fp32 (float64 for float64 logits), the top_k largest in descending order, divided by their sum (Qwen3.5
    always renormalises), then rounded to weight_dtype (the activations' dtype, in which the weights multiply
    expert outputs). On an NPU npu_moe_gating_top_k_softmax where its constraints hold, else one Triton launch on
    a GPU or NPU."""
    chosen = runnable("moe_routing", router_logits.device, lambda: moe_routing_refusal(router_logits, top_k),
                      use_triton(router_logits))
    if chosen == NATIVE:
        return moe_routing_native(router_logits, top_k, weight_dtype)
    if chosen == TRITON:
        return route_top_k_triton(router_logits, top_k, weight_dtype)
    return route_top_k_reference(router_logits, top_k, weight_dtype)


def route_top_k_reference(router_logits: torch.Tensor, top_k: int, weight_dtype: torch.dtype
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(router_logits.to(torch.promote_types(router_logits.dtype, torch.float32)), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).to(weight_dtype), ids


# NPU budget: one row of logits and its probabilities, [BE] fp32 with BE <= 512: 4 KiB.
@jit
def _route_kernel(logits, weights, ids, M, E, s_m, TOP_K: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr):
    """Row m: softmax over the E logits, then TOP_K times the largest remaining probability (the lowest index
    among equals), weights = those probabilities over their sum."""
    cols = tl.arange(0, BE)
    slots = tl.arange(0, BK)
    for m in range(tl.program_id(0), M, tl.num_programs(0)):
        row = tl.load(logits + tl.cast(m, tl.int64) * s_m + cols, mask=cols < E, other=float("-inf")).to(tl.float32)
        p = tl.exp(row - tl.max(row, 0))
        p = p / tl.sum(p, 0)
        p = tl.where(cols < E, p, -1.0)
        vals = tl.zeros([BK], dtype=tl.float32)
        picked = tl.zeros([BK], dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.max(p, 0)
            at = tl.min(tl.where(p == best, cols, BE), 0)
            vals = tl.where(slots == j, best, vals)
            picked = tl.where(slots == j, at, picked)
            p = tl.where(cols == at, -1.0, p)
        ok = slots < TOP_K
        total = tl.sum(tl.where(ok, vals, 0.0), 0)
        tl.store(weights + m * TOP_K + slots, (vals / total).to(weights.dtype.element_ty), mask=ok)
        tl.store(ids + m * TOP_K + slots, picked.to(tl.int64), mask=ok)


def route_top_k_triton(router_logits: torch.Tensor, top_k: int, weight_dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel behind route_top_k (any device; CPU tensors run in Triton's interpreter)."""
    m, e = router_logits.shape
    weights = torch.empty(m, top_k, dtype=weight_dtype, device=router_logits.device)
    ids = torch.empty(m, top_k, dtype=torch.int64, device=router_logits.device)
    logits = unit_last_stride(router_logits)
    launch(_route_kernel, persistent_grid(logits.device, m), logits, weights, ids, m, e, logits.stride(0),
           TOP_K=top_k, BE=next_power_of_2(e), BK=next_power_of_2(top_k),
           **launch_options(logits.device, num_warps=4))
    return weights, ids


@dataclass
class BlockRouting:
    """The rows of a grouped expert GEMM, grouped by expert in blocks of `block` rows.

    rows [max_blocks * block] int32: row r = token * top_k + slot of each routed pair, expert by expert, each
    expert's rows padded to a whole block with the sentinel M * top_k (a row that does not exist). Within an
    expert rows keep token order. block_expert [max_blocks] int32: the expert of each block, -1 past the last
    used block (those blocks are skipped)."""

    rows: torch.Tensor
    block_expert: torch.Tensor
    block: int
    pairs: int  # M * top_k: the number of real rows, and the sentinel


def max_blocks(pairs: int, num_experts: int, block: int) -> int:
    """Blocks that `pairs` routed rows can need at most: each expert that gets rows wastes < one block."""
    return -(-(pairs + min(num_experts, pairs) * (block - 1)) // block)


def group_by_expert(expert_ids: torch.Tensor, num_experts: int, block: int) -> BlockRouting:
    """expert_ids [M, top_k] -> BlockRouting, with device ops only (no .item(), no data-dependent shape)."""
    device = expert_ids.device
    flat = expert_ids.reshape(-1)
    pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    padded_end = padded.cumsum(0)  # [E]: where each expert's padded rows end
    order = torch.sort(flat, stable=True).indices  # pairs by expert, token order kept within one
    sorted_experts = flat[order]
    first_of_expert = counts.cumsum(0) - counts  # [E]: the first sorted position of each expert
    rank = torch.arange(pairs, device=device) - first_of_expert[sorted_experts]
    dest = padded_end[sorted_experts] - padded[sorted_experts] + rank
    n_blocks = max_blocks(pairs, num_experts, block)
    rows = torch.full((n_blocks * block,), pairs, dtype=torch.int32, device=device)
    rows.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(n_blocks, device=device) * block
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)  # E past the last used block
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return BlockRouting(rows, block_expert, block, pairs)
