"""The runtime against transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM on the same BF16 tiny
checkpoints, in float32, all four layouts (dense / MoE, multimodal / text names, fused / per-expert MTP).

Tolerances: end to end, every logit within 1e-4 (absolute, float32; the tiny checkpoints have logits of
order 1-10, as trained models do), except at positions where transformers itself is not that stable:
there one float32 ulp on its input embeddings moves its own logits by up to ~2e-4 (a GatedDeltaNet output
row far below the gated RMSNorm's sqrt(eps) is scaled up, or a router's top-k scores nearly tie). Each
position's bound is max(1e-4, NOISE_FACTOR x that movement), measured in the test. Layer by layer, given
transformers' input to each layer, the runtime's output agrees to LAYER_ATOL. A real error
(a transposed state, a wrong norm, a mis-committed cache) is orders of magnitude larger.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from npuport.fixtures.tiny_checkpoint import TinySpec, make_tiny
from npuport.runtime.generate import forward_logits
from npuport.runtime.loader import load_model
from npuport.runtime.prefill import pad_prompts, prefill
from npuport.runtime.state import commit_accepted

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

KINDS = ["dense-multimodal", "dense-text", "moe-multimodal-fused", "moe-text-per-expert"]
SPEC_ATOL = 1e-4
NOISE_FACTOR = 8.0
LAYER_ATOL = 2e-5
PROMPTS = [[31, 7, 1500, 42, 9], list(range(200, 217)), [1000, 3, 77, 640, 12, 18, 901, 5, 33, 2047, 64]]
DECODE_STEPS = 10


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tiny_checkpoints):
    path = tiny_checkpoints[request.param]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return load_model(path, "cpu", torch.float32), reference


def reference_logits_and_bound(reference, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits [L, V] for seq, and the per-position bound [L]: max(1e-4, NOISE_FACTOR x how far
    its logits move when every input embedding moves by one float32 ulp, over three random sign patterns)."""
    embeds = reference.get_input_embeddings()(torch.tensor([seq]))
    logits = reference(inputs_embeds=embeds).logits[0]
    gen = torch.Generator().manual_seed(0)
    movement = torch.zeros(len(seq))
    for _ in range(3):
        signs = torch.randint(0, 2, embeds.shape, generator=gen) * 2 - 1
        nudged = reference(inputs_embeds=embeds * (1 + 2.0**-23 * signs)).logits[0]
        movement = torch.maximum(movement, (nudged - logits).abs().amax(-1))
    return logits, (NOISE_FACTOR * movement).clamp_min(SPEC_ATOL)


@torch.no_grad()
def test_logits_match_transformers_at_prefill_and_every_decode_step(pair):
    """A batch of three prompts of different lengths: prefill, then greedy decode steps."""
    model, reference = pair
    tokens, lengths = pad_prompts(PROMPTS, model.device)
    state = model.new_state(len(PROMPTS), tokens.shape[1] + DECODE_STEPS)
    prefill_logits = model.logits(prefill(model, state, tokens, lengths))
    nxt = prefill_logits[torch.arange(len(PROMPTS)), lengths - 1].argmax(-1)
    decoded, step_logits = [], []
    for _ in range(DECODE_STEPS):
        decoded.append(nxt)
        logits = model.logits(model.step(nxt[:, None], state))[:, 0]
        commit_accepted(state, torch.ones_like(lengths), 1)
        step_logits.append(logits)
        nxt = logits.argmax(-1)
    for row, prompt in enumerate(PROMPTS):
        want, bound = reference_logits_and_bound(reference, prompt + [int(d[row]) for d in decoded])
        got = torch.cat([prefill_logits[row, : len(prompt)], torch.stack([lg[row] for lg in step_logits])])
        error = (got - want).abs().amax(-1)
        assert (error <= bound).all(), f"request {row}: error {error.tolist()} bound {bound.tolist()}"


@torch.no_grad()
def test_each_layer_matches_transformers_given_the_same_input(pair):
    """Teacher-forced: every layer gets transformers' input to that layer, for a prefill of 9 tokens and then
    6 single-token decode steps, and must give transformers' output (the last one after the final norm)."""
    model, reference = pair
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(3, 2000, (2, 15), generator=gen)
    hidden = reference(seq, output_hidden_states=True).hidden_states  # n + 1 of [2, 15, hidden]
    n = len(model.layers)
    state = model.new_state(2, 15)
    worst = 0.0
    for begin, count, is_prefill in [(0, 9, True)] + [(p, 1, False) for p in range(9, 15)]:
        n_valid = torch.full((2,), count) if is_prefill else None
        step = model.make_step(state.positions, count, n_valid, state.capacity)
        for i, (layer, layer_state) in enumerate(zip(model.layers, state.layers, strict=True)):
            out = sum(layer(hidden[i][:, begin : begin + count], None, layer_state, step))  # MLP output + stream
            if i == n - 1:
                out = model.norm(out)
            worst = max(worst, (out - hidden[i + 1][:, begin : begin + count]).abs().max().item())
        commit_accepted(state, torch.full((2,), count), 0 if is_prefill else count)
    assert worst < LAYER_ATOL


@torch.no_grad()
def test_forward_logits_gives_transformers_hidden_states_convention(pair):
    model, reference = pair
    logits, hidden = forward_logits(model, [PROMPTS[1]])
    want = reference(torch.tensor([PROMPTS[1]]), output_hidden_states=True).hidden_states
    assert len(hidden) == len(want) == len(model.layers) + 1
    assert torch.equal(hidden[0], want[0])
    _, bound = reference_logits_and_bound(reference, PROMPTS[1])
    assert ((logits[0] - reference(torch.tensor([PROMPTS[1]])).logits[0]).abs().amax(-1) <= bound).all()


@torch.no_grad()
def test_tied_embeddings_serve_as_lm_head(tmp_path):
    path = make_tiny(tmp_path / "tied", TinySpec(arch="dense", layout="text", tie_word_embeddings=True))
    model = load_model(path, "cpu", torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.lm_head is None
    logits, _ = forward_logits(model, [PROMPTS[2]])
    want, bound = reference_logits_and_bound(reference, PROMPTS[2])
    assert ((logits[0] - want).abs().amax(-1) <= bound).all()
