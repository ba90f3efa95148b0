"""Expert parallelism over real torch.distributed (gloo, 2 processes on CPU): each rank's routed-expert output
equals the single-process reference on all experts (float32, the shares' sum order aside: 1e-5 relative), with the
routed-only exchange and with the whole-slice one (every rank's count known, no count exchange);
int8 dispatch puts int8 values and fp32 scales on the wire, exactly the per-token quantization of the sender's
tokens; bad setups fail with a clear error."""

from __future__ import annotations

import socket
from datetime import timedelta
from itertools import product

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from npuport.convert.quantize import quantize_per_channel_int8
from npuport.devices import distributed_backend
from npuport.errors import NpuportError
from npuport.kernels.fused_moe import StackedExperts, fused_experts_reference, route_top_k_reference
from npuport.kernels.w8a8.naive import quantize_per_token_int8_reference
from npuport.runtime.expert_parallel import DispatchRecord, ExpertShard, expert_parallel_experts

E, H, INTER, TOP_K, WORLD = 8, 32, 16, 3, 2
TOKENS = {0: 6, 1: 3}  # per rank: ranks route different numbers of tokens


def layer_experts(quantized: bool) -> StackedExperts:
    gen = torch.Generator().manual_seed(7)
    gate_up, down = torch.randn(E, 2 * INTER, H, generator=gen) / 4, torch.randn(E, H, INTER, generator=gen) / 4
    if not quantized:
        return StackedExperts(gate_up, down)
    q = [[quantize_per_channel_int8(w[e].bfloat16()) for e in range(E)] for w in (gate_up, down)]
    return StackedExperts(*(torch.stack([t[0] for t in per]) for per in q),
                          *(torch.stack([t[1][:, 0] for t in per]) for per in q))


def rank_tokens(rank: int, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank `rank`'s tokens [m, H] and their routing: the same on every process."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(m, H, generator=gen)
    return (x, *route_top_k_reference(torch.randn(m, E, generator=gen), TOP_K, x.dtype))


def worker(rank: int, port: int) -> None:
    dist.init_process_group(distributed_backend(torch.device("cpu")), init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        shard = ExpertShard(E, WORLD)
        for tokens in (TOKENS, {0: 4, 1: 0}):  # a rank without tokens still serves the others
            x, weights, ids = rank_tokens(rank, tokens[rank])
            # counts unknown: a token goes where its experts are; known (few tokens): every token to every rank
            for (quantized, int8), counts in product(((False, False), (True, False), (True, True)),
                                                   (None, [tokens[0], tokens[1]])):
                experts = layer_experts(quantized)
                record = DispatchRecord()
                got = expert_parallel_experts(x, weights, ids, shard.local(experts, rank), shard, int8,
                                              record=record, counts=counts)
                torch.testing.assert_close(got, fused_experts_reference(x, experts, weights, ids),
                                           rtol=1e-5, atol=1e-6)
                other = 1 - rank
                to_other = (ids // shard.per_rank == other).any(1) | (counts is not None)
                per_token = H + 4 if int8 else H * x.element_size()  # int8 values + an fp32 scale, or the floats
                assert record.sent_bytes == int(to_other.sum()) * per_token
                x_o, _, ids_o = rank_tokens(other, tokens[other])
                from_other = (ids_o // shard.per_rank == rank).any(1) | (counts is not None)
                arrived = record.received[other]
                if int8:  # on the wire: int8, exactly the sender's per-token quantization of those tokens
                    assert arrived.dtype == torch.int8
                    assert torch.equal(arrived, quantize_per_token_int8_reference(x_o)[0][from_other])
                else:
                    assert arrived.dtype == torch.float32 and torch.equal(arrived, x_o[from_other])
        with pytest.raises(NpuportError, match="int8 dispatch into BF16 experts"):
            expert_parallel_experts(x, weights, ids, shard.local(layer_experts(False), rank), shard, True)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_give_the_single_process_result_and_int8_travels_as_int8():
    mp.spawn(worker, args=(free_port(),), nprocs=WORLD, join=True)


@pytest.mark.parametrize(("experts", "world", "message"), [
    (2, 3, "3 ranks for 2 experts"), (8, 3, "8 experts do not split evenly over 3 ranks")])
def test_bad_expert_splits_are_refused_clearly(experts, world, message):
    with pytest.raises(NpuportError, match=message):
        ExpertShard(experts, world)


def test_the_backend_follows_the_device():
    assert [distributed_backend(torch.device(d)) for d in ("cpu", "cuda")] == ["gloo", "nccl"]
