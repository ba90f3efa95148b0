"""The gated delta rule through npu_recurrent_gated_delta_rule (decode) and npu_chunk_gated_delta_rule (prefill).
The operators keep a state as [Dv, Dk], npuport as [K, V]: the wrappers transpose it in and out. They take unit-norm
q and k (normalized here, as npuport's kernels do inside) and the gating already applied (g and beta, computed here
from the raw projections where the call brings A_log and dt_bias).

Where they do not serve npuport: the documentation lists bf16 states, npuport's are fp32 (so on an NPU every call
steps down to Triton: fp32 precision is not given up); the chunked operator takes up to 8 tokens per sequence and
head dims of 128 only; and a verify step keeps a VerifyLog of per-token updates, where the recurrent operator's
speculative form (num_accepted_tokens) keeps one state per token in slots of its own."""

from __future__ import annotations

import torch

from npuport.kernels.gated_delta_rule.l2norm import l2norm
from npuport.kernels.gdn_gating import fused_gdn_gating, state_dtype
from npuport.kernels.npu import operators as ops
from npuport.kernels.npu.operators import BF16, documented_dtype, first_refusal

MAX_TOKENS = 8  # L_i of both operators
RECURRENT_MAX_HEADS = 256  # Nk, Nv
RECURRENT_MAX_DIM = 256  # Dk, Dv
CHUNK_MAX_HEADS = 64
CHUNK_DIM = 128  # Dk = Dv = 128


def _common_refusal(q: torch.Tensor, v: torch.Tensor, max_heads: int) -> str | None:
    h, hv = q.shape[2], v.shape[2]
    return first_refusal(
        (q.shape[1] <= MAX_TOKENS, f"the GDN operators take up to {MAX_TOKENS} tokens per sequence, not {q.shape[1]}"),
        (h <= max_heads and hv <= max_heads and hv % h == 0,
         f"the GDN operator takes up to {max_heads} heads, value heads a multiple of key heads"),
        (documented_dtype(q.dtype, BF16) and v.dtype == q.dtype,
         f"the GDN operators take bf16 q / k / v, not {q.dtype}"),
        (documented_dtype(state_dtype(v.dtype), BF16), "the GDN operators keep bf16 states; npuport's are fp32"),
    )


def gdn_recurrent_refusal(q: torch.Tensor, v: torch.Tensor, logged: bool) -> str | None:
    """The documented constraint of npu_recurrent_gated_delta_rule that a recurrent step breaks, or None. logged: the
    step records a VerifyLog (a verify step)."""
    if logged:
        return ("a verify step records a VerifyLog of per-token updates; npu_recurrent_gated_delta_rule keeps a state "
                "per token instead (num_accepted_tokens, ssm_state_indices)")
    if max(q.shape[3], v.shape[3]) > RECURRENT_MAX_DIM:
        return f"npu_recurrent_gated_delta_rule takes head dims up to {RECURRENT_MAX_DIM}"
    return _common_refusal(q, v, RECURRENT_MAX_HEADS)


def gdn_chunk_refusal(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """The documented constraint of npu_chunk_gated_delta_rule that a chunked prefill breaks, or None."""
    if q.shape[3] != CHUNK_DIM or v.shape[3] != CHUNK_DIM:
        return f"npu_chunk_gated_delta_rule takes head dims of {CHUNK_DIM} only"
    return _common_refusal(q, v, CHUNK_MAX_HEADS)


def _packed(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> [B * T, ...] (the operators' packed sequences)."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _unit(x: torch.Tensor, use_qk_l2norm: bool) -> torch.Tensor:
    """x scaled to unit rows in fp32 (npuport's l2norm; float64 for float64), back in x's dtype - the operators
    normalize nothing."""
    return l2norm(x.to(state_dtype(x.dtype))).to(x.dtype) if use_qk_l2norm else x


def gdn_recurrent_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, use_qk_l2norm: bool = True, A_log: torch.Tensor | None = None,
                         dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """fused_recurrent_gated_delta_rule's decode call (no log): q, k [B, T, H, K], v [B, T, HV, V], g, beta [B, T, HV]
    (raw a / b with A_log, dt_bias [HV]), state [B, HV, K, V] updated in place -> o [B, T, HV, V] in v's dtype.
    Every token of request b reads and writes slot b of the operator's states: the last leaves b's state there."""
    if A_log is not None:
        g, beta = fused_gdn_gating(A_log, g, dt_bias, beta)
    b, t, _, kd = q.shape
    slots = state.transpose(-1, -2).contiguous()  # [B, HV, V, K]
    lengths = torch.full((b,), t, dtype=torch.int32, device=q.device)
    indices = torch.arange(b, dtype=torch.int32, device=q.device).repeat_interleave(t)
    out = ops.npu_operators().npu_recurrent_gated_delta_rule(
        _packed(_unit(q, use_qk_l2norm)), _packed(_unit(k, use_qk_l2norm)), _packed(v.contiguous()), slots,
        beta=_packed(beta).to(v.dtype), scale=kd**-0.5, actual_seq_lengths=lengths, ssm_state_indices=indices,
        g=_packed(g).to(state_dtype(v.dtype)))
    state.copy_(slots.transpose(-1, -2))
    return out.view(v.shape)


def gdn_chunk_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk_gated_delta_rule's call (g, beta [B, T, HV] gated already; padding tokens with g = beta = 0) -> (o
    [B, T, HV, V] in v's dtype, final state [B, HV, K, V] fp32). Each request is one sequence of all T tokens."""
    b, t, _, kd = q.shape
    wide = state_dtype(v.dtype)
    start = (torch.zeros(b, v.shape[2], kd, v.shape[3], dtype=wide, device=v.device) if initial_state is None
             else initial_state)
    slots = start.transpose(-1, -2).to(wide).clone(memory_format=torch.contiguous_format)  # [B, HV, V, K], updated
    lengths = torch.full((b,), t, dtype=torch.int32, device=q.device)
    out, final = ops.npu_operators().npu_chunk_gated_delta_rule(
        _packed(_unit(q, use_qk_l2norm)), _packed(_unit(k, use_qk_l2norm)), _packed(v.contiguous()),
        beta=_packed(beta).to(v.dtype), initial_state=slots, actual_seq_lengths=lengths, scale=kd**-0.5,
        g=_packed(g).to(state_dtype(v.dtype)))
    return out.view(v.shape), final.transpose(-1, -2).to(wide).contiguous()
