"""Tensor and expert parallelism: which heads, channels and experts of a Qwen3.5 model one rank of `world` holds,
and the collectives that add the ranks' parts up (torch.distributed; gloo, NCCL or HCCL as
npuport.devices.distributed_backend says).

Every rank holds every token. Column-parallel projections (attention's q/k/v, the GDN input projections and
conv, an MLP's gate/up) give each rank its heads or intermediate channels; row-parallel ones (o_proj, out_proj,
down_proj) give each rank a partial sum of the full output, which one all-reduce completes. The GDN states and
KV caches follow the heads. The lm_head splits by vocabulary entry (each rank's logits gathered: it is the largest
tensor a decode step reads). The router, norms, embeddings and the MTP head's fc are replicated. The
routed experts split by expert (runtime/expert_parallel.py); a rank routes only its own slice of the tokens
(`token_rows`) and dispatches them to the experts' ranks.

A W8A8 row-parallel layer quantizes its input slice with the scale of the whole row (an all-reduce of each
token's absolute maximum), so each rank's int8 values are those one device would compute.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from npuport.errors import NpuportError
from npuport.kernels.w8a8 import int8_matmul_rescale
from npuport.kernels.w8a8.naive import quantize_with_scale_reference, scale_from_amax_reference
from npuport.runtime.config import ModelConfig
from npuport.runtime.linear import Linear, W8A8Linear

# the one-tensor all-gather: torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there)
_all_gather_rows = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Parallel:
    """This process's place among the `world` ranks of `group` (None: the default group) that share one model.
    Parallel() is a single device: nothing split, no collective."""

    rank: int = 0
    world: int = 1
    group: dist.ProcessGroup | None = None

    @classmethod
    def from_default_group(cls) -> Parallel:
        """The default process group's rank and size; a single device when none is initialised."""
        if not dist.is_available() or not dist.is_initialized():
            return cls()
        return cls(dist.get_rank(), dist.get_world_size())

    @property
    def active(self) -> bool:
        return self.world > 1

    def part(self, n: int, what: str) -> slice:
        """This rank's contiguous share of n units (heads, channels); n must split evenly."""
        if n % self.world:
            raise NpuportError(f"{self.world} devices do not divide the {n} {what}; use a device count that "
                               "divides it")
        size = n // self.world
        return slice(self.rank * size, (self.rank + 1) * size)

    def kv_heads(self, n_kv: int, n_heads: int) -> slice:
        """The key-value heads this rank's query heads read: its share when there are at least as many as ranks,
        else the one head its query heads share (replicated over world / n_kv ranks)."""
        if n_kv >= self.world:
            return self.part(n_kv, "key-value heads of the attention layers")
        if self.world % n_kv:
            raise NpuportError(f"{self.world} devices are not a multiple of the {n_kv} key-value heads of the "
                               "attention layers; use a device count that divides the heads or is a multiple")
        self.part(n_heads, "attention heads")
        head = self.rank * n_kv // self.world
        return slice(head, head + 1)

    def token_rows(self, m: int) -> slice:
        """Which of M tokens this rank routes to the experts: contiguous, the first M % world ranks one more."""
        counts = self.token_counts(m)
        start = sum(counts[:self.rank])
        return slice(start, start + counts[self.rank])

    def token_counts(self, m: int) -> list[int]:
        """How many of M tokens each rank routes (token_rows of every rank)."""
        base, extra = divmod(m, self.world)
        return [base + (r < extra) for r in range(self.world)]

    def vocab_rows(self, vocab: int) -> slice | None:
        """The rows of the lm_head (vocabulary entries) this rank computes logits for; None: all of them (one
        device, or a vocabulary the ranks do not divide, whose lm_head every rank then holds whole)."""
        if not self.active or vocab % self.world:
            return None
        return self.part(vocab, "vocabulary entries")

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] from every rank -> [..., world * n], rank r's x in columns [r * n, (r + 1) * n)."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = rows.new_empty(self.world * rows.shape[0], rows.shape[1])
        _all_gather_rows(out, rows, group=self.group)  # rank r's rows in out's block r
        return out.view(self.world, *rows.shape).permute(1, 0, 2).reshape(*x.shape[:-1], -1)

    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """x summed (or op-ed) over the ranks, in place; x itself on a single device."""
        if self.active:
            dist.all_reduce(x, op=op, group=self.group)
        return x


def local_config(config: ModelConfig, parallel: Parallel) -> ModelConfig:
    """The sizes of one rank's part of the model: its attention and GDN heads, its MLP channels (the experts
    keep their count: Experts takes the rank's share itself). Raises NpuportError naming the first size the
    device count does not divide."""
    if not parallel.active:
        return config
    size = lambda s: s.stop - s.start  # noqa: E731
    p = parallel
    return dataclasses.replace(
        config,
        num_attention_heads=size(p.part(config.num_attention_heads, "attention heads")),
        num_key_value_heads=size(p.kv_heads(config.num_key_value_heads, config.num_attention_heads)),
        linear_num_key_heads=size(p.part(config.linear_num_key_heads, "GatedDeltaNet key heads")),
        linear_num_value_heads=size(p.part(config.linear_num_value_heads, "GatedDeltaNet value heads")),
        intermediate_size=size(p.part(config.intermediate_size, "MLP intermediate channels")),
        shared_expert_intermediate_size=size(p.part(config.shared_expert_intermediate_size,
                                                    "shared-expert intermediate channels")),
    )


@dataclass(frozen=True)
class Part:
    """The rows (dim 0) or columns (dim 1) of a full tensor that one rank holds: the ranges [start, stop) along
    `dim`, concatenated, out of `full`."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    full: int

    def full_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = self.full
        return tuple(shape)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This part of a full tensor (a test's or a reference's)."""
        return torch.cat([tensor.narrow(self.dim, a, b - a) for a, b in self.ranges], dim=self.dim)


# runtime tensor name -> (module kind, projection, parameter)
_NAME = re.compile(r"(self_attn|linear_attn|shared_expert|mlp)\.(\w+?)(?:\.(weight|weight_scale))?$")


def weight_part(name: str, config: ModelConfig, parallel: Parallel) -> Part | None:
    """Which part of tensor `name` (the runtime's name, e.g. `layers.0.self_attn.o_proj.weight`) this rank
    loads; None: all of it. The routed experts are ExpertShard's."""
    if name == "lm_head.weight":
        vocab = parallel.vocab_rows(config.vocab_size)
        return None if vocab is None else Part(0, ((vocab.start, vocab.stop),), config.vocab_size)
    match = _NAME.search(name) if parallel.active else None
    if match is None:
        return None
    kind, proj, param = match.groups()
    c, p = config, parallel

    def scaled(s: slice, unit: int, offset: int = 0) -> tuple[int, int]:
        return offset + s.start * unit, offset + s.stop * unit

    if kind == "self_attn":
        heads = p.part(c.num_attention_heads, "attention heads")
        kv = p.kv_heads(c.num_key_value_heads, c.num_attention_heads)
        rows = {"q_proj": ([scaled(heads, 2 * c.head_dim)], 2 * c.num_attention_heads * c.head_dim),
                "k_proj": ([scaled(kv, c.head_dim)], c.num_key_value_heads * c.head_dim),
                "v_proj": ([scaled(kv, c.head_dim)], c.num_key_value_heads * c.head_dim)}
        cols = {"o_proj": ([scaled(heads, c.head_dim)], c.num_attention_heads * c.head_dim)}
    elif kind == "linear_attn":
        kh = p.part(c.linear_num_key_heads, "GatedDeltaNet key heads")
        vh = p.part(c.linear_num_value_heads, "GatedDeltaNet value heads")
        kd, vd = c.linear_key_head_dim, c.linear_value_head_dim
        key_width = c.linear_num_key_heads * kd
        qkv = ([scaled(kh, kd), scaled(kh, kd, key_width), scaled(vh, vd, 2 * key_width)], c.conv_dim)
        per_head = ([scaled(vh, 1)], c.linear_num_value_heads)
        rows = {"in_proj_qkv": qkv, "conv1d": qkv, "in_proj_z": ([scaled(vh, vd)], c.gdn_value_dim),
                "in_proj_b": per_head, "in_proj_a": per_head, "A_log": per_head, "dt_bias": per_head}
        cols = {"out_proj": ([scaled(vh, vd)], c.gdn_value_dim)}
    else:
        width = c.shared_expert_intermediate_size if kind == "shared_expert" else c.intermediate_size
        channels = ([scaled(p.part(width, "MLP intermediate channels"), 1)], width)
        rows = {"gate_proj": channels, "up_proj": channels}
        cols = {"down_proj": channels}
    if proj in rows:
        ranges, full = rows[proj]
        return Part(0, tuple(ranges), full)
    if proj in cols and param != "weight_scale":  # a row-parallel layer keeps every output channel's scale
        ranges, full = cols[proj]
        return Part(1, tuple(ranges), full)
    return None


def quantize_row_slice(x: torch.Tensor, parallel: Parallel) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K_r], this rank's columns of rows spread over the ranks -> (int8 [M, K_r], scales fp32 [M, 1]):
    each row quantized with the scale of the whole row, as one device would (CONTRACT.md's per-token scheme)."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    parallel.all_reduce(amax, dist.ReduceOp.MAX)
    scale = scale_from_amax_reference(amax)
    return quantize_with_scale_reference(x, scale), scale


def row_parallel(layer: Linear | W8A8Linear, x: torch.Tensor, parallel: Parallel, reduce: bool = True
                 ) -> torch.Tensor:
    """A row-parallel layer: x [..., K_r] (this rank's input columns) through this rank's weight columns, the
    ranks' partial outputs summed (reduce=False: this rank's partial sum, for the caller to add up with more).
    W8A8: quantized with whole-row scales, the partial sums rescaled in fp32. Returns x's dtype."""
    if not parallel.active:
        return layer(x)
    if isinstance(layer, W8A8Linear):
        lead = x.shape[:-1]
        values, scales = quantize_row_slice(x.reshape(-1, x.shape[-1]), parallel)
        y = int8_matmul_rescale(values, scales, layer.weight, layer.weight_scale, torch.float32)
        y = y.view(*lead, -1)
    else:
        y = layer(x)
    if reduce:
        parallel.all_reduce(y)
    return y.to(x.dtype)
