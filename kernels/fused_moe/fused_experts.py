"""The routed experts of a MoE layer on a GPU or NPU, without a host synchronisation: for few routed pairs
(decode, verify) two mat-vec launches (few_tokens.py: gate/up with silu(gate) * up fused, down with the
routing weight and the top-k sum fused); for many (prefill) the rows grouped by expert and two grouped GEMMs
(grouped_gemm.py) and the top-k sum. W8A8 experts add the per-token quantization of the tokens and of the
intermediate."""

from __future__ import annotations

import torch

from npuport.kernels.fused_moe.experts import StackedExperts
from npuport.kernels.fused_moe.few_tokens import FewTokensConfig, few_tokens_config, pair_gate_up, token_down
from npuport.kernels.fused_moe.grouped_gemm import GroupedConfig, grouped_config, grouped_gemm
from npuport.kernels.fused_moe.naive import expert_mlp_reference, fused_experts_reference, sum_slots
from npuport.kernels.fused_moe.routing import group_by_expert
from npuport.kernels.launch import use_triton
from npuport.kernels.w8a8 import quantize_per_token_int8


def fused_experts(x: torch.Tensor, experts: StackedExperts, weights: torch.Tensor, expert_ids: torch.Tensor,
                  x_int8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [M, H]; weights [M, top_k] (x's dtype, renormalised); expert_ids [M, top_k] -> [M, H] in x's dtype:
    sum over slots of weight * expert(x). x_int8 = (values int8 [M, H], scales fp32 [M, 1]): x already
    quantized per token (int8 dispatch), for W8A8 experts; the same values they would compute from x."""
    if use_triton(x):
        return fused_experts_triton(x, experts, weights, expert_ids, x_int8)
    return fused_experts_reference(x, experts, weights, expert_ids)


# Up to this many routed pairs (token x slot) the mat-vec kernels run; beyond, the grouped GEMMs, whose
# weight tiles serve every row of an expert at once. At the 35B-A3B widths on an H200 the mat-vec kernels were
# 1.4-2x faster at 128 pairs (bench/RESULTS.md).
FEW_PAIRS = 128


def fused_experts_triton(x: torch.Tensor, experts: StackedExperts, weights: torch.Tensor, expert_ids: torch.Tensor,
                         x_int8: tuple[torch.Tensor, torch.Tensor] | None = None,
                         config: GroupedConfig | None = None, few_pairs: int = FEW_PAIRS,
                         few_config: FewTokensConfig | None = None) -> torch.Tensor:
    """The Triton kernels behind fused_experts (any device; CPU tensors run in Triton's interpreter); the
    mat-vec kernels (with few_config) up to few_pairs routed pairs, the grouped GEMMs (with `config`) beyond."""
    m, top_k = expert_ids.shape
    tokens, token_scales = x, None
    if experts.quantized:
        tokens, token_scales = x_int8 if x_int8 is not None else quantize_per_token_int8(x)
        token_scales = token_scales.reshape(-1)
    if m * top_k <= few_pairs:
        few_config = few_config or few_tokens_config(m * top_k)
        h = pair_gate_up(tokens, token_scales, experts.gate_up, experts.gate_up_scale, expert_ids, x.dtype,
                         few_config)
        h_scales = None
        if experts.quantized:
            h, h_scales = quantize_per_token_int8(h)
            h_scales = h_scales.reshape(-1)
        return token_down(h, h_scales, experts.down, experts.down_scale, expert_ids, weights, x.dtype, few_config)
    cfg = config or grouped_config(m * top_k, experts.num_experts, x.device)
    routing = group_by_expert(expert_ids, experts.num_experts, cfg.block)
    h = grouped_gemm(tokens, token_scales, experts.gate_up, experts.gate_up_scale, routing, top_k, x.dtype, cfg,
                     gated=True)
    h_scales = None
    if experts.quantized:
        h, h_scales = quantize_per_token_int8(h)
        h_scales = h_scales.reshape(-1)
    y = grouped_gemm(h, h_scales, experts.down, experts.down_scale, routing, 1, x.dtype, cfg,
                     route_weight=weights.reshape(-1))
    return sum_slots(y.view(m, top_k, -1))


def add_weighted_expert(x: torch.Tensor, expert: StackedExperts, weight: torch.Tensor, base: torch.Tensor
                        ) -> torch.Tensor:
    """base + weight * expert(x) for x, base [M, H] and weight [M, 1] (x's dtype), the product and the sum each
    rounded to x's dtype - a MoE layer's shared expert added to its routed output. expert: one expert
    (StackedExperts with E = 1). Few tokens on a GPU or NPU: the mat-vec kernels, two launches with the sum
    fused; otherwise PyTorch."""
    m = x.shape[0]
    if not use_triton(x) or m > FEW_PAIRS:
        return base + weight * expert_mlp_reference(x, expert, 0)
    ids = torch.zeros(m, 1, dtype=torch.int64, device=x.device)
    config = few_tokens_config(m)
    tokens, scales = (x, None)
    if expert.quantized:
        tokens, scales = quantize_per_token_int8(x)
        scales = scales.reshape(-1)
    h = pair_gate_up(tokens, scales, expert.gate_up, expert.gate_up_scale, ids, x.dtype, config)
    h_scales = None
    if expert.quantized:
        h, h_scales = quantize_per_token_int8(h)
        h_scales = h_scales.reshape(-1)
    return token_down(h, h_scales, expert.down, expert.down_scale, ids, weight.reshape(m, 1), x.dtype, config,
                      add_to=base.contiguous())
