"""A request ended early by `should_stop` has produced exactly the first tokens of the same request run to the
end (requests of a batch do not affect each other), with and without MTP; a check that never fires changes
nothing; the check is asked per request; each request may have its own max_new_tokens; and the tokens
`on_tokens` hears of, request by request, are exactly the tokens generate returns."""

from __future__ import annotations

import pytest
import torch

from npuport.errors import NpuportError
from npuport.runtime.generate import STOP_CHECK_EVERY, generate
from npuport.runtime.loader import load_model

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

PROMPTS = [[31, 7, 1500, 42, 9], list(range(200, 217)), [1000, 3, 77, 640]]
NEW_TOKENS = 40
STOP_AFTER = 10


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return load_model(tiny_checkpoints["dense-text"], "cpu", torch.float32)


@pytest.mark.parametrize("mtp", [0, 2])
def test_stop_check_ends_requests_on_a_prefix_of_their_full_output(model, mtp):
    full = generate(model, PROMPTS, NEW_TOKENS, mtp=mtp)
    assert all(len(t) == NEW_TOKENS for t in full.tokens), "no EOS in the reference run"
    seen: list[tuple[int, int]] = []

    def long_enough(index: int, tokens: list[int]) -> bool:
        seen.append((index, len(tokens)))
        return len(tokens) >= STOP_AFTER

    early = generate(model, PROMPTS, NEW_TOKENS, mtp=mtp, should_stop=long_enough)
    for got, want, reason in zip(early.tokens, full.tokens, early.finish_reasons, strict=True):
        assert reason == "stop" and STOP_AFTER <= len(got) < STOP_AFTER + STOP_CHECK_EVERY + mtp + 1
        assert got == want[: len(got)]
    assert min(n for _, n in seen) >= STOP_CHECK_EVERY and {i for i, _ in seen} == {0, 1, 2}
    never = generate(model, PROMPTS, NEW_TOKENS, mtp=mtp, should_stop=lambda index, tokens: False)
    assert never.tokens == full.tokens and never.finish_reasons == full.finish_reasons
    only_second = generate(model, PROMPTS, NEW_TOKENS, mtp=mtp, should_stop=lambda index, tokens: index == 1)
    assert only_second.finish_reasons == ["length", "stop", "length"]
    assert only_second.tokens[0] == full.tokens[0] and only_second.tokens[2] == full.tokens[2]


@pytest.mark.parametrize("mtp", [0, 3])
def test_each_request_keeps_its_own_limit_and_its_stream_is_its_output(model, mtp):
    full = generate(model, PROMPTS, NEW_TOKENS, mtp=mtp)
    limits = [3, NEW_TOKENS, 17]
    heard: dict[int, list[int]] = {0: [], 1: [], 2: []}
    calls = []

    def on_tokens(index: int, new: list[int]) -> None:
        calls.append(index)
        heard[index] += new

    mixed = generate(model, PROMPTS, limits, mtp=mtp, on_tokens=on_tokens)
    assert mixed.tokens == [t[:n] for t, n in zip(full.tokens, limits, strict=True)]
    assert mixed.finish_reasons == ["length"] * 3
    assert [heard[i] for i in range(3)] == mixed.tokens
    assert calls.count(1) > 1  # a request is heard of as it goes, not once at the end
    with pytest.raises(NpuportError, match="2 max_new_tokens for 3 prompts"):
        generate(model, PROMPTS, [4, 4])
