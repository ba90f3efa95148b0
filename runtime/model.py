"""The Qwen3.5 text model - gated full attention, GatedDeltaNet, dense MLP or MoE with a shared expert -
and its MTP head, as plain nn.Modules whose parameter names follow the checkpoint (QWEN35.md).

Activations are [B, T, hidden]. Per-request caches live in a ModelState (state.py) that every forward
takes; a forward with `n_valid` is a prefill (committed by the layers themselves), one without is a
decode / verify step that stays staged until `commit_accepted`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from npuport.devices import graphs_supported
from npuport.errors import NpuportError
from npuport.kernels.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from npuport.kernels.decode_attention import decode_attention
from npuport.kernels.fused_moe import StackedExperts, fused_experts, route_top_k, routed_and_shared_experts
from npuport.kernels.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from npuport.kernels.gated_rms_norm import gated_rms_norm
from npuport.kernels.gdn_gating import fused_gdn_gating
from npuport.kernels.kv_write import write_kv
from npuport.kernels.rms_norm import add_rms_norm, rms_norm
from npuport.kernels.rope import rms_norm_rope
from npuport.runtime.config import FULL_ATTENTION, ModelConfig
from npuport.runtime.dispatch import dispatch, int8_dispatch
from npuport.runtime.expert_parallel import ExpertShard, expert_parallel_experts, traffic_record
from npuport.runtime.invariance import batch_invariant, current_invariance
from npuport.runtime.linear import (
    Linear,
    QuantizedActivation,
    StackedLinear,
    W8A8Linear,
    float_linear,
    project,
    stack_linears,
)
from npuport.runtime.parallel import Parallel, local_config, row_parallel
from npuport.runtime.state import GDNState, KVCache, ModelState, new_mtp_state, new_target_state


@dataclass
class Step:
    """What every layer needs to know about the T tokens of one forward."""

    start: torch.Tensor  # [B] position of each request's first token
    cos: torch.Tensor  # [B, T, rotary_dim]
    sin: torch.Tensor
    n_valid: torch.Tensor | None  # [B] real tokens per request in a prefill; None for decode / verify
    # Attend over whole KV caches, masked, rather than up to the furthest position written, and start a prefill's
    # GDN layers from a replay of every log slot: no host sync and fixed shapes, so that a decode / verify step,
    # or a prefill asked for it (Qwen35.forward's static_shapes), can be captured as a CUDA graph.
    static_shapes: bool = False


def rope_tables(positions: torch.Tensor, config: ModelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, T, rotary_dim] (text positions: Qwen3.5's M-RoPE is plain 1-D RoPE)."""
    rot = config.rotary_dim
    exponents = torch.arange(0, rot, 2, dtype=torch.float32, device=positions.device) / rot
    inv_freq = 1.0 / (config.rope_theta**exponents)
    freqs = positions[..., None].float() * inv_freq
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def planned_tokens(batch: int) -> int | None:
    """Inside batch_invariant(): the tokens per request that a decode / verify step's attention and GDN kernels
    plan for, so that every step launches as the largest verify step; else None (each step its own size)."""
    invariance = current_invariance()
    return None if invariance is None else invariance.tokens_per_request(batch)


class RMSNorm(nn.Module):
    """y = x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32 (the weight starts at zero)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one launch; (norm(x), x) when residual is None."""
        if residual is None:
            return self(x), x
        return add_rms_norm(x, residual, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """The GDN output norm: w * rmsnorm(o) * silu(z), with a plain weight w (not 1 + w)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Causal GQA softmax attention. q [B, T, Hq, D] at positions start[b] + t; keys, values [B, S, Hkv, D]
    (position s at index s; query head h reads kv head h // (Hq / Hkv)). Query t sees keys at positions
    <= its own. Returns [B, T, Hq, D]."""
    t, s = q.shape[1], keys.shape[1]
    group = q.shape[2] // keys.shape[2]
    keys, values = (x.repeat_interleave(group, dim=2) if group > 1 else x for x in (keys, values))
    q_pos = start[:, None] + torch.arange(t, device=q.device)
    visible = torch.arange(s, device=q.device)[None, None, :] <= q_pos[:, :, None]  # [B, T, S]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=visible[:, None], scale=q.shape[-1] ** -0.5)
    return out.transpose(1, 2)


class Attention(nn.Module):
    """Gated full attention: q_proj gives [q | gate] per head, q/k RMSNorm per head, partial RoPE,
    o_proj(attention * sigmoid(gate)). config: this rank's sizes (parallel.local_config); o_proj row-parallel."""

    def __init__(self, config: ModelConfig, parallel: Parallel) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.parallel = parallel
        self.n_heads, self.n_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = Linear(h, 2 * self.n_heads * d)
        self.k_proj = Linear(h, self.n_kv_heads * d)
        self.v_proj = Linear(h, self.n_kv_heads * d)
        self.o_proj = Linear(self.n_heads * d, h)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.qkv: StackedLinear | None = None  # q_proj, k_proj, v_proj as one GEMM once stack_projections ran

    def stack_projections(self) -> None:
        self.qkv = stack_linears([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x: torch.Tensor, cache: KVCache, step: Step) -> torch.Tensor:
        b, t, _ = x.shape
        q_gate, k, v = project(self.qkv, (self.q_proj, self.k_proj, self.v_proj), x)
        q, gate = q_gate.view(b, t, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = rms_norm_rope(q, self.q_norm.weight, self.q_norm.eps, step.cos, step.sin)
        k = rms_norm_rope(k.view(b, t, self.n_kv_heads, self.head_dim), self.k_norm.weight, self.k_norm.eps,
                          step.cos, step.sin)
        v = v.view(b, t, self.n_kv_heads, self.head_dim)
        if step.static_shapes:  # without a host sync: the whole caches
            write_kv(cache.k, cache.v, step.start, k, v)
            if step.n_valid is None:  # a decode / verify step: flash-decoding, the gate fused
                out = decode_attention(q, cache.k, cache.v, step.start, gate, planned_tokens(b)).reshape(b, t, -1)
                return row_parallel(self.o_proj, out, self.parallel)
            keys, values = cache.k, cache.v
        else:
            keys, values = cache.update(step.start, k, v)
        out = attend(q, keys, values, step.start).reshape(b, t, -1)
        return row_parallel(self.o_proj, out * torch.sigmoid(gate.reshape(b, t, -1)), self.parallel)


class GatedDeltaNet(nn.Module):
    """Linear attention: in_proj_qkv -> causal conv1d + SiLU -> q, k, v; gating from in_proj_a / in_proj_b;
    the gated delta rule over an fp32 state; gated RMSNorm with in_proj_z; out_proj. config: this rank's sizes
    (its key and value heads); out_proj row-parallel."""

    def __init__(self, config: ModelConfig, parallel: Parallel) -> None:
        super().__init__()
        h = config.hidden_size
        self.parallel = parallel
        self.n_k_heads, self.n_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        conv_dim = config.conv_dim
        self.in_proj_qkv = Linear(h, conv_dim)
        self.in_proj_z = Linear(h, self.n_v_heads * self.v_dim)
        self.in_proj_b = Linear(h, self.n_v_heads)
        self.in_proj_a = Linear(h, self.n_v_heads)
        # Holds the depthwise kernel as the checkpoint names it, conv1d.weight [conv_dim, 1, W].
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.conv1d.weight.requires_grad_(False)
        self.A_log = nn.Parameter(torch.zeros(self.n_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.v_dim, config.rms_norm_eps)
        self.out_proj = Linear(self.n_v_heads * self.v_dim, h)
        self.in_proj: StackedLinear | None = None  # the four input projections as one GEMM once stacked

    def input_projections(self) -> tuple[Linear | W8A8Linear, ...]:
        return self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def stack_projections(self) -> None:
        self.in_proj = stack_linears(self.input_projections())

    def forward(self, x: torch.Tensor, state: GDNState, step: Step) -> torch.Tensor:
        b, t, _ = x.shape
        # b_logits and a sit side by side in one stacked output: the recurrent kernel reads both with one stride
        mixed, z, b_logits, a = project(self.in_proj, self.input_projections(), x)
        weight = self.conv1d.weight[:, 0]  # [conv_dim, W]
        if step.n_valid is None:
            if t > state.slots:
                raise ValueError(f"a verify step of {t} tokens needs {t} GDN state slots, the state has {state.slots}")
            mixed = causal_conv1d_update(mixed, weight, state.conv)
        else:
            mixed = causal_conv1d_fn(mixed, weight, state.conv, step.n_valid)
        key_width = self.n_k_heads * self.k_dim
        q, k, v = mixed.split([key_width, key_width, self.n_v_heads * self.v_dim], dim=-1)
        q, k = q.reshape(b, t, self.n_k_heads, self.k_dim), k.reshape(b, t, self.n_k_heads, self.k_dim)
        v = v.reshape(b, t, self.n_v_heads, self.v_dim)
        if step.n_valid is None:
            # The gating is fused into the recurrent kernel: a and b go in raw.
            out = fused_recurrent_gated_delta_rule(q, k, v, a, b_logits, state.recurrent, state.log,
                                                   A_log=self.A_log, dt_bias=self.dt_bias,
                                                   plan_tokens=planned_tokens(b))
            state.staged = t
        else:
            g, beta = fused_gdn_gating(self.A_log, a, self.dt_bias, b_logits)
            # Padding tokens get g = 0 and beta = 0: they leave the state as the last real token left it.
            real = (torch.arange(t, device=x.device)[None, :] < step.n_valid[:, None])[..., None]
            g, beta = torch.where(real, g, 0.0), torch.where(real, beta, 0.0)
            out, final = chunk_gated_delta_rule(q, k, v, g, beta, state.current(graph_safe=step.static_shapes))
            state.set_current(final)
        z = z.view(b, t, self.n_v_heads, self.v_dim)
        return row_parallel(self.out_proj, self.norm(out, z).reshape(b, t, -1), self.parallel)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); x may be int8 tokens when gate/up are W8A8. intermediate: this rank's
    channels; down_proj row-parallel."""

    def __init__(self, hidden: int, intermediate: int, parallel: Parallel) -> None:
        super().__init__()
        self.parallel = parallel
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)
        self.gate_up: StackedLinear | None = None  # gate_proj and up_proj as one GEMM once stacked

    def stack_projections(self) -> None:
        self.gate_up = stack_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor | QuantizedActivation, reduce: bool = True) -> torch.Tensor:
        """reduce=False: on several ranks, this rank's partial sum of the output (see row_parallel)."""
        gate, up = project(self.gate_up, (self.gate_proj, self.up_proj), x)
        return row_parallel(self.down_proj, F.silu(gate) * up, self.parallel, reduce)

    def as_expert(self) -> StackedExperts | None:
        """The MLP as a single stacked expert (views, no copy) once stack_projections() ran, else None."""
        if self.gate_up is None or self.parallel.active:
            return None
        down = self.down_proj.weight
        if self.gate_up.scale is None:
            return StackedExperts(self.gate_up.weight[None], down[None])
        return StackedExperts(self.gate_up.weight[None], down[None], self.gate_up.scale.reshape(1, -1),
                              self.down_proj.weight_scale.reshape(1, -1))


class Experts(nn.Module):
    """The routed experts of one MoE layer, stacked (kernels.fused_moe.StackedExperts): gate_up_proj [E, 2I, H]
    (gate rows, then up rows) and down_proj [E, H, I] in the model's float dtype, or - W8A8 - int8 with
    per-channel scales gate_up_proj_scale [E, 2I] and down_proj_scale [E, H] fp32."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, quantized: bool = False) -> None:
        super().__init__()
        shapes = {"gate_up_proj": (num_experts, 2 * intermediate, hidden), "down_proj": (num_experts, hidden,
                                                                                         intermediate)}
        for name, shape in shapes.items():
            if quantized:
                self.register_buffer(name, torch.empty(shape, dtype=torch.int8))
                self.register_buffer(f"{name}_scale", torch.empty(shape[:2], dtype=torch.float32))
            else:
                self.register_parameter(name, nn.Parameter(torch.empty(shape), requires_grad=False))

    @property
    def quantized(self) -> bool:
        return self.gate_up_proj.dtype == torch.int8

    def stacked(self) -> StackedExperts:
        if self.quantized:
            return StackedExperts(self.gate_up_proj, self.down_proj, self.gate_up_proj_scale, self.down_proj_scale)
        return StackedExperts(self.gate_up_proj, self.down_proj)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                plan_tokens: int | None = None) -> torch.Tensor:
        """x [M, H], weights and expert_ids [M, top_k] -> [M, H]: the weighted sum of each token's experts.
        plan_tokens: fused_experts'."""
        return fused_experts(x, self.stacked(), weights, expert_ids, plan_tokens=plan_tokens)


class MoE(nn.Module):
    """Softmax router (fp32) with renormalized top-k over the stacked experts, plus a sigmoid-gated shared
    expert; routing and experts run on the device without a host synchronisation (a step can be captured as a
    graph). Tokens go to the experts as BF16 or as int8 + per-token scales, as dispatch.py says. On several
    ranks each holds ExpertShard's share of the experts and of the shared expert's channels; each routes its
    slice of the tokens (Parallel.token_rows) and sends them to the ranks holding their experts
    (expert_parallel.py) - that is where the dispatch switch decides what travels."""

    def __init__(self, config: ModelConfig, name: str, parallel: Parallel) -> None:
        super().__init__()
        h = config.hidden_size
        self.name, self.top_k, self.parallel = name, config.num_experts_per_tok, parallel
        self.shard = ExpertShard(config.num_experts, parallel.world)
        self.gate = Linear(h, config.num_experts)
        self.experts = Experts(self.shard.per_rank, h, config.moe_intermediate_size)
        self.shared_expert = MLP(h, config.shared_expert_intermediate_size, parallel)
        self.shared_expert_gate = Linear(h, 1)
        self.router: StackedLinear | None = None  # gate and shared_expert_gate as one GEMM once stacked

    def stack_projections(self) -> None:
        self.router = stack_linears([self.gate, self.shared_expert_gate])

    @property
    def experts_quantized(self) -> bool:
        """The loader gives all experts of a layer one label (CONTRACT.md)."""
        return self.experts.quantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        router_logits, shared_logit = project(self.router, (self.gate, self.shared_expert_gate), flat)
        weights, chosen = route_top_k(router_logits, self.top_k, x.dtype)  # [M, top_k]
        int8 = int8_dispatch(self.experts_quantized, self.name)
        shared_weight = torch.sigmoid(shared_logit)  # [M, 1]
        if self.parallel.active:
            return self.parallel_forward(flat, weights, chosen, shared_weight, int8).view(x.shape)
        # On one device int8 and BF16 dispatch give W8A8 experts the same int8 values: the experts' kernels
        # quantize the tokens themselves (int8_dispatch above still refuses int8 into BF16 experts).
        shared = self.shared_expert.as_expert()
        invariance = current_invariance()  # the expert path and tiles by the call's largest step, not this one
        plan = None if invariance is None else invariance.rows
        if shared is None:
            routed = self.experts(flat, weights, chosen, plan_tokens=plan)
            return (routed + shared_weight * self.shared_expert(flat)).view(x.shape)
        return routed_and_shared_experts(flat, self.experts.stacked(), weights, chosen, shared, shared_weight,
                                         plan_tokens=plan).view(x.shape)

    def parallel_forward(self, flat: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                         shared_weight: torch.Tensor, int8: bool) -> torch.Tensor:
        """forward on several ranks, flat [M, H] the same on each: this rank's token slice through the
        experts of every rank (dispatch and combine), its partial shared-expert sum for every token, one
        all-reduce adding both up."""
        p = self.parallel
        mine = p.token_rows(flat.shape[0])
        routed = expert_parallel_experts(flat[mine], weights[mine], chosen[mine], self.experts.stacked(), self.shard,
                                         int8, p.group, traffic_record(self.name), p.token_counts(flat.shape[0]))
        out = shared_weight * self.shared_expert(flat, reduce=False)
        out[mine] += routed
        return self.parallel.all_reduce(out)


class DecoderLayer(nn.Module):
    """x += mixer(input_layernorm(x)); x += mlp(post_attention_layernorm(x))."""

    def __init__(self, config: ModelConfig, kind: str, name: str, parallel: Parallel) -> None:
        super().__init__()
        self.kind = kind
        if kind == FULL_ATTENTION:
            self.self_attn = Attention(config, parallel)
        else:
            self.linear_attn = GatedDeltaNet(config, parallel)
        h = config.hidden_size
        self.mlp = (MoE(config, f"{name}.mlp", parallel) if config.is_moe
                    else MLP(h, config.intermediate_size, parallel))
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, state: KVCache | GDNState, step: Step
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, hidden]: the previous layer's MLP output, residual: the stream it adds to (None for the
        first layer, whose x is the stream). Returns (this layer's MLP output, the stream before it): their
        sum is the layer's output. Each residual add is fused into the norm after it."""
        mixer = self.self_attn if self.kind == FULL_ATTENTION else self.linear_attn
        normed, residual = self.input_layernorm.add(x, residual)
        normed, residual = self.post_attention_layernorm.add(mixer(normed, state, step), residual)
        return self.mlp(normed), residual


def run_layers(layers: Iterable[DecoderLayer], states: Iterable[KVCache | GDNState], x: torch.Tensor, step: Step,
               final_norm: RMSNorm, hidden_states: list[torch.Tensor] | None = None) -> torch.Tensor:
    """x [B, T, hidden] through the layers and the final norm; hidden_states, if given, receives each layer's
    input and the normed output."""
    residual = None
    for layer, state in zip(layers, states, strict=True):
        if hidden_states is not None:
            hidden_states.append(x if residual is None else x + residual)
        x, residual = layer(x, residual, state, step)
    x = final_norm.add(x, residual)[0]
    if hidden_states is not None:
        hidden_states.append(x)
    return x


class MTPHead(nn.Module):
    """x = fc([pre_fc_norm_embedding(embed(token_{i+1})), pre_fc_norm_hidden(hidden_i)]) -> full-attention
    decoder layer(s) -> norm. embed_tokens and lm_head are the target's. config: this rank's sizes."""

    def __init__(self, config: ModelConfig, parallel: Parallel) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.fc = Linear(2 * h, h)
        self.pre_fc_norm_embedding = RMSNorm(h, eps)
        self.pre_fc_norm_hidden = RMSNorm(h, eps)
        self.layers = nn.ModuleList(
            DecoderLayer(config, FULL_ATTENTION, f"mtp.layers.{i}", parallel)
            for i in range(config.mtp_num_hidden_layers)
        )
        self.norm = RMSNorm(h, eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, state: ModelState, step: Step) -> torch.Tensor:
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        return run_layers(self.layers, state.layers, x, step, self.norm)


def stack_projections(root: nn.Module) -> None:
    """Once, after loading, for inference: in root and every module under it, the linear layers that read the
    same input (attention's q/k/v, the GDN input projections, an MLP's gate/up, a MoE router and its
    shared-expert gate) become one GEMM each - fewer launches per step, and one quantization of the input where
    they are W8A8; a MoE layer's shared expert can then run as one more slot of its routed experts."""
    for module in root.modules():
        if isinstance(module, Attention | GatedDeltaNet | MLP | MoE):
            module.stack_projections()


# The rope table of Qwen35.rope_at grows in steps of this many positions.
ROPE_TABLE_STEP = 4096


class Qwen35(nn.Module):
    """embed -> decoder layers -> norm -> lm_head (tied to embed_tokens when there is none), plus the MTP head.
    On several ranks (parallel) each holds its part of every layer (parallel.py); the output is the same on all."""

    def __init__(self, config: ModelConfig, with_mtp: bool, parallel: Parallel | None = None) -> None:
        super().__init__()
        self.config, self.parallel = config, parallel or Parallel()
        self.local_config = local_config(config, self.parallel)  # this rank's heads and channels
        h, local = config.hidden_size, self.local_config
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(local, kind, f"layers.{i}", self.parallel) for i, kind in enumerate(config.layer_types)
        )
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.vocab_rows = self.parallel.vocab_rows(config.vocab_size)  # this rank's logits; None: all
        vocab = config.vocab_size if self.vocab_rows is None else self.vocab_rows.stop - self.vocab_rows.start
        self.lm_head = None if config.tie_word_embeddings else Linear(h, vocab)
        self.mtp = MTPHead(local, self.parallel) if with_mtp else None
        # decode / verify steps batch-invariant (runtime/invariance.py): True, False, or None: off
        # (generate.use_invariance)
        self.batch_invariant: bool | None = None

    def stack_projections(self) -> None:
        stack_projections(self)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_state(self, batch: int, capacity: int, spec_tokens: int = 0) -> ModelState:
        """Target state for `batch` requests of up to `capacity` positions, verifying spec_tokens + 1 at once."""
        return new_target_state(self.local_config, batch, capacity, spec_tokens, self.dtype, self.device)

    def new_mtp_state(self, batch: int, capacity: int) -> ModelState:
        return new_mtp_state(self.local_config, batch, capacity, self.dtype, self.device)

    def make_step(self, start: torch.Tensor, t: int, n_valid: torch.Tensor | None, capacity: int,
                  static_shapes: bool = False) -> Step:
        """The Step of T = t tokens starting at positions start [B] (n_valid, static_shapes: see forward) of a
        state with room for `capacity` positions. Decode / verify steps take static shapes where graphs can
        capture them."""
        positions = start[:, None] + torch.arange(t, device=start.device)
        cos, sin = self.rope_at(positions, capacity)
        static = static_shapes or (n_valid is None and graphs_supported(start.device))
        return Step(start.clone(), cos, sin, n_valid, static_shapes=static)

    def rope_at(self, positions: torch.Tensor, reach: int) -> tuple[torch.Tensor, torch.Tensor]:
        """rope_tables(positions) for positions [B, T] < reach (those beyond are padding: they get the last
        row), gathered in one launch from a table of every position up to reach, computed once - a step
        spends no launches on its angles, and a position's cos and sin are the same bits in every step."""
        table = self.__dict__.get("_rope_table")
        if table is None or table.shape[0] < reach or table.dtype != self.dtype or table.device != positions.device:
            rows = -(-reach // ROPE_TABLE_STEP) * ROPE_TABLE_STEP
            cos, sin = rope_tables(torch.arange(rows, device=positions.device)[None], self.config, self.dtype)
            table = self.__dict__["_rope_table"] = torch.cat([cos[0], sin[0]], dim=-1)  # [rows, 2 * rotary_dim]
        rot = self.config.rotary_dim
        both = table[positions.clamp_max(table.shape[0] - 1)]  # [B, T, 2 * rotary_dim]
        return both[..., :rot], both[..., rot:]

    def forward(self, tokens: torch.Tensor, state: ModelState, n_valid: torch.Tensor | None = None,
                hidden_states: list[torch.Tensor] | None = None, static_shapes: bool = False) -> torch.Tensor:
        """tokens [B, T] at positions state.positions[b] + t -> final-normed hidden [B, T, hidden].
        n_valid [B]: a prefill of that many real tokens per row (right padding); None: a decode / verify
        step of T <= spec_tokens + 1 tokens. Commit afterwards with commit_accepted. `hidden_states`, if
        given, receives what transformers' output_hidden_states gives: the embeddings, the outputs of
        layers 0..n-2 and the final normed hidden. static_shapes: a prefill without a host synchronisation
        (Step.static_shapes), which a graph can capture; its padding rows must lie within the state's capacity."""
        step = self.make_step(state.positions, tokens.shape[1], n_valid, state.capacity, static_shapes)
        # a prefill is not a step: the fast kernels, whatever batch_invariant() says
        with batch_invariant(None) if n_valid is not None else contextlib.nullcontext():
            return run_layers(self.layers, state.layers, self.embed_tokens(tokens), step, self.norm, hidden_states)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., vocab]. On several ranks each computes its vocabulary rows' and they are
        gathered."""
        if self.lm_head is not None:
            mine = self.lm_head(hidden)
        else:  # tied: the embedding's rows (all, or this rank's)
            table = self.embed_tokens.weight
            mine = float_linear(hidden, table if self.vocab_rows is None else table[self.vocab_rows])
        return mine if self.vocab_rows is None else self.parallel.all_gather_last(mine)

    def mtp_forward(self, next_tokens: torch.Tensor, hidden: torch.Tensor, state: ModelState,
                    start: torch.Tensor | None = None, logits_at: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP head at positions start[b] + t (default: state.positions): row t pairs next_tokens [B, T]
        (the token after position t) with hidden [B, T, hidden] (the target's final-normed hidden there,
        or the head's own output for later draft steps). Returns logits for the token after next,
        [B, T, vocab] - or [B, 1, vocab] at row logits_at[b] only - and the head's normed output
        [B, T, hidden]. Always runs with BF16 dispatch."""
        if self.mtp is None:
            raise NpuportError("this checkpoint has no MTP head (mtp.*); speculative decoding needs one")
        step = self.make_step(state.positions if start is None else start, next_tokens.shape[1], None,
                              state.capacity)
        with dispatch(bf16=True):
            out = self.mtp(self.embed_tokens(next_tokens), hidden, state, step)
        rows = out if logits_at is None else out[torch.arange(out.shape[0], device=out.device), logits_at][:, None]
        return self.logits(rows), out
