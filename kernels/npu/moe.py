"""A MoE layer's routing and experts through CANN's MoE operators: npu_moe_gating_top_k_softmax (the router's top-k,
renormalised here), npu_moe_init_routing_v2 (each token's rows grouped by expert, quantized per row for W8A8
experts), npu_grouped_matmul (gate / up and down of every expert, BF16 or int8 with per-token scales; silu(gate) * up
and, for W8A8, npu_dynamic_quant between them) and npu_moe_finalize_routing (the weighted sum over each token's slots,
the shared expert added in). No host synchronisation: a graph can capture it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from npuport.kernels.npu import operators as ops
from npuport.kernels.npu.operators import BF16_FP16, FLOATS, documented_dtype, first_refusal

if TYPE_CHECKING:
    from npuport.kernels.fused_moe.experts import StackedExperts

MAX_TOP_K = 1024  # npu_moe_gating_top_k_softmax
MAX_GROUPS = 1024  # npu_grouped_matmul: groups of one group_list
INNER_LIMIT = 65536  # npu_grouped_matmul: the last dim of x and of each weight, exclusive


def moe_routing_refusal(router_logits: torch.Tensor, top_k: int) -> str | None:
    """The documented constraint of npu_moe_gating_top_k_softmax that route_top_k breaks, or None."""
    return first_refusal(
        (documented_dtype(router_logits.dtype, FLOATS), f"npu_moe_gating_top_k_softmax takes bf16 / fp16 / fp32, "
                                                        f"not {router_logits.dtype}"),
        (router_logits.dim() == 2 and 0 < top_k <= min(router_logits.shape[-1], MAX_TOP_K),
         "npu_moe_gating_top_k_softmax wants 0 < k <= E and k <= 1024"),
    )


def moe_routing_native(router_logits: torch.Tensor, top_k: int, weight_dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """route_top_k's call: router_logits [M, E] -> (weights [M, top_k] in weight_dtype, expert ids [M, top_k] int64).
    The logits go in as fp32 (a documented dtype: the softmax of the reference; float64 stays float64), the top-k
    are renormalised in that dtype."""
    wide = torch.promote_types(router_logits.dtype, torch.float32)
    values, experts, _ = ops.npu_operators().npu_moe_gating_top_k_softmax(router_logits.to(wide), k=top_k)
    return (values / values.sum(-1, keepdim=True)).to(weight_dtype), experts.long()


def _experts_refusal(x_dtype: torch.dtype, experts: StackedExperts) -> str | None:
    if experts.quantized:
        dtype_ok = documented_dtype(x_dtype, BF16_FP16)
        why = f"npu_grouped_matmul's per-token quantized form outputs bf16 / fp16, not {x_dtype}"
    else:
        dtype_ok = documented_dtype(x_dtype, FLOATS) and experts.gate_up.dtype == experts.down.dtype == x_dtype
        why = f"npu_grouped_matmul takes bf16 / fp16 / fp32 tokens and weights alike, not {x_dtype}"
    return first_refusal(
        (dtype_ok, why),
        (experts.num_experts <= MAX_GROUPS, f"npu_grouped_matmul takes up to {MAX_GROUPS} groups"),
        (max(experts.hidden, 2 * experts.intermediate) < INNER_LIMIT, "npu_grouped_matmul's inner limit is 65536"),
    )


def moe_experts_refusal(x: torch.Tensor, experts: StackedExperts, shared: StackedExperts | None = None) -> str | None:
    """The documented constraint of the MoE operators that moe_experts_native's call breaks, or None (the routing
    weights come in x's dtype: route_top_k's)."""
    if x.dim() != 2:
        return "npu_moe_finalize_routing wants 2-D tokens"
    return _experts_refusal(x.dtype, experts) or (None if shared is None else _experts_refusal(x.dtype, shared))


def _grouped(npu, rows: torch.Tensor, row_scales: torch.Tensor | None, weight: torch.Tensor,
             weight_scale: torch.Tensor | None, counts: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """rows [R, K] (grouped by expert, counts [E] rows each) times weight [E, N, K] of their expert -> [R, N] in
    out_dtype: the weight as its transpose [E, K, N] (a view), int8 with the per-token scales row_scales [R] and the
    per-channel weight_scale [E, N]."""
    quantized = weight.dtype == torch.int8
    return npu.npu_grouped_matmul([rows], [weight.transpose(1, 2)], scale=[weight_scale] if quantized else None,
                                  per_token_scale=[row_scales] if quantized else None, group_list=counts,
                                  split_item=2, group_type=0, group_list_type=1,
                                  output_dtype=out_dtype if quantized else None, tuning_config=None)[0]


def _expert_mlps(npu, rows: torch.Tensor, row_scales: torch.Tensor | None, experts: StackedExperts,
                 counts: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """down(silu(gate(rows)) * up(rows)) of each row's expert -> [R, H] in out_dtype, each product rounded to it as
    separate linear layers round it; W8A8 experts quantize the intermediate per row again."""
    i = experts.intermediate
    gate_up = _grouped(npu, rows, row_scales, experts.gate_up, experts.gate_up_scale, counts, out_dtype)
    h, h_scales = F.silu(gate_up[:, :i]) * gate_up[:, i:], None
    if experts.quantized:
        h, h_scales = npu.npu_dynamic_quant(h)
    return _grouped(npu, h, h_scales, experts.down, experts.down_scale, counts, out_dtype)


def _shared_expert(npu, x: torch.Tensor, expert: StackedExperts) -> torch.Tensor:
    """One expert (E = 1) on every token x [M, H] -> [M, H]: one group of M rows."""
    counts = torch.full((1,), x.shape[0], dtype=torch.int64, device=x.device)
    rows, scales = npu.npu_dynamic_quant(x) if expert.quantized else (x, None)
    return _expert_mlps(npu, rows, scales, expert, counts, x.dtype)


def moe_experts_native(x: torch.Tensor, experts: StackedExperts, weights: torch.Tensor, expert_ids: torch.Tensor,
                       shared: tuple[StackedExperts, torch.Tensor] | None = None,
                       x_int8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """fused_experts_reference's call: x [M, H]; weights [M, top_k] (x's dtype); expert_ids [M, top_k] -> [M, H] in
    x's dtype, the sum over each token's slots of weight * expert(x); shared = (one expert, weight [M, 1]) added in;
    x_int8 = (values int8 [M, H], scales fp32 [M, 1]): the tokens as they arrived quantized, for W8A8 experts.
    A batch-invariant step must not take it (it has no plan_tokens: the grouped GEMM tiles by the call's rows)."""
    m, top_k = expert_ids.shape
    npu = ops.npu_operators()
    arrived = x_int8 is not None and experts.quantized
    tokens, token_scales = (x_int8[0], x_int8[1].reshape(-1).float()) if arrived else (x, None)
    rows, source_to_row, counts, row_scales = npu.npu_moe_init_routing_v2(
        tokens, expert_ids.to(torch.int32), scale=token_scales, active_num=m * top_k,
        expert_num=experts.num_experts, expert_tokens_num_type=1, expert_tokens_num_flag=True,
        quant_mode=1 if experts.quantized and not arrived else -1, active_expert_range=[0, experts.num_experts])
    out_rows = _expert_mlps(npu, rows, row_scales if experts.quantized else None, experts, counts, x.dtype)
    skip1 = skip2 = None
    if shared is not None:
        skip1 = _shared_expert(npu, x, shared[0]) * shared[1]
        skip2 = torch.zeros_like(skip1)  # the operator takes skip1 only beside a skip2
    # init_routing's gather index is per source (t, k) at t * top_k + k; finalize reads source (t, k) at t + k * M
    by_slot = source_to_row.view(m, top_k).t().reshape(-1)
    return npu.npu_moe_finalize_routing(out_rows, skip1, skip2, None, weights, by_slot, None, drop_pad_mode=0,
                                        k=top_k)
