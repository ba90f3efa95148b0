"""Caches and state (float64, where two paths that should agree agree to ~1e-12): chunked prefill and the padded,
sync-free prefill that graphs capture against one pass, and a verify step committed at a accepted drafts against
decoding those tokens one by one."""

from __future__ import annotations

import functools

import pytest
import torch

from npuport.runtime import graphs as graphs_module
from npuport.runtime.graphs import Steps
from npuport.runtime.loader import load_model
from npuport.runtime.prefill import pad_prompts, padded_prefill, prefill, static_prefill_chunk
from npuport.runtime.state import GDNState, KVCache, ModelState, commit_accepted

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

KINDS = ["dense-text", "moe-multimodal-fused"]
PROMPTS = [list(range(100, 113)), [7, 8, 9, 10, 11], list(range(300, 309))]


@pytest.fixture(scope="module", params=KINDS)
def model(request, tiny_checkpoints):
    return load_model(tiny_checkpoints[request.param], "cpu", torch.float64)


def assert_same_state(a: ModelState, b: ModelState, rows_a: list[int], rows_b: list[int],
                      width: int | None = None) -> None:
    """Committed content of rows_a of `a` equals rows_b of `b`: lengths, KV up to each length, current GDN
    states, and the newest `width` conv columns (default: the whole window)."""
    assert a.positions[rows_a].tolist() == b.positions[rows_b].tolist()
    for la, lb in zip(a.layers, b.layers, strict=True):
        for ra, rb in zip(rows_a, rows_b, strict=True):
            if isinstance(la, KVCache):
                n = int(a.positions[ra])
                torch.testing.assert_close(la.k[ra, :n], lb.k[rb, :n], rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(la.v[ra, :n], lb.v[rb, :n], rtol=1e-12, atol=1e-12)
            else:
                assert isinstance(la, GDNState)
                torch.testing.assert_close(la.current()[ra], lb.current()[rb], rtol=1e-10, atol=1e-12)
                w = width or la.conv.shape[-1]
                torch.testing.assert_close(la.conv[ra, :, -w:], lb.conv[rb, :, -w:], rtol=1e-12, atol=1e-12)


@torch.no_grad()
@pytest.mark.parametrize(("padded", "chunk"), [(False, 1), (False, 4), (True, 4), (True, 16)])
def test_chunked_and_padded_prefill_equal_one_pass(model, padded, chunk):
    """Chunks of `chunk` tokens, or (padded) the prefill a GPU captures as a graph: chunks of exactly `chunk`
    tokens (the prompts right-padded with 0 to a multiple of it: 3 padding tokens at 16), whole-cache attention
    and a GDN start replayed over every log slot - the hidden states, the committed state and the next step of
    one plain pass."""
    tokens, lengths = pad_prompts(PROMPTS, model.device)
    one, other = model.new_state(3, 32, spec_tokens=2), model.new_state(3, 32, spec_tokens=2)
    h_one = prefill(model, one, tokens, lengths)
    if padded:
        h_other = padded_prefill(functools.partial(static_prefill_chunk, model), other, tokens, lengths, chunk)
    else:
        h_other = prefill(model, other, tokens, lengths, chunk_size=chunk)
    assert h_other.shape == h_one.shape
    for row, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(h_other[row, :n], h_one[row, :n], rtol=1e-10, atol=1e-10)
    assert_same_state(one, other, [0, 1, 2], [0, 1, 2])
    nxt = torch.tensor([[5], [6], [7]])
    logits = [model.logits(model.step(nxt, s)) for s in (one, other)]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-10, atol=1e-10)


@torch.no_grad()
def test_prefills_padded_for_graphs_equal_the_plain_ones(model, monkeypatch):
    """Steps.prefill and Steps.mtp_prefill as they run where graphs can be captured (here without capturing):
    the prompts and the head's inputs right-padded to 256 positions, static shapes - the target's hidden states,
    the head's logits and output at each last row, and both committed states of the plain prefills."""
    assert model.mtp is not None
    tokens, lengths = pad_prompts(PROMPTS, model.device)
    shifted = tokens.roll(-1, dims=1)
    plain, padded = (Steps(model, model.new_state(3, 512, spec_tokens=2), model.new_mtp_state(3, 512), False)
                     for _ in range(2))
    h_plain = plain.prefill(tokens, lengths, None)
    head_plain = plain.mtp_prefill(shifted, h_plain, lengths, None)
    monkeypatch.setattr(graphs_module, "graphs_supported", lambda device: True)
    h_padded = padded.prefill(tokens, lengths, None)
    head_padded = padded.mtp_prefill(shifted, h_padded, lengths, None)
    for row, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(h_padded[row, :n], h_plain[row, :n], rtol=1e-10, atol=1e-10)
    for got, want in zip(head_padded, head_plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert_same_state(plain.state, padded.state, [0, 1, 2], [0, 1, 2])
    assert_same_state(plain.mtp_state, padded.mtp_state, [0, 1, 2], [0, 1, 2])
    for state_plain, state_padded in ((plain.state, padded.state), (plain.mtp_state, padded.mtp_state)):
        # the padded path ran: its padding rows wrote keys up to position 255, the plain one's up to the prompt's
        cache_plain, cache_padded = (next(x for x in s.layers if isinstance(x, KVCache))
                                     for s in (state_plain, state_padded))
        assert cache_plain.k[:, tokens.shape[1]:].abs().sum() == 0 < cache_padded.k[:, 255].abs().sum()


@torch.no_grad()
@pytest.mark.parametrize("k", [1, 3])
def test_verify_then_commit_equals_decoding_the_kept_tokens(model, k):
    """One batch verifies k + 1 tokens and keeps 1, 2 and k + 1 of them; each request is then compared
    with the same request decoding exactly those tokens one at a time."""
    tokens, lengths = pad_prompts(PROMPTS, model.device)
    verified = model.new_state(3, 40, spec_tokens=k)
    prefill(model, verified, tokens, lengths)
    candidates = torch.randint(3, 1000, (3, k + 1), generator=torch.Generator().manual_seed(k))
    kept = [1, 2, k + 1]
    model.step(candidates, verified)
    commit_accepted(verified, torch.tensor(kept), k + 1)
    for row, prompt in enumerate(PROMPTS):
        decoded = model.new_state(1, 40, spec_tokens=k)
        prefill(model, decoded, torch.tensor([prompt]), torch.tensor([len(prompt)]))
        for j in range(kept[row]):
            model.step(candidates[row : row + 1, j : j + 1], decoded)
            commit_accepted(decoded, torch.ones(1, dtype=torch.long), 1)
        assert_same_state(verified, decoded, [row], [0], width=model.config.linear_conv_kernel_dim - 1)
    nxt = torch.tensor([[5], [6], [7]])
    after_verify = model.logits(model.step(nxt, verified))
    for row, prompt in enumerate(PROMPTS):
        decoded = model.new_state(1, 40)
        prefill(model, decoded, torch.tensor([prompt + candidates[row, : kept[row]].tolist()]),
                torch.tensor([len(prompt) + kept[row]]))
        torch.testing.assert_close(after_verify[row], model.logits(model.step(nxt[row : row + 1], decoded))[0],
                                   rtol=1e-9, atol=1e-9)
