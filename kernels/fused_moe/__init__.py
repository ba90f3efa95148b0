"""Fused MoE experts: routing on the device (routing.py), mat-vec kernels for few tokens (few_tokens.py), the
grouped expert GEMM for many (grouped_gemm.py), the whole routed-expert MLP (fused_experts.py) and the
per-expert PyTorch loop they are tested against (naive.py). Imports kernels.launch, kernels.w8a8, npuport.devices."""

from npuport.kernels.fused_moe.experts import StackedExperts
from npuport.kernels.fused_moe.few_tokens import FEW_TOKENS, FewTokensConfig, pair_gate_up, token_down
from npuport.kernels.fused_moe.fused_experts import (
    FEW_PAIRS,
    add_weighted_expert,
    fused_experts,
    fused_experts_triton,
    routed_and_shared_experts,
)
from npuport.kernels.fused_moe.grouped_gemm import GroupedConfig, grouped_config, grouped_gemm
from npuport.kernels.fused_moe.naive import expert_mlp_reference, fused_experts_reference, sum_slots
from npuport.kernels.fused_moe.routing import (
    BlockRouting,
    group_by_expert,
    max_blocks,
    route_top_k,
    route_top_k_reference,
    route_top_k_triton,
)

__all__ = [
    "FEW_PAIRS", "FEW_TOKENS", "BlockRouting", "FewTokensConfig", "GroupedConfig", "StackedExperts",
    "add_weighted_expert", "expert_mlp_reference", "fused_experts",
    "fused_experts_reference", "fused_experts_triton", "group_by_expert", "grouped_config", "grouped_gemm",
    "max_blocks", "pair_gate_up", "route_top_k",
    "routed_and_shared_experts", "route_top_k_reference", "route_top_k_triton", "sum_slots",
    "token_down",
]
