"""Expert parallelism over real torch.distributed (gloo, 2 processes on CPU): each rank's routed-expert output
equals the single-process reference on all experts (float32, the shares' sum order aside: 1e-5 relative), with the
routed-only exchange and with the whole-slice one (every rank's count known, no count exchange);
int8 dispatch puts int8 values and fp32 scales on the wire, exactly the per-token quantization of the sender's
tokens; bad setups fail with a clear error. W4A8 experts: a rank's share of packed int4 experts is int4 views of the
layer's bytes whose values are its slice of the unpacked layer, and with the ranks running them as a GPU does (the
int4 matvec kernels, or the grouped GEMMs unpacking them per call: Triton's interpreter here) the exchange gives the
bits of the same ranks on the unpacked int8 experts and the single-process result within the same 1e-5."""

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
from npuport.fixtures.int4_experts import packed_int4_experts
from npuport.kernels.fused_moe import (
    GROUPED,
    MATVEC,
    StackedExperts,
    fused_experts,
    fused_experts_reference,
    route_top_k_reference,
)
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


def int4_layer_experts() -> StackedExperts:
    """layer_experts' float weights as W4A8 experts, packed as the loader keeps them for the int4 kernels: per-row
    scales max|w| / 7, values rounded into [-8, 7], row pairs packed into bytes by convert/w4a8.py's pack_int4 -
    gate's rows and up's each on their own, as their checkpoint tensors are. gate_up int8 [E, I, H], down [E, H/2,
    I], scales fp32 [E, 2I] and [E, H]."""
    weights = layer_experts(False)

    def values_and_scales(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [E, N, K] -> [E, N, K], [E, N]
        scale = w.abs().amax(-1) / 7
        return torch.clamp(torch.round(w / scale[..., None]), -8, 7).to(torch.int8), scale

    (gate_up, gate_up_scale), (down, down_scale) = map(values_and_scales, (weights.gate_up, weights.down))
    return packed_int4_experts(gate_up, down, gate_up_scale, down_scale)


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


# (path, tokens per rank, int8 dispatch, counts known): decode-sized calls on the int4 matvec kernels - int8 tokens
# in whole slices, float tokens routed only, a rank without tokens - and a prefill-like one on the grouped GEMMs;
# few tokens: the kernels run interpreted
INT4_CASES = [(MATVEC, {0: 3, 1: 2}, True, True), (MATVEC, {0: 3, 1: 2}, False, False),
              (MATVEC, {0: 3, 1: 0}, True, False), (GROUPED, TOKENS, True, False)]


def int4_worker(rank: int, port: int) -> None:
    """Each rank holds its share of the packed int4 experts and runs them as a GPU would (INT4_CASES), against
    the same ranks on the unpacked int8 experts and one process on all of them, the plans alike."""
    import npuport.kernels.fused_moe.plan as plan_module
    from tests.test_kernels_int4_matvec import experts_as_on_a_gpu

    dist.init_process_group(distributed_backend(torch.device("cpu")), init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    patch = pytest.MonkeyPatch()
    try:
        experts_as_on_a_gpu(patch)
        plan_triton, paths = plan_module.plan_experts_triton, []

        def recorded_plan(*args, **kwargs):
            plan = plan_triton(*args, **kwargs)
            paths.append(plan.path)
            return plan

        patch.setattr(plan_module, "plan_experts_triton", recorded_plan)
        shard = ExpertShard(E, WORLD)
        packed = int4_layer_experts()
        local, local_int8 = shard.local(packed, rank), shard.local(packed.unpacked(), rank)
        assert local.int4 and not local_int8.int4
        for path, tokens, int8, counted in INT4_CASES:
            limit = 0 if path == GROUPED else 10**6
            patch.setattr(plan_module, "INT4_MATVEC_PAIRS_PER_EXPERT", limit)
            patch.setattr(plan_module, "MATVEC_MAX_PAIRS", limit)
            x, weights, ids = rank_tokens(rank, tokens[rank])
            known = [tokens[0], tokens[1]] if counted else None
            got = expert_parallel_experts(x, weights, ids, local, shard, int8, counts=known)
            assert torch.equal(got, expert_parallel_experts(x, weights, ids, local_int8, shard, int8, counts=known))
            if len(x):
                torch.testing.assert_close(got, fused_experts(x, packed, weights, ids), rtol=1e-5, atol=1e-6)
            assert set(paths) == {path}
            paths.clear()
    finally:
        patch.undo()
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_give_the_single_process_result_and_int8_travels_as_int8():
    mp.spawn(worker, args=(free_port(),), nprocs=WORLD, join=True)


def test_int4_experts_over_two_ranks_read_as_int4_give_the_int8_bits_and_the_single_process_result():
    pytest.importorskip("triton")
    mp.spawn(int4_worker, args=(free_port(),), nprocs=WORLD, join=True)


def test_a_rank_holds_its_slice_of_int4_experts_packed():
    """ExpertShard.local keeps what StackedExperts carries: packed int4 experts stay int4, as views of the layer's
    bytes (no copy), and their unpacked values and scales are rank's slice of the layer's unpacked experts (a byte
    pairs two rows of one expert); int8 and BF16 experts keep their kind."""
    packed = int4_layer_experts()
    whole = packed.unpacked()
    shard = ExpertShard(E, WORLD)
    for rank in range(WORLD):
        span = slice(shard.ids(rank).start, shard.ids(rank).stop)
        local = shard.local(packed, rank)
        assert local.int4 and (local.num_experts, local.hidden, local.intermediate) == (shard.per_rank, H, INTER)
        assert local.gate_up.data_ptr() == packed.gate_up[span].data_ptr()
        assert local.down.data_ptr() == packed.down[span].data_ptr()
        unpacked = local.unpacked()
        for name in ("gate_up", "down", "gate_up_scale", "down_scale"):
            assert torch.equal(getattr(unpacked, name), getattr(whole, name)[span]), name
    for quantized in (False, True):
        local = shard.local(layer_experts(quantized), 1)
        assert not local.int4 and local.quantized == quantized and local.num_experts == shard.per_rank
    with pytest.raises(ValueError, match="a shard of 8 experts given a layer of 4"):
        shard.local(shard.local(packed, 0), 0)


@pytest.mark.parametrize(("experts", "world", "message"), [
    (2, 3, "3 ranks for 2 experts"), (8, 3, "8 experts do not split evenly over 3 ranks")])
def test_bad_expert_splits_are_refused_clearly(experts, world, message):
    with pytest.raises(NpuportError, match=message):
        ExpertShard(experts, world)


def test_the_backend_follows_the_device():
    assert [distributed_backend(torch.device(d)) for d in ("cpu", "cuda")] == ["gloo", "nccl"]
