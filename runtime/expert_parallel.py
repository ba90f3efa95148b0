"""Expert parallelism for one MoE layer over torch.distributed: the experts split across the ranks of a process
group in equal contiguous ranges, each rank routing its own tokens, sending each token once to every rank that
holds one of its experts - BF16, or int8 values with per-token fp32 scales, as `runtime/dispatch.py` says for the
layer - and summing the partial outputs that come back (all-to-all both ways, as sglang's DeepEP path does).

With the token counts of every rank known (`counts`, as a split model knows them) and few tokens in all or a graph
being captured (decode and verify steps), each rank sends its whole slice to every rank - no count exchange, no host
synchronisation, shapes fixed by the counts, so a step can be captured as a graph with its collectives; a token's
slots held elsewhere ride along with weight 0 on an expert its receiver already reads. Otherwise (prefill) each rank
sends a token only where one of its experts is, after exchanging the counts (a host synchronisation). One
all-to-all carries the tokens and their routing, one brings the experts' shares back.
`recording_dispatch()` collects what each MoE layer put on the wire.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace

import torch
import torch.distributed as dist

from npuport.devices import capturing_graph
from npuport.errors import NpuportError
from npuport.kernels.fused_moe import StackedExperts, fused_experts
from npuport.kernels.fused_moe.naive import wide_dtype
from npuport.kernels.w8a8 import quantize_per_token_int8

# Calls of up to this many tokens over all ranks, and every call being captured as a graph, send every token to
# every rank. The cost is the weight-0 slots (an expert already read: for few tokens little more than the
# arithmetic, for a prefill twice each rank's expert work) and M x hidden bytes per rank on the wire; what it buys
# is no count exchange, so no host synchronisation.
WHOLE_SLICE_TOKENS = 128


@dataclass(frozen=True)
class ExpertShard:
    """Which experts of a layer's num_experts each of `world` ranks holds: rank r the contiguous range
    [r * per_rank, (r + 1) * per_rank)."""

    num_experts: int
    world: int

    def __post_init__(self) -> None:
        if self.world > self.num_experts:
            raise NpuportError(f"{self.world} ranks for {self.num_experts} experts: every rank needs at least one "
                               "expert; use at most as many devices as the model has experts per layer")
        if self.num_experts % self.world:
            raise NpuportError(f"{self.num_experts} experts do not split evenly over {self.world} ranks; use a "
                               "device count that divides the expert count")

    @property
    def per_rank(self) -> int:
        return self.num_experts // self.world

    def ids(self, rank: int) -> range:
        """The layer's expert numbers that rank holds."""
        return range(rank * self.per_rank, (rank + 1) * self.per_rank)

    def local(self, experts: StackedExperts, rank: int) -> StackedExperts:
        """rank's experts out of all of a layer's num_experts (views, no copy): every tensor StackedExperts
        carries - weights [E, ...], scales [E, rows] - cut to rank's [per_rank, ...] along its expert dimension,
        every other field (int4) kept. Packed int4 experts cut the same way: a byte pairs two rows of one expert,
        never rows of two."""
        if experts.num_experts != self.num_experts:
            raise ValueError(f"a shard of {self.num_experts} experts given a layer of {experts.num_experts}")
        ids = self.ids(rank)
        span = slice(ids.start, ids.stop)
        return replace(experts, **{f.name: value[span] for f in fields(experts)
                                   if isinstance(value := getattr(experts, f.name), torch.Tensor)})


@dataclass
class DispatchRecord:
    """What the dispatch of one call put on the wire towards other ranks, and what this rank received."""

    layer: str = ""
    tokens: int = 0  # this rank's tokens in the call
    payload: torch.dtype | None = None  # what the token values travelled as: int8, or the activations' dtype
    sent_bytes: int = 0  # token payload (values and scales) sent to the other ranks
    received: list[torch.Tensor] = field(default_factory=list)  # the token values that arrived, one per rank


_records: contextvars.ContextVar[list[DispatchRecord] | None] = contextvars.ContextVar("npuport_dispatch_records",
                                                                                       default=None)


@contextmanager
def recording_dispatch() -> Iterator[list[DispatchRecord]]:
    """Inside the block (this thread / task), every expert-parallel MoE call appends its DispatchRecord to the
    list yielded, in call order."""
    token = _records.set([])
    try:
        yield _records.get()
    finally:
        _records.reset(token)


def traffic_record(layer: str) -> DispatchRecord | None:
    """A new record for a call of MoE layer `layer`, kept in the recording_dispatch() list; None outside one."""
    records = _records.get()
    if records is None:
        return None
    records.append(DispatchRecord(layer))
    return records[-1]


def expert_parallel_experts(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                            local: StackedExperts, shard: ExpertShard, int8: bool,
                            group: dist.ProcessGroup | None = None, record: DispatchRecord | None = None,
                            counts: list[int] | None = None) -> torch.Tensor:
    """This rank's tokens x [M, H] (M may differ between ranks, even be 0), routed: weights [M, top_k] in x's
    dtype and expert_ids [M, top_k] over all of the layer's experts; local: this rank's experts
    (ExpertShard.local). Returns [M, H] in x's dtype: each token's weighted sum over its experts, each rank
    holding some of them adding its share (rounded to x's dtype), the shares summed in rank order in fp32 and
    rounded once. int8: the tokens travel as int8 values and per-token fp32 scales (W8A8 experts only).
    counts: every rank's M, when the caller knows them; with at most WHOLE_SLICE_TOKENS in all, or in a graph
    capture, the exchange then needs no count exchange and no host synchronisation (each rank's whole slice goes
    to every rank)."""
    if int8 and not local.quantized:
        raise NpuportError("int8 dispatch into BF16 experts: they cannot take int8 tokens")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    hidden, top_k = x.shape[1], expert_ids.shape[1]
    owner = expert_ids // shard.per_rank  # [M, top_k]
    tokens = quantize_per_token_int8(x) if int8 else None
    whole = counts is not None and (sum(counts) <= WHOLE_SLICE_TOKENS or capturing_graph(x.device))
    sends = []  # per rank: (rows, message: the token payload's bytes, then the routing's)
    for r in range(world):
        rows = torch.arange(len(x), device=x.device) if whole else (owner == r).any(1).nonzero().squeeze(1)
        on_r = owner[rows] == r
        # slots held elsewhere get weight 0 on the token's first expert here (or expert 0): nothing more to read
        first_here = (expert_ids[rows] - r * shard.per_rank).gather(1, on_r.int().argmax(1, keepdim=True))
        fallback = torch.where(on_r.any(1, keepdim=True), first_here, 0)
        ids = torch.where(on_r, expert_ids[rows] - r * shard.per_rank, fallback)
        # int8 values with each token's fp32 scale as 4 more bytes, or the float tokens
        payload = torch.cat([tokens[0][rows], tokens[1][rows].view(torch.int8)], 1) if int8 else x[rows]
        # the expert ids (int32) bit for bit in fp32 lanes beside the weights
        routing = torch.cat([ids.int().view(torch.float32), torch.where(on_r, weights[rows], 0).float()], 1)
        sends.append((rows, torch.cat([payload.view(torch.uint8), routing.view(torch.uint8)], 1)))
    payload_bytes = sends[0][1].shape[1] - 2 * top_k * 4  # per token
    if whole:
        n_in = list(counts)
    else:  # the counts go first: a host synchronisation
        got_counts = _exchange([torch.tensor([len(s[0])], device=x.device) for s in sends],
                               [torch.zeros(1, dtype=torch.long, device=x.device) for _ in range(world)], group)
        n_in = [int(c) for c in got_counts]
    # one all-to-all carries the tokens and their routing
    got = _exchange([s[1] for s in sends], [sends[0][1].new_empty((n, sends[0][1].shape[1])) for n in n_in], group)

    def payload_of(message: torch.Tensor) -> torch.Tensor:
        return message[:, :payload_bytes].contiguous().view(torch.int8 if int8 else x.dtype)

    if record is not None:
        record.sent_bytes += sum(len(rows) * payload_bytes for r, (rows, _) in enumerate(sends) if r != rank)
        record.received = [payload_of(g)[:, :hidden] for g in got]
        record.payload, record.tokens = record.received[0].dtype, x.shape[0]
    # Every received token through this rank's experts at once; slots held elsewhere carry weight 0.
    arrived = torch.cat(got)
    routing = arrived[:, payload_bytes:].contiguous().view(torch.float32)
    ids = routing[:, :top_k].contiguous().view(torch.int32).long()
    route_weights = routing[:, top_k:].to(x.dtype)
    tokens_in = payload_of(arrived)
    if int8:
        quantized = (tokens_in[:, :hidden].contiguous(), tokens_in[:, hidden:].contiguous().view(torch.float32))
        share = fused_experts(x.new_empty(len(arrived), hidden), local, route_weights, ids, x_int8=quantized)
    else:
        share = fused_experts(tokens_in, local, route_weights, ids)
    back = _exchange(list(share.split(n_in)), [x.new_empty(len(rows), hidden) for rows, _ in sends], group)
    total = torch.zeros(x.shape, dtype=wide_dtype(x.dtype), device=x.device)
    for (rows, _), part in zip(sends, back, strict=True):  # rank order
        total.index_add_(0, rows, part.to(total.dtype))
    return total.to(x.dtype)


def _exchange(send: list[torch.Tensor], receive: list[torch.Tensor], group: dist.ProcessGroup | None
              ) -> list[torch.Tensor]:
    """send[r] goes to rank r, receive[r] (pre-shaped, only its shape matters) comes from rank r, rows of any
    count (one all_to_all_single with split sizes, which gloo, NCCL and HCCL all take); returns what came."""
    out = receive[0].new_empty((sum(len(t) for t in receive), *receive[0].shape[1:]))
    dist.all_to_all_single(out, torch.cat(send), [len(t) for t in receive], [len(t) for t in send], group=group)
    return list(out.split([len(t) for t in receive]))
