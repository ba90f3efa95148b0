"""Decode / verify attention over a static KV cache through npu_fused_infer_attention_score (BSND: npuport's cache
layout as it is), the causal mask as a boolean mask over the whole cache (no host synchronisation: a graph can
capture it), the output gate applied after it."""

from __future__ import annotations

import torch

from npuport.kernels.npu import operators as ops
from npuport.kernels.npu.operators import BF16_FP16, documented_dtype, first_refusal

# npu_fused_infer_attention_score's documented limits for BSND float inputs.
MAX_HEADS = 256
MAX_GROUP = 64  # query heads per kv head
MAX_HEAD_DIM = 512
HEAD_DIM_ALIGN = 16
MAX_BATCH = 65536
MAX_KEYS_ONE_QUERY = 262144  # KV_S when Q_S is 1
MAX_HEADS_X_DIM = 65535  # N * D, exclusive, when Q_S > 1


def decode_attention_refusal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> str | None:
    """The documented constraint of npu_fused_infer_attention_score that decode_attention breaks, or None."""
    b, t, hq, d = q.shape
    s, hkv = keys.shape[1], keys.shape[2]
    return first_refusal(
        (documented_dtype(q.dtype, BF16_FP16) and keys.dtype == values.dtype == q.dtype,
         f"npu_fused_infer_attention_score takes bf16 / fp16 query, key and value alike, not {q.dtype} / "
         f"{keys.dtype}"),
        (keys.is_contiguous() and values.is_contiguous(), "npu_fused_infer_attention_score takes no strided K / V"),
        (hq <= MAX_HEADS and hq % hkv == 0 and hq // hkv <= MAX_GROUP,
         f"npu_fused_infer_attention_score takes up to {MAX_HEADS} heads, at most {MAX_GROUP} per kv head"),
        (d % HEAD_DIM_ALIGN == 0 and d <= MAX_HEAD_DIM, f"npu_fused_infer_attention_score wants D a multiple of "
                                                        f"{HEAD_DIM_ALIGN} up to {MAX_HEAD_DIM}, not {d}"),
        (b <= MAX_BATCH, f"npu_fused_infer_attention_score takes B up to {MAX_BATCH}"),
        (t > 1 or s <= MAX_KEYS_ONE_QUERY, f"npu_fused_infer_attention_score takes up to {MAX_KEYS_ONE_QUERY} keys "
                                           f"for one query"),
        (t == 1 or hq * d < MAX_HEADS_X_DIM, "npu_fused_infer_attention_score wants N * D below 65535 in BSND"),
    )


def decode_attention_native(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor,
                            gate: torch.Tensor | None = None) -> torch.Tensor:
    """decode_attention's call (q [B, T, Hq, D] at positions start[b] + t, keys, values [B, S, Hkv, D], gate as q or
    None) -> contiguous [B, T, Hq, D] in q's dtype. The mask [B, 1, T, S] is true for the keys past each query's
    position - whatever they hold is left out of its softmax (the caches start zeroed: it is finite)."""
    b, t, hq, d = q.shape
    s, hkv = keys.shape[1], keys.shape[2]
    positions = start[:, None] + torch.arange(t, device=q.device)  # [B, T]
    hidden = torch.arange(s, device=q.device)[None, None, :] > positions[:, :, None]  # [B, T, S]
    out, _ = ops.npu_operators().npu_fused_infer_attention_score(
        q.contiguous(), keys, values, atten_mask=hidden[:, None], num_heads=hq, scale=d**-0.5, input_layout="BSND",
        num_key_value_heads=hkv)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return out.contiguous()
