"""Batch-invariant decoding: inside `batch_invariant(rows)`, decode and verify steps compute each token's row with
an order of operations that does not depend on how many rows the step has - so that a verify of k + 1 tokens per
request gives the bits k + 1 single-token decode steps give, and greedy speculative decoding the tokens of greedy
decoding. On by default with MTP on one GPU / NPU (run_options.run_options; `--no-batch-invariant` for speed):
shown on an H200 for trained small models and at 35B-A3B and 122B-A10B widths (tests/test_kernels_on_gpu.py,
bench/invariance.py, bench/invariance_bisect.py, bench/mtp_decode.py; figures and cost in bench/RESULTS.md).

Most kernels are row-independent already (norms, rope, the W8A8 GEMM's exact int32 sums); what the setting
changes: float linear layers and the lm_head run kernels/invariant_linear.py instead of the vendor GEMM, the MoE
layers choose their expert path and tiles by `rows`, the largest step of the call, instead of by the step's own
size, and decode attention and the GDN recurrence launch every step as the largest verify step (a decode step's
query tile, and the order in which a state column is summed, then those of a verify step). Prefill is not a step
and runs the fast kernels (Qwen35.prefill suspends the setting). A context setting of the current thread or task,
read by the layers on every call (and at capture).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from npuport.kernels.implementations import batch_invariant_calls


@dataclass(frozen=True)
class Invariance:
    """rows: the most tokens a decode or verify step of the current generate call could take with any number of
    drafts (batch x (MAX_DRAFTS + 1)): plain and speculative calls then plan the same kernels."""

    rows: int

    def tokens_per_request(self, batch: int) -> int:
        """The most tokens a step could give each of `batch` requests: what the attention and GDN kernels plan for
        (their tiles follow the tokens per request, the MoE's the tokens of the step)."""
        return max(1, self.rows // batch)


_current: contextvars.ContextVar[Invariance | None] = contextvars.ContextVar("npuport_invariance", default=None)


def current_invariance() -> Invariance | None:
    return _current.get()


def planned_tokens(batch: int) -> int | None:
    """Inside batch_invariant(): the tokens per request that a decode / verify step's attention and GDN kernels
    plan for, so that every step launches as the largest verify step; else None (each step its own size)."""
    invariance = current_invariance()
    return None if invariance is None else invariance.tokens_per_request(batch)


@contextmanager
def batch_invariant(rows: int | None) -> Iterator[None]:
    """Steps inside are batch-invariant, planned for steps of up to `rows` tokens; None: the fast kernels. On an NPU
    the steps then take torch-npu's operators only where their results follow no summation order
    (kernels/implementations.py, batch_invariant_calls)."""
    token = _current.set(None if rows is None else Invariance(rows))
    try:
        with batch_invariant_calls(rows is not None):
            yield
    finally:
        _current.reset(token)
