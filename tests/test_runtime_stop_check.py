"""A request ended early by `should_stop` has produced exactly the first tokens of the same request run to the
end (requests of a batch do not affect each other), with and without MTP; a check that never fires changes
nothing."""

from __future__ import annotations

import pytest
import torch

from npuport.runtime.generate import STOP_CHECK_EVERY, generate
from npuport.runtime.loader import load_model

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

PROMPTS = [[31, 7, 1500, 42, 9], list(range(200, 217)), [1000, 3, 77, 640]]
NEW_TOKENS = 40
STOP_AFTER = 10


@pytest.mark.parametrize("mtp", [0, 2])
def test_stop_check_ends_requests_on_a_prefix_of_their_full_output(tiny_checkpoints, mtp):
    model = load_model(tiny_checkpoints["dense-text"], "cpu", torch.float32)
    full = generate(model, PROMPTS, NEW_TOKENS, mtp=mtp)
    assert all(len(t) == NEW_TOKENS for t in full.tokens), "no EOS in the reference run"
    seen: list[int] = []

    def long_enough(tokens: list[int]) -> bool:
        seen.append(len(tokens))
        return len(tokens) >= STOP_AFTER

    early = generate(model, PROMPTS, NEW_TOKENS, mtp=mtp, should_stop=long_enough)
    for got, want, reason in zip(early.tokens, full.tokens, early.finish_reasons, strict=True):
        assert reason == "stop" and STOP_AFTER <= len(got) < STOP_AFTER + STOP_CHECK_EVERY + mtp + 1
        assert got == want[: len(got)]
    assert min(seen) >= STOP_CHECK_EVERY
    never = generate(model, PROMPTS, NEW_TOKENS, mtp=mtp, should_stop=lambda tokens: False)
    assert never.tokens == full.tokens and never.finish_reasons == full.finish_reasons
