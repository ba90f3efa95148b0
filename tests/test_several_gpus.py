"""On two GPUs (skipped elsewhere): models split over them with NCCL through the processes and code paths of `--devices
2` (runtime/several_devices.py), rank 0 driving. In float32 the split model's logits are the single-GPU model's
within 1e-3 relative for BF16-labelled models (L2 over the prompts' rows, short prompts and a prefill long enough to
take the routed-only exchange: the split GEMMs and the all-reduce add in another order, as on CPU; the bound
test_kernels_on_gpu.py holds GPU float32 to) and 5e-3 for W8A8 artifacts (an order's last bit can also move an
activation's int8 rounding), and a BF16-labelled model's greedy tokens are the single-GPU greedy tokens. Steps
captured as CUDA graphs with their collectives (all-reduce, the expert-parallel all-to-all) give the tokens the
eager steps give, and greedy MTP output equals greedy output with graphs, in float32 and bf16; so do serve's prefill
chunks padded into staging graphs (tests/test_continuous_batching.py padded_schedule, MTP k = 1). A W8A8 MoE's target
experts receive int8 over NCCL while the BF16 MTP head's experts receive float tokens, in the same generate call."""

from __future__ import annotations

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

from npuport.runtime.expert_parallel import recording_dispatch  # noqa: E402
from npuport.runtime.generate import forward_logits, generate  # noqa: E402
from npuport.runtime.loader import load_model  # noqa: E402
from npuport.runtime.parallel import Parallel  # noqa: E402
from npuport.runtime.run_options import run_options  # noqa: E402
from npuport.runtime.several_devices import on_devices  # noqa: E402
from tests.test_continuous_batching import padded_schedule, prompts  # noqa: E402

PROMPTS = [[31, 7, 1500, 42, 9], list(range(200, 217)), [1000, 3, 77, 640, 12, 18, 901, 5, 33, 2047, 64]]
# 1,200 tokens: more than expert_parallel.WHOLE_SLICE_TOKENS, so their prefill takes the routed-only exchange
LONG = [list(range(1, 601)), list(range(700, 1300))]
NEW_TOKENS = 32
SLOT_PROMPTS = prompts(4, seed=11, low=20, high=40)
MODELS = {"source": ("dense-text", "moe-text-per-expert"), "artifact": ("dense-text", "moe-multimodal-fused")}
# split vs one GPU, float32; a W8A8 artifact looser: a sum's last bit can move an activation's int8 rounding
TOLERANCE = {"source": 1e-3, "artifact": 5e-3}


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def split_against_one_gpu(path: str) -> dict:
    """On rank 0 of two (the other rank follows every split load and call): what the tests assert on."""
    out: dict = {}
    single = load_model(path, "cuda", torch.float32, Parallel())  # this GPU alone: not mirrored
    split = load_model(path, "cuda", torch.float32)  # split over both ranks
    out["world"] = split.parallel.world
    real = torch.zeros(len(PROMPTS), max(map(len, PROMPTS)), dtype=torch.bool)
    for b, p in enumerate(PROMPTS):
        real[b, : len(p)] = True
    want, got = forward_logits(single, PROMPTS)[0].cpu(), forward_logits(split, PROMPTS)[0].cpu()
    out["logits_rel"] = rel(got[real], want[real])
    out["long_logits_rel"] = rel(forward_logits(split, LONG)[0].cpu(), forward_logits(single, LONG)[0].cpu())
    out["single_greedy"] = generate(single, PROMPTS, NEW_TOKENS, graphs=False).tokens
    del single
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = split if dtype == torch.float32 else load_model(path, "cuda", dtype)
        out[f"{name}_eager"] = generate(model, PROMPTS, NEW_TOKENS, graphs=False).tokens
        out[f"{name}_graphs"] = generate(model, PROMPTS, NEW_TOKENS, graphs=True).tokens
        out[f"{name}_mtp"] = {k: generate(model, PROMPTS, NEW_TOKENS, mtp=k, graphs=True).tokens for k in (1, 3)}
        out[f"{name}_mtp_eager"] = generate(model, PROMPTS, NEW_TOKENS, mtp=2, graphs=False).tokens
        # serve's slots: prefill chunks padded into staging graphs (slots.graph_prefill_shape), their collectives in
        out[f"{name}_slots"] = {graphs: padded_schedule(model, run_options(model, 1, graphs=graphs), SLOT_PROMPTS, 24)
                                for graphs in (False, True)}
    if split.config.is_moe:
        with recording_dispatch() as records:  # eager: a replayed graph runs no Python to record
            generate(split, PROMPTS, 3, mtp=1, graphs=False)
        out["payloads"] = {"target": sorted({str(r.payload) for r in records if not r.layer.startswith("mtp.")}),
                           "head": sorted({str(r.payload) for r in records if r.layer.startswith("mtp.")})}
        out["received"] = sorted({str(t.dtype) for r in records for t in r.received})
    return out


@pytest.mark.parametrize(("origin", "kind"), [(o, k) for o, kinds in MODELS.items() for k in kinds])
def test_a_model_split_over_two_gpus_matches_one_gpu_with_graphs(origin, kind, tiny_checkpoints, tiny_artifacts):
    path = (tiny_checkpoints if origin == "source" else tiny_artifacts)[kind]
    got = on_devices(split_against_one_gpu, (str(path),), 2, "cuda")
    print({k: v for k, v in got.items() if "rel" in k or k in ("payloads", "received")})
    assert got["world"] == 2
    problems = []  # every check of the case, each failure named
    for dtype in ("fp32", "bf16"):
        if got[f"{dtype}_graphs"] != got[f"{dtype}_eager"]:
            problems.append(f"{dtype}: graphs with collectives vs eager")
        problems += [f"{dtype}: greedy MTP k={k} with graphs" for k, tokens in got[f"{dtype}_mtp"].items()
                     if tokens != got[f"{dtype}_eager"]]
        if got[f"{dtype}_mtp_eager"] != got[f"{dtype}_eager"]:
            problems.append(f"{dtype}: greedy MTP k=2 eager")
        if got[f"{dtype}_slots"][True] != got[f"{dtype}_slots"][False]:
            problems.append(f"{dtype}: serve's slots, prefill chunks as graphs vs padded eagerly")
    if "moe" in kind:
        want = ["torch.int8"] if origin == "artifact" else ["torch.float32"]
        if got["payloads"] != {"target": want, "head": ["torch.float32"]} or got["received"] != sorted({*want,
                                                                                                      "torch.float32"}):
            problems.append(f"dispatch payloads {got['payloads']}, received {got['received']}")
    for key in ("logits_rel", "long_logits_rel"):
        if not got[key] < TOLERANCE[origin]:
            problems.append(f"{key} {got[key]:.2e}")
    # A W8A8 artifact's split and single-GPU greedy tokens may part: a sum's last bit, in another order, can move
    # an activation's int8 rounding, and greedy follows (measured: 32 tokens on the GPU, 10 on CPU agree).
    if origin == "source" and got["fp32_eager"] != got["single_greedy"]:
        problems.append("fp32 split greedy vs one GPU")
    assert not problems, problems
