"""A model split over 2 ranks (real torch.distributed, gloo, 2 CPU processes): tensor parallelism for attention,
GatedDeltaNet and MLPs, expert parallelism for the routed experts. Logits equal the single-process model's
(float32: 1e-4 relative for BF16-labelled models, where only the order of sums changes; W8A8 artifacts 2e-3, where a
sum's last bit can also move an int8 rounding), greedy MTP == greedy == the single-process greedy tokens, each
rank holds only its part of every split tensor, and in one MTP round the BF16 MTP head's experts receive float
tokens while the target's W8A8 experts receive int8. Bad device counts fail clearly, before anything loads.
A W4A8 artifact split with its experts kept packed, as on CUDA devices, and read by the int4 kernels (Triton's
interpreter): each rank holds the bytes of its experts, its logits are those of the same split on the unpacked int8
experts bit for bit, and the single-process model's within the W8A8 artifacts' 2e-3, its experts receiving int8."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from npuport.devices import distributed_backend
from npuport.errors import NpuportError
from npuport.fixtures.tiny_checkpoint import PRESETS
from npuport.runtime.config import ModelConfig
from npuport.runtime.expert_parallel import recording_dispatch
from npuport.runtime.generate import forward_logits, generate
from npuport.runtime.loader import load_model
from npuport.runtime.parallel import Parallel, local_config, weight_part

WORLD = 2
PROMPTS = [[31, 7, 1500, 42, 9], list(range(200, 217)), [1000, 3, 77, 640, 12]]
NEW_TOKENS = 10
SOURCES = ("dense-text", "moe-multimodal-fused", "moe-text-per-expert")
ARTIFACTS = ("dense-text", "moe-multimodal-fused")
TOLERANCE = {"source": 1e-4, "artifact": 2e-3}
W4A8_PROMPTS = [[31, 7, 1500], [1000, 3, 77]]  # few tokens: the int4 kernels run interpreted


def check_split_model(rank: int, path, origin: str) -> None:
    torch.manual_seed(0)
    parallel = Parallel.from_default_group()
    single = load_model(path, "cpu", torch.float32)
    split = load_model(path, "cpu", torch.float32, parallel)
    assert split.parallel.rank == rank and split.parallel.world == WORLD

    # Each rank holds exactly its part of every split tensor, and all of every replicated one.
    full = dict(single.named_parameters()) | dict(single.named_buffers())
    held = dict(split.named_parameters()) | dict(split.named_buffers())
    split_count = 0
    for name, tensor in held.items():
        part = weight_part(name, single.config, parallel)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj", "_proj_scale")):
            per_rank = full[name].shape[0] // WORLD
            expected = full[name][rank * per_rank:(rank + 1) * per_rank]
        else:
            expected = full[name] if part is None else part.take(full[name])
        split_count += tensor.numel() < full[name].numel()
        assert torch.equal(tensor, expected), name
    assert split_count > 0

    reference_logits, _ = forward_logits(single, PROMPTS)
    logits, _ = forward_logits(split, PROMPTS)
    tol = TOLERANCE[origin]
    torch.testing.assert_close(logits, reference_logits, rtol=tol, atol=tol * reference_logits.abs().max().item())

    greedy = generate(split, PROMPTS, NEW_TOKENS).tokens
    assert generate(split, PROMPTS, NEW_TOKENS, mtp=2).tokens == greedy
    assert greedy == generate(single, PROMPTS, NEW_TOKENS).tokens

    if split.config.is_moe:
        with recording_dispatch() as records:
            generate(split, PROMPTS, 3, mtp=1)
        target = {r.payload for r in records if not r.layer.startswith("mtp.")}
        head = {r.payload for r in records if r.layer.startswith("mtp.")}
        assert head == {torch.float32}  # the MTP head's experts are BF16-labelled: always float dispatch
        assert target == ({torch.int8} if origin == "artifact" else {torch.float32})
        sent = [r.sent_bytes for r in records]
        assert all(b >= 0 for b in sent) and sum(sent) > 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, port: int, models: list[tuple[str, str]]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(distributed_backend(torch.device("cpu")), init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        for path, origin in models:
            check_split_model(rank, path, origin)
    finally:
        dist.destroy_process_group()
    # Every check passed and the group is gone: leave without the interpreter's teardown. Once in four full runs a
    # worker aborted with "terminate called without an active exception" (a C++ thread destroyed still joinable, as
    # at teardown; where it struck was not established). A failed check raised above and still fails the test.
    os._exit(0)


def test_split_models_match_the_single_process_model(tiny_checkpoints, tiny_artifacts):
    models = [(str(tiny_checkpoints[k]), "source") for k in SOURCES]
    models += [(str(tiny_artifacts[k]), "artifact") for k in ARTIFACTS]
    mp.spawn(worker, args=(free_port(), models), nprocs=WORLD, join=True)


def check_split_w4a8(rank: int, path: str) -> None:
    """packed_split_against_unpacked_and_one_process with the MoE experts planned as on a GPU: the Triton kernels
    (interpreted), every other operator its CPU reference."""
    import npuport.kernels.fused_moe.plan as plan_module
    from npuport.kernels.fused_moe import MatvecConfig
    from tests.test_kernels_int4_matvec import experts_as_on_a_gpu

    patch = pytest.MonkeyPatch()
    try:
        experts_as_on_a_gpu(patch)
        # one program a routed pair and launch: tiles as wide as the tiny model's rows and columns
        patch.setattr(plan_module, "matvec_config", lambda pairs, device=None, int4=False: MatvecConfig(64, 64, 128))
        packed_split_against_unpacked_and_one_process(rank, path, patch)
    finally:
        patch.undo()


def packed_split_against_unpacked_and_one_process(rank: int, path: str, patch: pytest.MonkeyPatch) -> None:
    """A W4A8 artifact over two ranks, its experts kept packed as a CUDA rank keeps them (keeps_int4_packed forced
    through `patch`); the same split with them unpacked at load, as a CPU rank keeps them; one process, packed."""
    import npuport.runtime.loader as loader_module
    from npuport.runtime.model import MoE

    parallel = Parallel.from_default_group()
    unpacked = load_model(path, "cpu", torch.float32, parallel)
    patch.setattr(loader_module, "keeps_int4_packed", lambda device: True)
    single, split = load_model(path, "cpu", torch.float32), load_model(path, "cpu", torch.float32, parallel)
    moe = [(a.mlp.experts, b.mlp.experts, c.mlp.experts)
           for a, b, c in zip(split.layers, unpacked.layers, single.layers, strict=True) if isinstance(a.mlp, MoE)]
    assert moe
    for packed, as_int8, whole in moe:
        assert packed.int4 and whole.int4 and not as_int8.int4
        span = slice(rank * len(packed.gate_up_proj), (rank + 1) * len(packed.gate_up_proj))
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_scale", "down_proj_scale"):
            assert torch.equal(getattr(packed, name), getattr(whole, name)[span]), name
        assert torch.equal(packed.stacked().unpacked().gate_up, as_int8.gate_up_proj)
        assert torch.equal(packed.stacked().unpacked().down, as_int8.down_proj)

    with recording_dispatch() as records:
        logits, _ = forward_logits(split, W4A8_PROMPTS)
    assert {r.payload for r in records} == {torch.int8}
    assert torch.equal(logits, forward_logits(unpacked, W4A8_PROMPTS)[0])
    if rank == 0:  # every rank has the gathered logits
        reference, _ = forward_logits(single, W4A8_PROMPTS)
        tol = TOLERANCE["artifact"]
        torch.testing.assert_close(logits, reference, rtol=tol, atol=tol * reference.abs().max().item())


def w4a8_worker(rank: int, port: int, path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(distributed_backend(torch.device("cpu")), init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        check_split_w4a8(rank, path)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as worker() leaves, for the same reason


def test_a_split_w4a8_model_reads_its_experts_as_int4_and_matches_one_process(w4a8_artifact):
    pytest.importorskip("triton")
    mp.spawn(w4a8_worker, args=(free_port(), str(w4a8_artifact)), nprocs=WORLD, join=True)


def test_w4a8_experts_stay_packed_on_every_cuda_device_and_are_unpacked_elsewhere():
    """The loader's choice follows the device alone: one CUDA device or each rank of a split, where the int4 kernels
    read a rank's experts as one device's; a CPU or an NPU rank unpacks them as one CPU or NPU does."""
    from types import SimpleNamespace

    from npuport.runtime.loader import keeps_int4_packed

    assert all(keeps_int4_packed(torch.device(d)) for d in ("cuda", "cuda:0", "cuda:1"))
    assert not keeps_int4_packed(torch.device("cpu"))
    assert not keeps_int4_packed(SimpleNamespace(type="npu", index=1))  # what devices.py reads of an NPU device


def tiny_config(**sizes) -> ModelConfig:
    s = PRESETS["tiny"]
    fields = {f: getattr(s, f) for f in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                        "linear_value_head_dim", "vocab_size")}
    fields.update(num_hidden_layers=4, layer_types=("linear_attention",) * 3 + ("full_attention",),
                  rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1e7, partial_rotary_factor=0.25,
                  linear_conv_kernel_dim=4, intermediate_size=192, num_experts=0, num_experts_per_tok=0,
                  moe_intermediate_size=0, shared_expert_intermediate_size=0, mtp_num_hidden_layers=1)
    fields.update(sizes)
    return ModelConfig(**fields)


@pytest.mark.parametrize(("world", "sizes", "message"), [
    (3, {}, "3 devices do not divide the 4 attention heads"),
    (2, {"linear_num_key_heads": 3, "linear_num_value_heads": 6}, "2 devices do not divide the 3 GatedDeltaNet key"),
    (4, {"num_key_value_heads": 3, "num_attention_heads": 12}, "4 devices are not a multiple of the 3 key-value"),
    (2, {"intermediate_size": 191}, "2 devices do not divide the 191 MLP intermediate channels"),
])
def test_device_counts_that_do_not_split_the_model_are_refused(world, sizes, message):
    with pytest.raises(NpuportError, match=message):
        local_config(tiny_config(**sizes), Parallel(0, world))


def test_fewer_key_value_heads_than_ranks_are_shared():
    config = tiny_config(num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=4,
                         linear_num_value_heads=8, intermediate_size=192)
    heads = [Parallel(r, 4).kv_heads(2, 8) for r in range(4)]
    assert heads == [slice(0, 1), slice(0, 1), slice(1, 2), slice(1, 2)]
    assert local_config(config, Parallel(3, 4)).num_key_value_heads == 1
    # rank 3's query heads 6, 7 read kv head 1 (query group of 4): rows of k_proj for that head
    assert weight_part("layers.3.self_attn.k_proj.weight", config, Parallel(3, 4)).ranges == ((32, 64),)


def test_token_rows_cover_every_token_once():
    for m in range(0, 7):
        rows = [Parallel(r, 3).token_rows(m) for r in range(3)]
        assert [i for s in rows for i in range(m)[s]] == list(range(m))
