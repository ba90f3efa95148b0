"""PyTorch implementations of what torch-npu 2.14.0's documentation (_op_plugin_docs.py in its wheel) says
each npu_* operator that npuport calls computes - not NPU output. Each has exactly the documented Python signature
(tests/test_npu_prototypes.py holds them to it). Only the argument combinations npuport calls with are implemented;
any other raises UnusedCombination. Where the documentation leaves something open (an order of rounding, how a
layout is indexed), the docstring says which reading is taken: the self-test on a real NPU is what checks those.

Float inputs of any precision are taken (float32 and float64 included, where the documentation lists only bf16 /
fp16), so that float32 and float64 models check the wiring at their own precision: the arithmetic is fp32 - float64
for float64 inputs, as npuport's references - and rounds once to the output dtype.
"""

from __future__ import annotations

import torch

from npuport.devices import is_cpu
from npuport.errors import NpuportError

INT8_MAX = 127  # DTYPE_MAX of npu_dynamic_quant's int8 output


class UnusedCombination(NpuportError):
    """A stand-in was called with arguments npuport never passes: only those it calls with are implemented."""


def _wide(dtype: torch.dtype) -> torch.dtype:
    """Where a stand-in computes: fp32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _require(condition: bool, operator: str, what: str) -> None:
    if not condition:
        raise UnusedCombination(f"the {operator} stand-in implements only {what}")


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """npu_dynamic_quant's formula without smooth scales: scale = rowMax(|x|) / 127, y = round(x / scale) (half to
    even), int8; a row of zeros (scale 0, which the formula leaves as 0 / 0) quantizes to zeros."""
    xf = x.float()
    scale = xf.abs().amax(-1) / torch.full((), INT8_MAX, dtype=torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    y = torch.where(scale[..., None] > 0, (xf / safe).round(), torch.zeros_like(xf))
    return y.clamp(-INT8_MAX - 1, INT8_MAX).to(torch.int8), scale


def _int8_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The exact int32 product a [M, K] @ b [K, N] of int8 matrices (float64 holds it exactly off the CPU)."""
    if is_cpu(a.device):
        return a.to(torch.int32) @ b.to(torch.int32)
    return (a.double() @ b.double()).to(torch.int32)


def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None):
    """What torch-npu 2.14.0's documentation says npu_dynamic_quant computes: per-token symmetric quantization,
    scale = rowMax(abs(x)) / DTYPE_MAX, y = round(x / scale). x [..., K] -> (y int8 [..., K], scale fp32 [...]).
    Implemented: no smooth_scales / group_index, int8 output."""
    _require(smooth_scales is None and group_index is None and dst_type in (None, torch.int8), "npu_dynamic_quant",
             "int8 output without smooth scales")
    return _quantize_rows(x)


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None):
    """What torch-npu 2.14.0's documentation says npu_quant_matmul computes, in its per-token case (x1, x2 int8,
    float32 scale, float32 pertoken_scale, bf16 / fp16 output): the int8 product x1 [M, K] @ x2 [K, N] summed in
    int32, times the per-token scale of its row and the per-channel scale of its column, rounded to output_dtype. The
    documentation states no order for the two scales: the row's first is the reading taken."""
    _require(offset is None and bias is None and pertoken_scale is not None and x1.dim() == x2.dim() == 2
             and x1.dtype == x2.dtype == torch.int8 and output_dtype is not None and output_dtype.is_floating_point,
             "npu_quant_matmul", "2-D int8 operands with pertoken_scale, no offset or bias, a float output_dtype")
    wide = _wide(output_dtype)
    acc = _int8_product(x1, x2).to(wide)
    return (acc * pertoken_scale.to(wide)[:, None] * scale.to(wide)[None, :]).to(output_dtype)


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                       per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                       output_dtype=None, tuning_config):
    """What torch-npu 2.14.0's documentation says npu_grouped_matmul computes, in its "single x, single weight, single
    y" form grouped along M (group_type 0, split_item 2 or 3, group_list a tensor): the rows of group e of x [M, K]
    times weight[e] [K, N] (any strides: a transposed weight is allowed), returned as [y [M, N]]. Not quantized
    (formula 1 without bias): y in x's dtype (or output_dtype). Per-token quantized (formula 3, x and weight int8):
    the exact int32 product times per_token_scale [M] and scale[e] [N]; the documentation's formula writes
    "+ pertokenscale", its data-type table and npu_quant_matmul multiply, which is the reading taken, the row's scale
    first. One scale tensor [E, N] for the single weight of E groups (the documentation describes per-tensor 1-D
    scales of weight lists). group_list_type 0: cumulative row counts; 1: rows per group."""
    _require(len(x) == len(weight) == 1 and weight[0].dim() == 3 and x[0].dim() == 2 and group_type == 0
             and split_item in (2, 3) and isinstance(group_list, torch.Tensor) and group_list_type in (0, 1)
             and act_type == 0 and bias is None and offset is None and antiquant_scale is None
             and antiquant_offset is None and activation_input is None and activation_quant_scale is None
             and activation_quant_offset is None, "npu_grouped_matmul",
             "one 2-D x and one 3-D weight grouped along M by a group_list tensor, without bias, offsets, activation")
    rows, weights = x[0], weight[0]
    counts = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
    ends = counts.cumsum(0).tolist()
    quantized = rows.dtype == torch.int8
    _require(not quantized or (scale is not None and per_token_scale is not None and output_dtype is not None),
             "npu_grouped_matmul", "int8 x with scale, per_token_scale and a float output_dtype")
    out_dtype = output_dtype or rows.dtype
    wide = _wide(out_dtype)
    y = torch.zeros(rows.shape[0], weights.shape[2], dtype=out_dtype, device=rows.device)
    begin = 0
    for e, end in enumerate(ends):
        if end > begin:
            if quantized:
                acc = _int8_product(rows[begin:end], weights[e]).to(wide)
                part = acc * per_token_scale[0][begin:end, None].to(wide) * scale[0][e][None, :].to(wide)
            else:
                part = rows[begin:end].to(wide) @ weights[e].to(wide)
            y[begin:end] = part.to(out_dtype)
        begin = end
    return [y]


def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    """What torch-npu 2.14.0's documentation says npu_moe_gating_top_k_softmax computes: softmax over the last dim of
    x [N, E], then its k largest values - y [N, k] in x's dtype (descending), expert_idx [N, k] int32 - and row_idx
    [N, k] int32, "the original row of each position", read as in the routing operators that take it: position (i, j)
    of the k-major expansion, j * N + i. Softmax in fp32. Implemented: no `finished`."""
    _require(finished is None and x.dim() == 2, "npu_moe_gating_top_k_softmax", "2-D x without `finished`")
    probs = torch.softmax(x.to(_wide(x.dtype)), dim=-1)
    values, experts = probs.topk(k, dim=-1)
    n = x.shape[0]
    row_idx = (torch.arange(k, device=x.device)[None, :] * n + torch.arange(n, device=x.device)[:, None])
    return values.to(x.dtype), experts.to(torch.int32), row_idx.to(torch.int32)


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=-1, active_expert_range=[],  # noqa: B006 - the documented default
                            row_idx_type=0):
    """What torch-npu 2.14.0's documentation says npu_moe_init_routing_v2 computes, dropless (drop_pad_mode 0), every
    expert active: x [N, H] expanded to one row per (token, slot) of expert_idx [N, K], grouped by expert in
    ascending order - expanded_x [N * K, H] - with expanded_row_idx [N * K] int32, per row_idx_type 0 ("gather": one
    entry per source, -1 for one outside the active range) the row of expanded_x that source (t, k) went to, source
    (t, k) read as t * K + k of expert_idx; the tokens per expert [E] int64 (expert_tokens_num_type 1, count); and
    expanded_scale [N * K] fp32: quant_mode -1, `scale` [N] taken along with its rows; quant_mode 1 (dynamic
    quantization, expanded_x int8), each row's scale as npu_dynamic_quant's. Rows of one expert keep source order."""
    n, k = expert_idx.shape
    experts = expert_num
    _require(offset is None and drop_pad_mode == 0 and expert_tokens_num_type == 1 and expert_tokens_num_flag
             and quant_mode in (-1, 1) and row_idx_type == 0 and active_num in (-1, 0, n * k) and experts > 0
             and list(active_expert_range) in ([], [0, experts]) and (quant_mode == -1 or scale is None),
             "npu_moe_init_routing_v2", "dropless routing over every expert with counts, gather row indices and no "
             "smooth scales")
    flat = expert_idx.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices  # expanded row r holds source order[r]
    expanded = x[order // k]
    expanded_row_idx = torch.empty_like(order)
    expanded_row_idx[order] = torch.arange(n * k, device=x.device)
    counts = torch.bincount(flat, minlength=experts)[:experts].to(torch.int64)
    if quant_mode == 1:
        expanded, expanded_scale = _quantize_rows(expanded)
    elif scale is not None:
        expanded_scale = scale.float().reshape(-1)[order // k]
    else:
        expanded_scale = torch.zeros(n * k, dtype=torch.float32, device=x.device)  # documented as undefined
    return expanded, expanded_row_idx.to(torch.int32), counts, expanded_scale


def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode=0, k=1):
    """What torch-npu 2.14.0's documentation says npu_moe_finalize_routing computes: out[i] = skip1[i] + skip2[i] +
    sum over k of scales[i, k] * expanded_permuted_rows[expanded_src_to_dst_row[i + k * N]] (+ bias of the expert,
    not used here), out [N, H] in the rows' dtype. Its order of rounding is unstated: fp32 throughout, the terms
    added in the formula's order, rounded once. Implemented: no bias, drop_pad_mode 0, scales given."""
    _require(bias is None and drop_pad_mode == 0 and scales is not None and not (skip1 is not None and skip2 is None),
             "npu_moe_finalize_routing", "scales without bias (skip2 given whenever skip1 is)")
    n, top_k = scales.shape
    wide = _wide(expanded_permuted_rows.dtype)
    rows = expanded_permuted_rows.to(wide)
    total = torch.zeros(n, rows.shape[1], dtype=wide, device=rows.device)
    for skip in (skip1, skip2):
        if skip is not None:
            total = total + skip.to(wide)
    for slot in range(top_k):
        picked = rows[expanded_src_to_dst_row[slot * n : (slot + 1) * n].long()]
        total = total + scales[:, slot, None].to(wide) * picked
    return total.to(expanded_permuted_rows.dtype)


def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None,
                                    dequant_scale2=None, quant_scale2=None, quant_offset2=None, antiquant_scale=None,
                                    antiquant_offset=None, block_table=None, query_padding_size=None,
                                    kv_padding_size=None, key_antiquant_scale=None, key_antiquant_offset=None,
                                    value_antiquant_scale=None, value_antiquant_offset=None, key_shared_prefix=None,
                                    value_shared_prefix=None, actual_shared_prefix_len=None, query_rope=None,
                                    key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0,
                                    pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH",
                                    num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
                                    antiquant_mode=0, softmax_lse_flag=False, key_antiquant_mode=0,
                                    value_antiquant_mode=0):
    """What torch-npu 2.14.0's documentation says npu_fused_infer_attention_score computes: attention_out =
    softmax(scale * query key^T, with atten_mask) value, for layout BSND - query [B, S1, N, D], key, value
    [B, S2, KV_N, D], query head h reading kv head h // (N / KV_N) - and atten_mask bool [B, 1, S1, S2] (or None;
    sparse_mode 0), true where a query does not attend to a key, as the operator's causal masks mark the pairs
    left out. Softmax in fp32, the output rounded once to query's dtype; softmax_lse (not asked for) a [1] zero.
    Implemented: no quantization, prefix, paging, rope inputs or position shift."""
    unused = (pse_shift, actual_seq_lengths, actual_seq_lengths_kv, dequant_scale1, quant_scale1, dequant_scale2,
              quant_scale2, quant_offset2, antiquant_scale, antiquant_offset, block_table, query_padding_size,
              kv_padding_size, key_antiquant_scale, key_antiquant_offset, value_antiquant_scale,
              value_antiquant_offset, key_shared_prefix, value_shared_prefix, actual_shared_prefix_len, query_rope,
              key_rope, key_rope_antiquant_scale)
    _require(all(t is None for t in unused) and input_layout == "BSND" and sparse_mode == 0
             and not softmax_lse_flag and query.dim() == 4, "npu_fused_infer_attention_score",
             "BSND attention with an optional boolean mask (sparse_mode 0)")
    kv_heads = num_key_value_heads or num_heads
    _require(query.shape[2] == num_heads and key.shape[2] == kv_heads and num_heads % kv_heads == 0,
             "npu_fused_infer_attention_score", "num_heads / num_key_value_heads matching the shapes")
    group = num_heads // kv_heads
    wide = _wide(query.dtype)
    k = key.to(wide).repeat_interleave(group, dim=2)
    v = value.to(wide).repeat_interleave(group, dim=2)
    scores = torch.einsum("bshd,bthd->bhst", query.to(wide), k) * scale  # [B, N, S1, S2]
    if atten_mask is not None:
        scores = scores.masked_fill(atten_mask.bool(), float("-inf"))
    out = torch.einsum("bhst,bthd->bshd", torch.softmax(scores, dim=-1), v)
    return out.to(query.dtype), torch.zeros(1, dtype=torch.float32, device=query.device)


def npu_gemma_rms_norm(input, gamma, epsilon=1e-06):
    """What torch-npu 2.14.0's documentation says npu_gemma_rms_norm computes: RMSNorm over the trailing gamma.dim()
    dims with Gemma's scale 1 + gamma: y = x * rsqrt(mean(x^2) + epsilon) * (1 + gamma) in fp32, rounded once to
    input's dtype; rstd = rsqrt(mean(x^2) + epsilon) over the leading dims, in input's dtype."""
    dims = tuple(range(input.dim() - gamma.dim(), input.dim()))
    xf = input.to(_wide(input.dtype))
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon)
    y = xf * rstd * (1.0 + gamma.to(xf.dtype))
    return y.to(input.dtype), rstd.reshape(input.shape[: input.dim() - gamma.dim()]).to(input.dtype)


def npu_rotary_mul(input, r1, r2, rotary_mode='half', rotate=None):
    """What torch-npu 2.14.0's documentation says npu_rotary_mul computes in half mode without `rotate`, in its own
    PyTorch: x1, x2 = chunk(input, 2, -1); output = r1 * input + r2 * cat(-x2, x1) - input [B, S, N, D] (BSND), r1,
    r2 broadcast to it ([B, S, 1, D])."""
    _require(rotary_mode == "half" and rotate is None and input.dim() == 4, "npu_rotary_mul",
             "half mode without `rotate` on a 4-D input")
    x1, x2 = torch.chunk(input, 2, -1)
    return r1 * input + r2 * torch.cat((-x2, x1), dim=-1)


def npu_fused_causal_conv1d(x, weight, conv_states, *, query_start_loc=None, cache_indices=None,
                            initial_state_mode=None, bias=None, num_accepted_tokens=None, activation="None",
                            pad_slot_id=-1, run_mode=0, residual_connection=0, max_query_len=-1,
                            num_computed_tokens=None, block_idx_first_scheduled_token=None,
                            block_idx_last_scheduled_token=None, initial_state_idx=None, block_size=128,
                            conv_mode="default"):
    """What torch-npu 2.14.0's documentation says npu_fused_causal_conv1d computes for a batch x [B, T, D]: each
    sequence padded at its head with its cached inputs - the newest K - 1 rows of conv_states [B, state_len, D] -
    convolved with weight [K, D] (depthwise, row i of the weight on the i-th oldest input of a window, as a
    cross-correlation), y [B, T, D] in x's dtype (plus x with residual_connection 1), and the tail of each padded
    sequence written back into conv_states in place (its newest state_len rows). No activation (the documentation:
    not supported yet). Implemented: no varlen / cache indexing, speculative or prefix-caching inputs."""
    unused = (query_start_loc, cache_indices, initial_state_mode, bias, num_accepted_tokens, num_computed_tokens,
              block_idx_first_scheduled_token, block_idx_last_scheduled_token, initial_state_idx)
    _require(all(t is None for t in unused) and x.dim() == 3 and activation == "None" and conv_mode == "default"
             and residual_connection in (0, 1), "npu_fused_causal_conv1d",
             "a 3-D batch with one conv state per sequence, no activation")
    width, t = weight.shape[0], x.shape[1]
    wide = _wide(x.dtype)
    joined = torch.cat([conv_states[:, conv_states.shape[1] - (width - 1):].to(wide), x.to(wide)], dim=1)
    y = sum(weight[i].to(wide) * joined[:, i : i + t] for i in range(width))
    if residual_connection:
        y = y + x.to(wide)
    state_len = conv_states.shape[1]
    conv_states.copy_(torch.cat([conv_states, x.to(conv_states.dtype)], dim=1)[:, -state_len:])
    return y.to(x.dtype)


def _delta_rule(query, key, value, beta, g, state, scale, tokens: range):
    """The gated delta rule over `tokens` of a packed sequence from state S [Nv, Dv, Dk] (computed in its dtype):
    per token, S = exp(g) S; S = S + beta (v - S k) k^T; o = S (scale q) - value head j reading key head
    j // (Nv / Nk). Returns o [len(tokens), Nv, Dv] and the state after each token."""
    group, wide = value.shape[1] // key.shape[1], state.dtype
    outs, states = [value.new_zeros(0, *value.shape[1:], dtype=wide)], []
    for i in tokens:
        q_i = query[i].to(wide).repeat_interleave(group, dim=0)  # [Nv, Dk]
        k_i = key[i].to(wide).repeat_interleave(group, dim=0)
        if g is not None:
            state = state * g[i].to(wide).exp()[:, None, None]
        predicted = torch.einsum("hvk,hk->hv", state, k_i)
        state = state + (beta[i].to(wide)[:, None] * (value[i].to(wide) - predicted))[:, :, None] * k_i[:, None, :]
        outs.append(torch.einsum("hvk,hk->hv", state, q_i * scale)[None])
        states.append(state)
    return torch.cat(outs), states


def npu_recurrent_gated_delta_rule(query, key, value, state, *, beta=None, scale=None, actual_seq_lengths=None,
                                   ssm_state_indices=None, num_accepted_tokens=None, g=None, gk=None):
    """What torch-npu 2.14.0's documentation says npu_recurrent_gated_delta_rule computes over packed sequences -
    query, key [T, Nk, Dk], value [T, Nv, Dv], beta, g [T, Nv], sequence n the next actual_seq_lengths[n] tokens:
    the gated delta rule (alpha = exp(g)) with the state kept as [Dv, Dk], state[ssm_state_indices[i]] being token
    i's state. Sequence n starts from the state of its token num_accepted_tokens[n] - 1 (default 1: its first
    token's slot) and leaves each token's state in that token's slot, in place. Returns o [T, Nv, Dv] in value's
    dtype (the documentation: bf16), computed in fp32 (float64 for float64)."""
    _require(gk is None and None not in (beta, scale, actual_seq_lengths, ssm_state_indices),
             "npu_recurrent_gated_delta_rule", "beta, scale, actual_seq_lengths and ssm_state_indices given, no gk")
    wide = _wide(value.dtype)
    out = torch.empty(value.shape, dtype=wide, device=value.device)
    slots = ssm_state_indices.long().tolist()
    begin = 0
    for n, length in enumerate(actual_seq_lengths.tolist()):
        accepted = 1 if num_accepted_tokens is None else int(num_accepted_tokens[n])
        start_state = state[slots[begin + accepted - 1]].to(wide)
        tokens = range(begin, begin + length)
        out[begin : begin + length], states = _delta_rule(query, key, value, beta, g, start_state, scale, tokens)
        for i, s in zip(tokens, states, strict=True):
            state[slots[i]] = s.to(state.dtype)
        begin += length
    return out.to(value.dtype)


def npu_chunk_gated_delta_rule(query, key, value, *, beta=None, initial_state=None, actual_seq_lengths=None,
                               scale=None, g=None):
    """What torch-npu 2.14.0's documentation says npu_chunk_gated_delta_rule computes: the gated delta rule of
    npu_recurrent_gated_delta_rule over packed sequences (sequence n the next actual_seq_lengths[n] tokens, from
    initial_state[n] [Nv, Dv, Dk], which it updates in place) - the chunked form is the same recurrence. Returns
    (o [T, Nv, Dv] in value's dtype, final_state [B, Nv, Dv, Dk]), computed in fp32 (float64 for float64)."""
    _require(None not in (beta, initial_state, actual_seq_lengths, scale), "npu_chunk_gated_delta_rule",
             "beta, initial_state, actual_seq_lengths and scale given")
    wide = _wide(value.dtype)
    out = torch.empty(value.shape, dtype=wide, device=value.device)
    begin = 0
    for n, length in enumerate(actual_seq_lengths.tolist()):
        tokens = range(begin, begin + length)
        out[begin : begin + length], states = _delta_rule(query, key, value, beta, g, initial_state[n].to(wide),
                                                          scale, tokens)
        if states:
            initial_state[n] = states[-1].to(initial_state.dtype)
        begin += length
    return out.to(value.dtype), initial_state
