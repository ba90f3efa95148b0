"""The routed experts of a MoE layer on a GPU or NPU, without a host synchronisation: for few routed pairs
(decode, verify) two mat-vec launches (few_tokens.py: gate/up with silu(gate) * up fused, down with the
routing weight and the top-k sum fused); for many (prefill) the rows grouped by expert and two grouped GEMMs
(grouped_gemm.py) and the top-k sum. W8A8 experts add the per-token quantization of the tokens and of the
intermediate."""

from __future__ import annotations

import torch

from npuport.kernels.fused_moe.experts import StackedExperts
from npuport.kernels.fused_moe.few_tokens import (
    FewTokensConfig,
    few_tokens_config,
    pair_gate_up,
    shares_layout,
    token_down,
)
from npuport.kernels.fused_moe.grouped_gemm import GroupedConfig, grouped_config, grouped_gemm
from npuport.kernels.fused_moe.naive import expert_mlp_reference, fused_experts_reference, sum_slots
from npuport.kernels.fused_moe.routing import group_by_expert
from npuport.kernels.launch import use_triton
from npuport.kernels.w8a8 import quantize_per_token_int8


def fused_experts(x: torch.Tensor, experts: StackedExperts, weights: torch.Tensor, expert_ids: torch.Tensor,
                  x_int8: tuple[torch.Tensor, torch.Tensor] | None = None, plan_tokens: int | None = None
                  ) -> torch.Tensor:
    """x [M, H]; weights [M, top_k] (x's dtype, renormalised); expert_ids [M, top_k] -> [M, H] in x's dtype:
    sum over slots of weight * expert(x). x_int8 = (values int8 [M, H], scales fp32 [M, 1]): x already
    quantized per token (int8 dispatch), for W8A8 experts; the same values they would compute from x.
    plan_tokens: choose the kernels and tiles as for that many tokens (each token's bits then do not depend on
    M, for M up to plan_tokens: batch-invariant steps); default M."""
    if use_triton(x):
        return fused_experts_triton(x, experts, weights, expert_ids, x_int8, plan_tokens=plan_tokens)
    return fused_experts_reference(x, experts, weights, expert_ids, x_int8=x_int8)


# Up to this many routed pairs (token x slot) the mat-vec kernels run; beyond, the grouped GEMMs, whose
# weight tiles serve every row of an expert at once. At the 35B-A3B widths on an H200 the mat-vec kernels were
# 1.4-2x faster at 128 pairs (bench/RESULTS.md).
FEW_PAIRS = 128


def fused_experts_triton(x: torch.Tensor, experts: StackedExperts, weights: torch.Tensor, expert_ids: torch.Tensor,
                         x_int8: tuple[torch.Tensor, torch.Tensor] | None = None,
                         config: GroupedConfig | None = None, few_pairs: int = FEW_PAIRS,
                         few_config: FewTokensConfig | None = None,
                         shared: tuple[StackedExperts, torch.Tensor] | None = None,
                         plan_tokens: int | None = None) -> torch.Tensor:
    """The Triton kernels behind fused_experts (any device; CPU tensors run in Triton's interpreter); the
    mat-vec kernels (with few_config) up to few_pairs routed pairs, the grouped GEMMs (with `config`) beyond.
    shared = (one expert of the routed ones' layout (shares_layout), weight [M, 1]): that expert as one more
    slot after the routed ones, summed with them and rounded once (fused_experts_reference's `shared`) - in
    the mat-vec kernels, or beside the grouped GEMMs. plan_tokens: as fused_experts'."""
    m, top_k = expert_ids.shape
    planned = m if plan_tokens is None else max(m, plan_tokens)
    arrived_int8 = x_int8 is not None and experts.quantized
    float_shared = shared is not None and not shared[0].quantized
    if planned * top_k <= few_pairs:
        slots = top_k + (shared is not None)
        # int8 experts quantize float tokens in the mat-vec kernel itself (the same values); a float shared expert
        # riding along needs them float
        tokens, token_scales = (x_int8[0], x_int8[1].reshape(-1)) if arrived_int8 and not float_shared else (x, None)
        return few_tokens_experts(tokens, token_scales, experts, expert_ids, weights, x.dtype,
                                  few_config or few_tokens_config(planned * slots, x.device),
                                  shared=None if shared is None else shared[0],
                                  shared_weight=None if shared is None else shared[1].reshape(m, 1))
    if arrived_int8:
        tokens, token_scales = x_int8[0], x_int8[1].reshape(-1)
    else:
        tokens, token_scales = as_expert_input(x, experts)
    cfg = config or grouped_config(planned * top_k, experts.num_experts, x.device)
    routing = group_by_expert(expert_ids, experts.num_experts, cfg.block)
    h = grouped_gemm(tokens, token_scales, experts.gate_up, experts.gate_up_scale, routing, top_k, x.dtype, cfg,
                     gated=True)
    h, h_scales = as_expert_input(h, experts)
    y = grouped_gemm(h, h_scales, experts.down, experts.down_scale, routing, 1, x.dtype, cfg,
                     route_weight=weights.reshape(-1)).view(m, top_k, -1)
    if shared is not None:
        y = torch.cat([y, (expert_mlp_reference(x, shared[0], 0) * shared[1])[:, None]], dim=1)
    return sum_slots(y)


def as_expert_input(x: torch.Tensor, experts: StackedExperts) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [M, K] as the experts' GEMMs take it: (int8 values, per-token scales [M]) for W8A8 experts, else (x, None)."""
    if not experts.quantized:
        return x, None
    values, scales = quantize_per_token_int8(x)
    return values, scales.reshape(-1)


def few_tokens_experts(tokens: torch.Tensor, token_scales: torch.Tensor | None, experts: StackedExperts,
                       expert_ids: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype,
                       config: FewTokensConfig, add_to: torch.Tensor | None = None,
                       shared: StackedExperts | None = None, shared_weight: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """The mat-vec path: tokens [M, H] (float, or int8 with token_scales [M] for int8 experts), expert_ids and
    weights [M, top_k] -> [M, H] in out_dtype, each token's weighted expert outputs summed in slot order (onto
    add_to [M, H] when given); with `shared` (shares_layout) and shared_weight [M, 1], the shared expert as one
    more slot after the routed ones. Int8 experts quantize the float intermediate in the down kernel."""
    h = pair_gate_up(tokens, token_scales, experts, expert_ids, out_dtype, config, shared=shared)
    return token_down(h, None, experts, expert_ids, weights, out_dtype, config, add_to=add_to, shared=shared,
                      shared_weight=shared_weight)


def add_weighted_expert(x: torch.Tensor, expert: StackedExperts, weight: torch.Tensor, base: torch.Tensor,
                        plan_tokens: int | None = None) -> torch.Tensor:
    """base + weight * expert(x) for x, base [M, H] and weight [M, 1] (x's dtype), the product and the sum each
    rounded to x's dtype - a MoE layer's shared expert added to its routed output. expert: one expert
    (StackedExperts with E = 1). Few tokens on a GPU or NPU: the mat-vec kernels, two launches with the sum
    fused; otherwise PyTorch."""
    m = x.shape[0]
    planned = m if plan_tokens is None else max(m, plan_tokens)
    if not use_triton(x) or planned > FEW_PAIRS:
        return base + weight * expert_mlp_reference(x, expert, 0)
    ids = torch.zeros(m, 1, dtype=torch.int64, device=x.device)
    return few_tokens_experts(x, None, expert, ids, weight.reshape(m, 1), x.dtype,
                              few_tokens_config(planned, x.device), add_to=base.contiguous())


def routed_and_shared_experts(x: torch.Tensor, experts: StackedExperts, weights: torch.Tensor,
                              expert_ids: torch.Tensor, shared: StackedExperts, shared_weight: torch.Tensor,
                              x_int8: tuple[torch.Tensor, torch.Tensor] | None = None,
                              plan_tokens: int | None = None) -> torch.Tensor:
    """A MoE layer's experts: fused_experts(x, experts, weights, expert_ids, x_int8) + shared_weight [M, 1] *
    shared(x) -> [M, H]. On a GPU or NPU, with a shared expert of the routed ones' layout, the shared expert is
    one more slot (fused_experts_triton's `shared`: for few tokens no launches of its own), the same sum for
    every M - a decode step and a verify step round alike; otherwise the routed sum rounded, then
    add_weighted_expert. plan_tokens: as fused_experts'."""
    if use_triton(x) and shares_layout(experts, shared):
        return fused_experts_triton(x, experts, weights, expert_ids, x_int8, shared=(shared, shared_weight),
                                    plan_tokens=plan_tokens)
    routed = fused_experts(x, experts, weights, expert_ids, x_int8, plan_tokens)
    return add_weighted_expert(x, shared, shared_weight, routed, plan_tokens)
