"""The MoE experts executed as planned (plan.py), without a host synchronisation: for few routed pairs (decode,
verify) two matvec launches (matvec.py: gate/up with silu(gate) * up fused, down with the routing weight and the
top-k sum fused); for many (prefill) the rows grouped by expert, two grouped GEMMs (grouped_gemm.py) and the top-k
sum; on an NPU torch-npu's MoE operators (kernels/npu/moe.py); elsewhere the per-expert PyTorch loop (naive.py).
W8A8 experts add the per-token quantization of the tokens and of the intermediate. W4A8 experts kept packed
(StackedExperts.int4) are read as int4 by both paths' kernels. fused_experts is the one entry the model calls."""

from __future__ import annotations

import torch

from npuport.kernels.fused_moe.experts import StackedExperts
from npuport.kernels.fused_moe.grouped_gemm import grouped_gemm
from npuport.kernels.fused_moe.matvec import matvec_experts
from npuport.kernels.fused_moe.naive import expert_mlp_reference, fused_experts_reference, sum_slots
from npuport.kernels.fused_moe.plan import GROUPED, MATVEC, SLOT, ExpertPlan, plan_experts
from npuport.kernels.fused_moe.routing import group_by_expert
from npuport.kernels.implementations import NATIVE
from npuport.kernels.npu.moe import moe_experts_native
from npuport.kernels.w8a8 import quantize_per_token_int8

Int8Tokens = tuple[torch.Tensor, torch.Tensor]  # (values int8 [M, H], scales fp32 [M, 1]): tokens quantized per token
SharedExpert = tuple[StackedExperts, torch.Tensor]  # (one expert, E = 1; its weight [M, 1] in x's dtype)


def fused_experts(x: torch.Tensor, experts: StackedExperts, weights: torch.Tensor, expert_ids: torch.Tensor, *,
                  shared: SharedExpert | None = None, x_int8: Int8Tokens | None = None,
                  plan_tokens: int | None = None) -> torch.Tensor:
    """A MoE layer's experts -> [M, H] in x's dtype: for each token the sum over its slots of weight * expert(x),
    plus shared_weight * shared(x) with a shared expert (fused_experts_reference's sum; how it is rounded:
    plan_experts).

    x [M, H] float; experts: StackedExperts (BF16 / float, W8A8 int8 with per-channel scales, or W4A8 int4 packed
    in int8 bytes); weights [M, top_k] in x's dtype (renormalised); expert_ids [M, top_k] int64; shared = (expert,
    weight [M, 1]); x_int8 = (values int8 [M, H], scales fp32 [M, 1]): x already quantized per token (int8
    dispatch), for W8A8 / W4A8 experts - the values they would compute from x; plan_tokens: plan as for that many
    tokens (plan_experts)."""
    plan = plan_experts(x, experts, expert_ids, shared=None if shared is None else shared[0],
                        tokens_int8=x_int8 is not None, plan_tokens=plan_tokens)
    return run_experts(plan, x, experts, weights, expert_ids, shared=shared, x_int8=x_int8)


def run_experts(plan: ExpertPlan, x: torch.Tensor, experts: StackedExperts, weights: torch.Tensor,
                expert_ids: torch.Tensor, *, shared: SharedExpert | None = None, x_int8: Int8Tokens | None = None
                ) -> torch.Tensor:
    """fused_experts as `plan` says (a plan made for these arguments: plan_experts, plan_experts_triton)."""
    if (shared is None) != (plan.shared is None):
        raise ValueError(f"the plan is for {'no' if plan.shared is None else 'a'} shared expert, the call has "
                         f"{'none' if shared is None else 'one'}")
    if plan.int8_tokens and x_int8 is None:
        raise ValueError("the plan reads the tokens as they arrived quantized, the call has no x_int8")
    rider = shared if plan.shared == SLOT else None
    if plan.path == MATVEC:
        out = _matvec_path(plan, x, experts, weights, expert_ids, rider, x_int8)
    elif plan.path == GROUPED:
        out = _grouped_path(plan, x, experts, weights, expert_ids, rider, x_int8)
    elif plan.path == NATIVE:  # torch-npu's MoE operators (kernels/npu/moe.py), the shared expert summed in
        out = moe_experts_native(x, experts, weights, expert_ids, shared=rider,
                                 x_int8=x_int8 if plan.int8_tokens else None)
    else:
        out = fused_experts_reference(x, experts, weights, expert_ids, x_int8=x_int8 if plan.int8_tokens else None)
    if plan.shared is None or plan.shared == SLOT:
        return out
    expert, weight = shared
    if plan.shared == MATVEC:  # the product and the sum each rounded to x's dtype, as PyTorch's
        m = x.shape[0]
        ids = torch.zeros(m, 1, dtype=torch.int64, device=x.device)
        return matvec_experts(x, None, expert, ids, weight.reshape(m, 1), x.dtype, plan.shared_matvec,
                              add_to=out.contiguous())
    return out + weight * expert_mlp_reference(x, expert, 0)


def _matvec_path(plan: ExpertPlan, x: torch.Tensor, experts: StackedExperts, weights: torch.Tensor,
                 expert_ids: torch.Tensor, rider: SharedExpert | None, x_int8: Int8Tokens | None) -> torch.Tensor:
    # float tokens into int8 experts are quantized in the kernels themselves
    tokens, token_scales = (x_int8[0], x_int8[1].reshape(-1)) if plan.int8_tokens else (x, None)
    return matvec_experts(tokens, token_scales, experts, expert_ids, weights, x.dtype, plan.matvec,
                          shared=None if rider is None else rider[0],
                          shared_weight=None if rider is None else rider[1].reshape(x.shape[0], 1))


def _grouped_path(plan: ExpertPlan, x: torch.Tensor, experts: StackedExperts, weights: torch.Tensor,
                  expert_ids: torch.Tensor, rider: SharedExpert | None, x_int8: Int8Tokens | None) -> torch.Tensor:
    """Gate/up and down as two grouped GEMMs over the rows grouped by expert, then the top-k sum (the shared
    expert's product, by PyTorch, one more slot of it)."""
    m, top_k = expert_ids.shape
    if plan.int8_tokens:
        tokens, token_scales = x_int8[0], x_int8[1].reshape(-1)
    else:
        tokens, token_scales = as_expert_input(x, experts)
    routing = group_by_expert(expert_ids, experts.num_experts, plan.grouped.block)
    h = grouped_gemm(tokens, token_scales, experts.gate_up, experts.gate_up_scale, routing, top_k, x.dtype,
                     plan.grouped, gated=True, int4=experts.int4)
    h, h_scales = as_expert_input(h, experts)
    y = grouped_gemm(h, h_scales, experts.down, experts.down_scale, routing, 1, x.dtype, plan.grouped,
                     route_weight=weights.reshape(-1), int4=experts.int4).view(m, top_k, -1)
    if rider is not None:
        y = torch.cat([y, (expert_mlp_reference(x, rider[0], 0) * rider[1])[:, None]], dim=1)
    return sum_slots(y)


def as_expert_input(x: torch.Tensor, experts: StackedExperts) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [M, K] as the experts' GEMMs take it: (int8 values, per-token scales [M]) for W8A8 experts, else (x, None)."""
    if not experts.quantized:
        return x, None
    values, scales = quantize_per_token_int8(x)
    return values, scales.reshape(-1)
