"""Caches and state (float64, where two paths that should agree agree to ~1e-12): chunked prefill against
one pass, and a verify step committed at a accepted drafts against decoding those tokens one by one."""

from __future__ import annotations

import pytest
import torch

from npuport.runtime.generate import pad_prompts, prefill
from npuport.runtime.loader import load_model
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
@pytest.mark.parametrize("chunk", [1, 4])
def test_chunked_prefill_equals_one_pass(model, chunk):
    tokens, lengths = pad_prompts(PROMPTS, model.device)
    one, chunked = model.new_state(3, 32, spec_tokens=2), model.new_state(3, 32, spec_tokens=2)
    h_one = prefill(model, one, tokens, lengths)
    h_chunked = prefill(model, chunked, tokens, lengths, chunk_size=chunk)
    for row, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(h_chunked[row, :n], h_one[row, :n], rtol=1e-10, atol=1e-10)
    assert_same_state(one, chunked, [0, 1, 2], [0, 1, 2])
    nxt = torch.tensor([[5], [6], [7]])
    logits = [model.logits(model(nxt, s)) for s in (one, chunked)]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-10, atol=1e-10)


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
    model(candidates, verified)
    commit_accepted(verified, torch.tensor(kept))
    for row, prompt in enumerate(PROMPTS):
        decoded = model.new_state(1, 40, spec_tokens=k)
        prefill(model, decoded, torch.tensor([prompt]), torch.tensor([len(prompt)]))
        for j in range(kept[row]):
            model(candidates[row : row + 1, j : j + 1], decoded)
            commit_accepted(decoded, torch.ones(1, dtype=torch.long))
        assert_same_state(verified, decoded, [row], [0], width=model.config.linear_conv_kernel_dim - 1)
    nxt = torch.tensor([[5], [6], [7]])
    after_verify = model.logits(model(nxt, verified))
    for row, prompt in enumerate(PROMPTS):
        decoded = model.new_state(1, 40)
        prefill(model, decoded, torch.tensor([prompt + candidates[row, : kept[row]].tolist()]),
                torch.tensor([len(prompt) + kept[row]]))
        torch.testing.assert_close(after_verify[row], model.logits(model(nxt[row : row + 1], decoded))[0],
                                   rtol=1e-9, atol=1e-9)
