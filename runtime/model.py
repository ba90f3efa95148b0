"""The Qwen3.5 text model - gated full attention, GatedDeltaNet, dense MLP or MoE with a shared expert -
and its MTP head, as plain nn.Modules whose parameter names follow the checkpoint (QWEN35.md).

Activations are [B, T, hidden]. Per-request caches live in a ModelState (state.py) that every forward takes.
The model has two entry points: `prefill(tokens, state, n_valid)` over prompt chunks, and `step(tokens, state)`,
a decode / verify step of T <= spec_tokens + 1 tokens; `commit_accepted` keeps what each request accepts of
either. The layers (norms, attention, GatedDeltaNet) live in mixers.py.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from npuport.devices import graphs_supported
from npuport.errors import NpuportError
from npuport.kernels.fused_moe import StackedExperts, fused_experts, route_top_k
from npuport.runtime.config import FULL_ATTENTION, ModelConfig
from npuport.runtime.dispatch import dispatch, int8_dispatch
from npuport.runtime.expert_parallel import ExpertShard, expert_parallel_experts, traffic_record
from npuport.runtime.invariance import batch_invariant, current_invariance
from npuport.runtime.linear import Linear, QuantizedActivation, StackedLinear, float_linear, project, stack_linears
from npuport.runtime.mixers import Attention, GatedDeltaNet, RMSNorm, Step, rope_tables
from npuport.runtime.parallel import Parallel, local_config, row_parallel
from npuport.runtime.state import GDNState, KVCache, ModelState, new_mtp_state, new_target_state


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
    (gate rows, then up rows) and down_proj [E, H, I] in the model's float dtype, or - W8A8, and W4A8 with its int4
    values unpacked to int8 by the loader - int8 with per-channel scales gate_up_proj_scale [E, 2I] and
    down_proj_scale [E, H] fp32; int4 (W4A8 kept packed, StackedExperts.int4): int8 bytes of int4 row pairs,
    gate_up_proj [E, I, H] and down_proj [E, H/2, I], the same scales."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, quantized: bool = False,
                 int4: bool = False) -> None:
        super().__init__()
        self.int4 = int4
        rows = 2 if int4 else 1
        shapes = {"gate_up_proj": (num_experts, 2 * intermediate // rows, hidden),
                  "down_proj": (num_experts, hidden // rows, intermediate)}
        scale_rows = {"gate_up_proj": 2 * intermediate, "down_proj": hidden}
        for name, shape in shapes.items():
            if quantized:
                self.register_buffer(name, torch.empty(shape, dtype=torch.int8))
                self.register_buffer(f"{name}_scale", torch.empty(num_experts, scale_rows[name],
                                                                  dtype=torch.float32))
            else:
                self.register_parameter(name, nn.Parameter(torch.empty(shape), requires_grad=False))

    @property
    def quantized(self) -> bool:
        return self.gate_up_proj.dtype == torch.int8

    def stacked(self) -> StackedExperts:
        if self.quantized:
            return StackedExperts(self.gate_up_proj, self.down_proj, self.gate_up_proj_scale, self.down_proj_scale,
                                  int4=self.int4)
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
        return fused_experts(flat, self.experts.stacked(), weights, chosen, shared=(shared, shared_weight),
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
        """The Step of T = t tokens starting at positions start [B] of a state with room for `capacity`
        positions: a prefill of n_valid [B] real tokens per row, or (n_valid None) a decode / verify step, which
        takes static shapes where graphs can capture it (static_shapes: see prefill)."""
        positions = start[:, None] + torch.arange(t, device=start.device)
        cos, sin = self.rope_at(positions, capacity)
        prefill = n_valid is not None
        static = static_shapes or (not prefill and graphs_supported(start.device))
        return Step(start.clone(), cos, sin, prefill, n_valid, static_shapes=static)

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

    def prefill(self, tokens: torch.Tensor, state: ModelState, n_valid: torch.Tensor,
                hidden_states: list[torch.Tensor] | None = None, static_shapes: bool = False) -> torch.Tensor:
        """A chunk of prompts: tokens [B, T] at positions state.positions[b] + t, the first n_valid[b] of row b
        real (right padding) -> final-normed hidden [B, T, hidden]. Commit afterwards with
        commit_accepted(state, n_valid, 0). `hidden_states`, if given, receives what transformers'
        output_hidden_states gives: the embeddings, the outputs of layers 0..n-2 and the final normed hidden.
        static_shapes: without a host synchronisation (Step.static_shapes), which a graph can capture; its
        padding rows must lie within the state's capacity. A prefill is not a step: it runs the fast kernels,
        whatever batch_invariant() says."""
        step = self.make_step(state.positions, tokens.shape[1], n_valid, state.capacity, static_shapes)
        with batch_invariant(None):
            return run_layers(self.layers, state.layers, self.embed_tokens(tokens), step, self.norm, hidden_states)

    def step(self, tokens: torch.Tensor, state: ModelState) -> torch.Tensor:
        """A decode / verify step: tokens [B, T] (T <= spec_tokens + 1) at positions state.positions[b] + t ->
        final-normed hidden [B, T, hidden], staged until commit_accepted(state, n_new, T) keeps n_new[b] of them."""
        step = self.make_step(state.positions, tokens.shape[1], None, state.capacity)
        return run_layers(self.layers, state.layers, self.embed_tokens(tokens), step, self.norm)

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
