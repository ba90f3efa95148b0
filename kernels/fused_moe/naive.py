"""The MoE experts in plain PyTorch, one expert at a time: the reference the grouped kernels are tested
against, and what the runtime runs where Triton does not (CPU, float64).

W4A8_DYNAMIC experts (msModelSlim's int4 weights q in [-8, 7], per-channel scale s_w, int8 tokens per token) come
here as int8 experts - unpacked at load, or kept packed (StackedExperts.int4, where the Triton kernels read them as
int4) and unpacked here, per call - so a projection is y[n] = s_x * s_w[n] *
sum_k x_q[k] * q[n, k], summed exactly in int32 - what the engines' W4A8 MoE methods amount to. vllm-ascend
(quantization/methods/w4a8.py, ops/fused_moe/moe_mlp.py) and sglang (hardware_backend/npu/quantization: its W4A8 MoE
methods) keep the weight as int4 (two values a byte, viewed as int32 for the operator), turn the float32 scale into
the int64 form the grouped matmul takes, sum scale_bias over the tensor parallel slices a rank holds, and call
torch-npu's grouped matmul with int8 tokens, the per-token scales and scale_bias as its bias. scale_bias = 8 *
s_w[n] * sum_k q[n, k] does not depend on the tokens. Our reading (torch-npu documents no formula for it): it is the
term an int8 x int4 kernel must add back when it computes with each int8 activation shifted by 8 - as when an int8
value is cut into two int4 halves, its low half moved from [0, 15] to [-8, 7] (x_q = 16 hi + (lo - 8) + 8) so that
both run on int4 x int4 units - and it is kept per K slice (16 for down_proj) because each rank of a row-parallel
projection adds its own slice's. With it, their result is the same s_x * s_w * sum_k x_q q, up to float32 rounding;
an exact int8 product has nothing to add back (the loader checks scale_bias against its definition and leaves it).
sglang's newer method passes scale_bias only with its activation-clip option. The Triton kernels read packed int4
experts as int4 (matvec.py, grouped_gemm.py); this reference unpacks them and runs the int8 arithmetic."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from npuport.kernels.fused_moe.experts import StackedExperts
from npuport.kernels.w8a8 import int8_matmul_rescale_reference, quantize_per_token_int8_reference


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where the top-k sum is taken: fp32, or float64 for float64 activations."""
    return torch.promote_types(dtype, torch.float32)


def expert_mlp_reference(x: torch.Tensor, experts: StackedExperts, e: int,
                         x_int8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Expert e on tokens x [R, H] -> [R, H] in x's dtype: down(silu(gate(x)) * up(x)), each product rounded
    to x's dtype as separate linear layers round it. W8A8 experts quantize x per token - or take x_int8 =
    (values int8 [R, H], scales fp32 [R, 1]), tokens that arrived quantized, of which x gives only the dtype -
    and the intermediate again before the down projection. int4 experts: unpacked (StackedExperts.unpacked), then
    as int8 ones."""
    experts = experts.unpacked()
    i = experts.intermediate
    if not experts.quantized:
        gate, up = F.linear(x, experts.gate_up[e, :i]), F.linear(x, experts.gate_up[e, i:])
        return F.linear(F.silu(gate) * up, experts.down[e])
    x_q, x_s = quantize_per_token_int8_reference(x) if x_int8 is None else x_int8
    w, s = experts.gate_up[e], experts.gate_up_scale[e, :, None]
    gate = int8_matmul_rescale_reference(x_q, x_s, w[:i], s[:i], x.dtype)
    up = int8_matmul_rescale_reference(x_q, x_s, w[i:], s[i:], x.dtype)
    h_q, h_s = quantize_per_token_int8_reference(F.silu(gate) * up)
    return int8_matmul_rescale_reference(h_q, h_s, experts.down[e], experts.down_scale[e, :, None], x.dtype)


def fused_experts_reference(x: torch.Tensor, experts: StackedExperts, weights: torch.Tensor,
                            expert_ids: torch.Tensor, shared: tuple[StackedExperts, torch.Tensor] | None = None,
                            x_int8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [M, H]; weights [M, top_k] (x's dtype); expert_ids [M, top_k] -> [M, H] in x's dtype: for each token the
    sum over its slots of weight * expert output (each product rounded to x's dtype), see sum_slots. shared =
    (one expert, weight [M, 1]): that expert as one more slot after the routed ones. x_int8: the tokens as they
    arrived quantized, for W8A8 experts (expert_mlp_reference). int4 experts are unpacked once for the call."""
    experts = experts.unpacked()
    m, top_k = expert_ids.shape
    per_slot = torch.zeros(m, top_k + (shared is not None), x.shape[1], dtype=x.dtype, device=x.device)
    for e in expert_ids.unique().tolist():
        rows, slots = (expert_ids == e).nonzero(as_tuple=True)
        tokens = None if x_int8 is None or not experts.quantized else (x_int8[0][rows], x_int8[1][rows])
        per_slot[rows, slots] = expert_mlp_reference(x[rows], experts, e, tokens) * weights[rows, slots, None]
    if shared is not None:
        per_slot[:, top_k] = expert_mlp_reference(x, shared[0], 0) * shared[1]
    return sum_slots(per_slot)


def sum_slots(per_slot: torch.Tensor) -> torch.Tensor:
    """per_slot [M, top_k, H] -> [M, H]: the slots added one after the other in slot order, in wide_dtype, and
    rounded once - the order the kernels add them in, whatever M."""
    total = torch.zeros(per_slot.shape[0], per_slot.shape[2], dtype=wide_dtype(per_slot.dtype),
                        device=per_slot.device)
    for s in range(per_slot.shape[1]):
        total += per_slot[:, s]
    return total.to(per_slot.dtype)
