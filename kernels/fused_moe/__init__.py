"""Fused MoE experts: routing on the device (routing.py); the plan of a call - implementation, path, tiles, the
shared expert's way in (plan.py); its execution (run.py: fused_experts, the one entry the model calls) by the
matvec kernels for few routed pairs (matvec.py) or the grouped expert GEMM for many (grouped_gemm.py); and the
per-expert PyTorch loop they are tested against (naive.py). Imports kernels.launch, kernels.implementations,
kernels.w8a8, npuport.devices."""

from npuport.kernels.fused_moe.experts import StackedExperts, shares_layout
from npuport.kernels.fused_moe.grouped_gemm import GroupedConfig, grouped_config, grouped_gemm
from npuport.kernels.fused_moe.matvec import MatvecConfig, matvec_config, matvec_down, matvec_experts, matvec_gate_up
from npuport.kernels.fused_moe.naive import expert_mlp_reference, fused_experts_reference, sum_slots
from npuport.kernels.fused_moe.plan import (
    GROUPED,
    MATVEC,
    MATVEC_MAX_PAIRS,
    SLOT,
    ExpertPlan,
    plan_experts,
    plan_experts_triton,
)
from npuport.kernels.fused_moe.routing import (
    BlockRouting,
    group_by_expert,
    max_blocks,
    route_top_k,
    route_top_k_reference,
    route_top_k_triton,
)
from npuport.kernels.fused_moe.run import fused_experts, run_experts

__all__ = [
    "GROUPED", "MATVEC", "MATVEC_MAX_PAIRS", "SLOT", "BlockRouting", "ExpertPlan", "GroupedConfig", "MatvecConfig",
    "StackedExperts", "expert_mlp_reference", "fused_experts", "fused_experts_reference", "group_by_expert",
    "grouped_config", "grouped_gemm", "matvec_config", "matvec_down", "matvec_experts", "matvec_gate_up",
    "max_blocks", "plan_experts", "plan_experts_triton", "route_top_k", "route_top_k_reference",
    "route_top_k_triton", "run_experts", "shares_layout", "sum_slots",
]
