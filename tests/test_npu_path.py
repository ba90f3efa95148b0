"""The NPU path of the whole model, checked on the CPU: inside standing_in_for_npu() every operator takes what an
Ascend NPU takes - CANN's operators where torch-npu has one whose documented constraints the call meets, played by
the stand-ins of kernels/npu/standins.py - and the model must give the reference path's logits and greedy tokens,
with MTP k = 0..3, for a dense BF16 source (float32), a MoE W8A8 artifact and a model split over 2 gloo ranks.

The W8A8 artifact runs in float64: the chunked GDN operator sums in another order than npuport's chunked kernel, and
in float32 a last-bit difference in front of a W8A8 layer moves an int8 rounding now and then, which moved logits by
1e-2 where a tiny random model's top two were 2e-3 apart (measured): a different token, for no fault of the wiring.

The models have GatedDeltaNet head dims of 128 (as every Qwen3.5) and prefill in chunks of 8 tokens, so that the
chunked GDN operator (documented for 8 tokens a sequence, head dims 128) takes the prefill; decode steps take the
static shapes a graph-captured NPU step takes (whole caches: the KV write and decode attention kernels). The MoE
experts and routing go through kernels/npu/moe.py by a patch of this test's own, until the runtime's MoE wires them.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import replace
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import npuport.runtime.expert_parallel
import npuport.runtime.model
from npuport.convert.recipe import recipe_path_for
from npuport.devices import distributed_backend
from npuport.fixtures.tiny_checkpoint import PRESETS, TinySpec, make_tiny
from npuport.kernels.implementations import standing_in_for_npu
from npuport.kernels.npu.operators import recording_calls
from npuport.runtime.generate import generate
from npuport.runtime.loader import load_model
from npuport.runtime.parallel import Parallel
from npuport.runtime.prefill import pad_prompts, prefill
from npuport.runtime.state import commit_accepted

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

PRESET = "npu-widths"  # the tiny preset with Qwen3.5's GDN head dims
PROMPTS = [[31, 7, 1500, 42, 9], list(range(200, 217)), [1000, 3, 77, 640, 12, 18, 901, 5, 33, 2047, 64]]
NEW_TOKENS = 8
PREFILL_CHUNK = 8  # npu_chunk_gated_delta_rule: up to 8 tokens a sequence
DECODE_STEPS = 3
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}
# Every operator a model of each kind must reach on its NPU path (the conv's documented width 3 is not Qwen3.5's).
REACHED = {"npu_gemma_rms_norm", "npu_rotary_mul", "npu_fused_infer_attention_score",
           "npu_recurrent_gated_delta_rule", "npu_chunk_gated_delta_rule"}
REACHED_MOE_W8A8 = REACHED | {"npu_dynamic_quant", "npu_quant_matmul", "npu_moe_gating_top_k_softmax",
                              "npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_moe_finalize_routing"}


@pytest.fixture(scope="module")
def npu_models(tmp_path_factory) -> dict[str, str]:
    """kind -> path: a dense BF16 source and a W8A8 artifact converted from a MoE source, both of the tiny preset with
    GatedDeltaNet head dims of 128."""
    from npuport.convert.converter import convert_qwen35

    root = tmp_path_factory.mktemp("npu_widths")
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(PRESETS, PRESET, replace(PRESETS["tiny"], linear_key_head_dim=128, linear_value_head_dim=128))
        dense = make_tiny(root / "dense", TinySpec(arch="dense", layout="text", size=PRESET))
        moe = make_tiny(root / "moe", TinySpec(arch="moe", layout="text", mtp_experts="per-expert", size=PRESET))
    artifact = convert_qwen35(moe, root / "moe-w8a8", show_progress=False, log=lambda _: None).out
    qwen36 = convert_qwen35(dense, root / "dense-w8a8-qwen36", recipe_path=recipe_path_for("qwen3_6_27b_w8a8"),
                            show_progress=False, log=lambda _: None).out
    return {"dense": str(dense), "moe-w8a8": str(artifact), "dense-w8a8-qwen36": str(qwen36)}


@contextlib.contextmanager
def npu_wiring():
    """Decode steps with the static shapes of an NPU's captured steps (the CPU captures none)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(npuport.runtime.model, "graphs_supported", lambda device: True)
        yield


def stepped_logits(model, follow: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced: logits [B, T, V] of the PROMPTS' prefill (in chunks of PREFILL_CHUNK) and [B, n, V] of the
    decode steps that feed follow[b] (n tokens each) after it."""
    tokens, lengths = pad_prompts(PROMPTS, model.device)
    state = model.new_state(len(PROMPTS), tokens.shape[1] + len(follow[0]))
    prefill_logits = model.logits(prefill(model, state, tokens, lengths, chunk_size=PREFILL_CHUNK))
    steps = []
    for j in range(len(follow[0])):
        hidden = model.step(torch.tensor([f[j] for f in follow])[:, None], state)
        commit_accepted(state, torch.ones_like(lengths), 1)
        steps.append(model.logits(hidden))
    return prefill_logits, torch.cat(steps, dim=1)


def assert_npu_path_equals_reference(model, reached: set[str]) -> list:
    """Greedy tokens (MTP k = 0..3 on the NPU path against plain greedy on the reference path) and teacher-forced
    logits of both paths; the NPU path must have reached every operator in `reached`. Returns the operator calls."""
    greedy = generate(model, PROMPTS, NEW_TOKENS, prefill_chunk=PREFILL_CHUNK).tokens
    want_prefill, want_steps = stepped_logits(model, [g[:DECODE_STEPS] for g in greedy])
    with standing_in_for_npu(), recording_calls() as calls:
        for k in range(4):
            assert generate(model, PROMPTS, NEW_TOKENS, mtp=k, prefill_chunk=PREFILL_CHUNK).tokens == greedy, k
        got_prefill, got_steps = stepped_logits(model, [g[:DECODE_STEPS] for g in greedy])
    assert reached <= {call.name for call in calls}
    tol = TOLERANCE[model.dtype]
    real = torch.arange(want_prefill.shape[1])[None, :] < torch.tensor([len(p) for p in PROMPTS])[:, None]
    for got, want in ((got_prefill[real], want_prefill[real]), (got_steps, want_steps)):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    return calls


@pytest.mark.parametrize(("kind", "dtype", "reached"), [("dense", torch.float32, REACHED),
                                                       ("moe-w8a8", torch.float64, REACHED_MOE_W8A8)])
def test_the_npu_path_gives_the_reference_paths_tokens_and_logits(npu_models, kind, dtype, reached):
    model = load_model(npu_models[kind], "cpu", dtype)
    with npu_wiring():
        assert_npu_path_equals_reference(model, reached)


def test_quantized_gdn_input_projections_take_the_npu_quant_matmul(npu_models):
    """msModelSlim's Qwen3.6 recipe quantizes in_proj_qkv and in_proj_z: on the NPU path their one stacked int8
    GEMM goes through npu_quant_matmul (its output width theirs together), with the reference path's tokens."""
    model = load_model(npu_models["dense-w8a8-qwen36"], "cpu", torch.float64)
    gdn = next(layer.linear_attn for layer in model.layers if hasattr(layer, "linear_attn"))
    width = gdn.in_proj_qkv.out_features + gdn.in_proj_z.out_features
    with npu_wiring():
        calls = assert_npu_path_equals_reference(model, REACHED | {"npu_dynamic_quant", "npu_quant_matmul"})
    widths = {call.args[1].shape[-1] for call in calls if call.name == "npu_quant_matmul"}
    assert width in widths, (width, widths)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_worker(rank: int, port: int, models: list[tuple[str, torch.dtype, set[str]]]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(distributed_backend(torch.device("cpu")), init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=2, timeout=timedelta(seconds=120))
    try:
        for path, dtype, reached in models:
            split = load_model(path, "cpu", dtype, Parallel.from_default_group())
            assert split.parallel.world == 2
            with npu_wiring():
                assert_npu_path_equals_reference(split, reached)
    finally:
        dist.destroy_process_group()


def test_the_npu_path_of_a_model_split_over_two_ranks_gives_the_reference_paths(npu_models):
    mp.spawn(split_worker, args=(free_port(), [(npu_models["moe-w8a8"], torch.float64, REACHED_MOE_W8A8)]),
             nprocs=2, join=True)
