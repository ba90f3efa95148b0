"""The layers a Qwen3.5 step runs through before its MLP: the norms (1 + w and gated), gated full attention and
GatedDeltaNet, and the Step every layer of one forward shares (its positions, rope angles, and whether it is a
prefill or a decode / verify step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from npuport.kernels.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from npuport.kernels.decode_attention import decode_attention
from npuport.kernels.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from npuport.kernels.gated_rms_norm import gated_rms_norm
from npuport.kernels.gdn_gating import fused_gdn_gating
from npuport.kernels.kv_write import write_kv
from npuport.kernels.rms_norm import add_rms_norm, rms_norm
from npuport.kernels.rope import rms_norm_rope
from npuport.runtime.config import ModelConfig
from npuport.runtime.invariance import planned_tokens
from npuport.runtime.linear import Linear, StackedLinear, W8A8Linear, project, stack_linears
from npuport.runtime.parallel import Parallel, row_parallel
from npuport.runtime.state import GDNState, KVCache


@dataclass
class Step:
    """What every layer needs to know about the T tokens of one forward."""

    start: torch.Tensor  # [B] position of each request's first token
    cos: torch.Tensor  # [B, T, rotary_dim]
    sin: torch.Tensor
    prefill: bool  # a chunk of prompts (committed with step_tokens 0), else a decode / verify step (staged)
    n_valid: torch.Tensor | None  # a prefill's real tokens per request [B]; None in a decode / verify step
    # Attend over whole KV caches, masked, rather than up to the furthest position written, and start a prefill's
    # GDN layers from a replay of every log slot: no host sync and fixed shapes, so that a decode / verify step,
    # or a prefill asked for it (Qwen35.prefill's static_shapes), can be captured as a CUDA graph.
    static_shapes: bool = False


def rope_tables(positions: torch.Tensor, config: ModelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, T, rotary_dim] (text positions: Qwen3.5's M-RoPE is plain 1-D RoPE)."""
    rot = config.rotary_dim
    exponents = torch.arange(0, rot, 2, dtype=torch.float32, device=positions.device) / rot
    inv_freq = 1.0 / (config.rope_theta**exponents)
    freqs = positions[..., None].float() * inv_freq
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


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
            if not step.prefill:  # a decode / verify step: flash-decoding, the gate fused
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
        # The four input projections as one GEMM once stacked; as two (in_proj_qkv with in_proj_z, in_proj_b with
        # in_proj_a) where the artifact quantized the first pair and kept the small second pair FLOAT, as
        # msModelSlim's Qwen3.6 recipes do.
        self.in_proj: tuple[StackedLinear, ...] | None = None

    def input_projections(self) -> tuple[Linear | W8A8Linear, ...]:
        return self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def stack_projections(self) -> None:
        whole = stack_linears(self.input_projections())
        if whole is not None:
            self.in_proj = (whole,)
            return
        pairs = (stack_linears([self.in_proj_qkv, self.in_proj_z]), stack_linears([self.in_proj_b, self.in_proj_a]))
        self.in_proj = pairs if None not in pairs else None

    def project_input(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, T, hidden] -> (mixed qkv [B, T, conv_dim], z [B, T, HV*V], b logits [B, T, HV], a [B, T, HV])."""
        if self.in_proj is None:
            return project(None, self.input_projections(), x)
        return tuple(out for stacked in self.in_proj for out in stacked(x))

    def forward(self, x: torch.Tensor, state: GDNState, step: Step) -> torch.Tensor:
        b, t, _ = x.shape
        # b_logits and a sit side by side in one stacked output: the recurrent kernel reads both with one stride
        mixed, z, b_logits, a = self.project_input(x)
        weight = self.conv1d.weight[:, 0]  # [conv_dim, W]
        if not step.prefill:
            if t > state.slots:
                raise ValueError(f"a verify step of {t} tokens needs {t} GDN state slots, the state has {state.slots}")
            mixed = causal_conv1d_update(mixed, weight, state.conv)
        else:
            mixed = causal_conv1d_fn(mixed, weight, state.conv, step.n_valid)
        key_width = self.n_k_heads * self.k_dim
        q, k, v = mixed.split([key_width, key_width, self.n_v_heads * self.v_dim], dim=-1)
        q, k = q.reshape(b, t, self.n_k_heads, self.k_dim), k.reshape(b, t, self.n_k_heads, self.k_dim)
        v = v.reshape(b, t, self.n_v_heads, self.v_dim)
        if not step.prefill:
            # The gating is fused into the recurrent kernel: a and b go in raw.
            out = fused_recurrent_gated_delta_rule(q, k, v, a, b_logits, state.recurrent, state.log,
                                                   A_log=self.A_log, dt_bias=self.dt_bias,
                                                   plan_tokens=planned_tokens(b))
        else:
            g, beta = fused_gdn_gating(self.A_log, a, self.dt_bias, b_logits)
            # Padding tokens get g = 0 and beta = 0: they leave the state as the last real token left it.
            real = (torch.arange(t, device=x.device)[None, :] < step.n_valid[:, None])[..., None]
            g, beta = torch.where(real, g, 0.0), torch.where(real, beta, 0.0)
            out, final = chunk_gated_delta_rule(q, k, v, g, beta, state.current(graph_safe=step.static_shapes))
            state.set_current(final)
        z = z.view(b, t, self.n_v_heads, self.v_dim)
        return row_parallel(self.out_proj, self.norm(out, z).reshape(b, t, -1), self.parallel)
