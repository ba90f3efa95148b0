"""MTP speculative decoding. Greedy runs in float64, where a verify of k + 1 tokens and k + 1 single-token
decodes agree to ~1e-12, so argmax ties cannot split them: greedy speculative output must be exactly
greedy output. Drafting heads are made to accept everything, nothing, or a known pattern, and the
acceptance statistics are checked against what those heads must produce."""

from __future__ import annotations

import math

import pytest
import torch

from npuport.runtime.generate import generate
from npuport.runtime.loader import load_model
from npuport.runtime.sampling import SamplingParams, make_generator, rejection_sample, target_probs

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [400, 401, 402], list(range(900, 921))]
MAX_NEW = 64


@pytest.fixture(scope="module", params=["dense-multimodal", "moe-text-per-expert", "qwen3.6-recipe-dense-text"])
def greedy_case(request, tiny_checkpoints, qwen36_artifacts):
    """A float64 model and each prompt's plain greedy continuation, long enough for any draft to look up. The
    third: a W8A8 artifact of the Qwen3.6-27B recipe (GatedDeltaNet input projections int8 too)."""
    folder = qwen36_artifacts["dense-text"] if request.param.startswith("qwen3.6") else tiny_checkpoints[request.param]
    model = load_model(folder, "cpu", torch.float64)
    plain = generate(model, PROMPTS, MAX_NEW + 6)
    return model, [p + t for p, t in zip(PROMPTS, plain.tokens, strict=True)]


def scripted_head(model, monkeypatch, sequences, wrong):
    """Replace the MTP head's logits, for rows whose wrong(row, position) is not None, with a one-hot on the
    reference token at the position the row predicts (token after next) - or on another token where
    wrong(...) is True. The real head still runs, so its cache is filled as usual."""
    real = model.mtp_forward

    def mtp_forward(next_tokens, hidden, state, start=None, logits_at=None):
        logits, out = real(next_tokens, hidden, state, start, logits_at)
        begin = (state.positions if start is None else start).tolist()
        for row, seq in enumerate(sequences):
            for t in range(logits.shape[1]):
                pos = begin[row] + (t if logits_at is None else int(logits_at[row])) + 2
                miss = wrong(row, pos)
                if miss is None or pos >= len(seq):
                    continue
                logits[row, t] = -1e9
                logits[row, t, (seq[pos] + 1) % logits.shape[-1] if miss else seq[pos]] = 0.0
        return logits, out

    monkeypatch.setattr(model, "mtp_forward", mtp_forward)


def expected_stats(prompt_len: int, k: int, wrong) -> tuple[int, list[int]]:
    """(rounds, accepted_at) that drafts wrong exactly at positions where wrong(pos) must produce: each
    round verifies drafts for positions p + 1..p + k and keeps those before the first wrong one."""
    p, generated, rounds, accepted_at = prompt_len, 1, 0, [0] * k
    while generated < MAX_NEW:
        a = 0
        while a < k and not wrong(p + a + 1):
            a += 1
        rounds += 1
        for j in range(a):
            accepted_at[j] += 1
        generated, p = generated + a + 1, p + a + 1
    return rounds, accepted_at


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_speculative_equals_greedy_with_per_request_acceptance(greedy_case, monkeypatch, k):
    """Row 0 drafts perfectly, row 1 is wrong at every position divisible by 3, row 2 uses the real head."""
    model, sequences = greedy_case
    patterns = {0: lambda pos: False, 1: lambda pos: pos % 3 == 0}
    scripted_head(model, monkeypatch, sequences, lambda row, pos: patterns[row](pos) if row in patterns else None)
    result = generate(model, PROMPTS, MAX_NEW, mtp=k)
    assert result.tokens == [s[len(p) : len(p) + MAX_NEW] for p, s in zip(PROMPTS, sequences, strict=True)]
    for row, wrong in patterns.items():
        rounds, accepted_at = expected_stats(len(PROMPTS[row]), k, wrong)
        assert (result.stats.rounds[row], result.stats.accepted_at[row]) == (rounds, accepted_at)
        assert result.stats.accepted[row] == sum(accepted_at)
    assert result.stats.rounds[0] == math.ceil((MAX_NEW - 1) / (k + 1))
    assert result.stats.rounds[1] < MAX_NEW - 1 < result.stats.rounds[2] + result.stats.accepted[2] + 1


@pytest.mark.parametrize("always_wrong", [False, True], ids=["full-acceptance", "forced-rejection"])
def test_heads_that_accept_everything_or_nothing_keep_greedy_output(greedy_case, monkeypatch, always_wrong):
    model, sequences = greedy_case
    k = 3
    scripted_head(model, monkeypatch, sequences, lambda row, pos: always_wrong)
    result = generate(model, PROMPTS, MAX_NEW, mtp=k)
    assert result.tokens == [s[len(p) : len(p) + MAX_NEW] for p, s in zip(PROMPTS, sequences, strict=True)]
    rounds = MAX_NEW - 1 if always_wrong else math.ceil((MAX_NEW - 1) / (k + 1))
    assert result.stats.rounds == [rounds] * 3
    assert result.stats.accepted_at == [[0 if always_wrong else rounds] * k] * 3
    assert result.stats.mean_accepted_length() == (1.0 if always_wrong else k + 1)


def test_stop_tokens_end_each_request_where_greedy_does(greedy_case):
    model, sequences = greedy_case
    stop = sequences[1][len(PROMPTS[1]) + 20]  # a token greedy decoding of request 1 produces
    plain = generate(model, PROMPTS, 40, stop_tokens=[stop])
    spec = generate(model, PROMPTS, 40, mtp=2, stop_tokens=[stop])
    assert spec.tokens == plain.tokens and spec.finish_reasons == plain.finish_reasons
    assert plain.finish_reasons[1] == "stop" and plain.tokens[1][-1] == stop and len(plain.tokens[1]) <= 21
    assert all(len(t) == 40 for t, r in zip(plain.tokens, plain.finish_reasons, strict=True) if r == "length")


def test_chunked_prefill_keeps_speculative_output(greedy_case):
    model, sequences = greedy_case
    result = generate(model, PROMPTS, 24, mtp=2, prefill_chunk=4)
    assert result.tokens == [s[len(p) : len(p) + 24] for p, s in zip(PROMPTS, sequences, strict=True)]


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = n * probs
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor(len(probs) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def test_rejection_sampling_leaves_the_target_distribution_unchanged():
    """Each emitted token, given the ones before it, must follow the target distribution at its position."""
    p = torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05], [0.3, 0.05, 0.15, 0.2, 0.3], [0.2, 0.2, 0.2, 0.1, 0.3]],
                     dtype=torch.float64)
    n = 200_000
    drafts = torch.tensor([3, 0]).expand(n, 2)
    accepted, nxt = rejection_sample(p.expand(n, 3, 5), drafts, make_generator(0, torch.device("cpu")))
    emitted = torch.cat([drafts, nxt[:, None]], dim=1)
    emitted[torch.arange(n), accepted] = nxt
    first = emitted[:, 0]
    second = emitted[first == 3, 1]
    third = emitted[(first == 3) & (emitted[:, 1] == 0), 2]
    for tokens, probs in ((first, p[0]), (second, p[1]), (third, p[2])):
        counts = torch.bincount(tokens, minlength=5).double()
        assert chi_square_p_value(counts, probs) > 1e-3, (counts / counts.sum(), probs)
    # and the acceptance rate of the first draft is its target probability
    assert abs((accepted >= 1).double().mean().item() - 0.25) < 0.005


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    torch.testing.assert_close(target_probs(logits, SamplingParams(1.0, 0.8)), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    torch.testing.assert_close(target_probs(logits, SamplingParams(1.0, 0.5)), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(target_probs(logits, SamplingParams(1.0, 1.0)), torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


def test_sampled_speculative_decoding_is_reproducible_by_seed(tiny_checkpoints):
    model = load_model(tiny_checkpoints["dense-text"], "cpu", torch.float32)
    runs = [generate(model, PROMPTS, 16, mtp=2, sampling=SamplingParams(0.8, 0.95, seed)) for seed in (1, 1, 2)]
    assert runs[0].tokens == runs[1].tokens and runs[0].stats == runs[1].stats
    assert runs[0].tokens != runs[2].tokens
    assert all(len(t) == 16 for t in runs[0].tokens) and sum(runs[0].stats.rounds) > 0
