"""Is an engine's greedy output a function of the prompt alone? The same questions answered again (`--repeat`) and
by the same model without speculative decoding (`--mtp-reference-endpoint`, `--compare-without-mtp`), compared
completion by completion; the report's section on it, as data and as markdown."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from npuport.runtime.completion import Completion

REPEAT_EXPLAINED = (
    "Repeat: the same questions sent again, unchanged; the share of questions whose completion is character for "
    "character run 1's. Greedy decoding picks the most likely token, so an engine whose arithmetic depends on the "
    "prompt alone answers the same every time. Below 100 % means it depends on something else: which requests "
    "shared a batch (the batch's size and make-up change reduction orders and kernel tiles, hence float rounding, "
    "and rounding flips a near-tie between two tokens - unless the kernels are batch-invariant), prefix caching, "
    "chunked prefill or atomics in parallel reductions. Accuracy and the paired comparison are then figures of one "
    "run: part of a difference between two models is the engine's own spread, which this measures.")
MTP_EXPLAINED = (
    "MTP: the same greedy requests answered by the same model without speculative decoding; the share of "
    "completions identical to those made with MTP. Speculative decoding is meant to change speed only: a draft is "
    "kept only where the model would have chosen it. Below 100 % means it changed the output: a verify step runs "
    "k+1 tokens through the model at once, through other kernels and tiles than a one-token decode step, rounds "
    "differently and flips near-ties - the bug class reported against sglang and vllm-ascend. Accuracy measured "
    "with MTP is then not the model's greedy accuracy.")
DIFFERING_SHOWN = 50  # differing question numbers listed in report.md; report.json lists every one


@dataclass(frozen=True)
class CompletionAgreement:
    """One run's completions of the GSM8K questions against a first run's, question by question (0-based question
    numbers, as in completions.jsonl). A question either run got no usable answer for is not compared."""

    name: str  # what was compared with what, e.g. "run 2 against run 1"
    num_questions: int
    differing: tuple[int, ...]  # questions whose completion texts differ
    not_compared: tuple[int, ...] = ()  # questions one side failed
    accuracy: float | None = None  # the headline accuracy of the run compared against the first

    @property
    def num_compared(self) -> int:
        return self.num_questions - len(self.not_compared)

    @property
    def identical(self) -> int:
        return self.num_compared - len(self.differing)

    @property
    def share(self) -> float | None:
        """Identical completions over the questions compared; None when none could be."""
        return self.identical / self.num_compared if self.num_compared else None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "num_questions": self.num_questions, "compared": self.num_compared,
                "identical": self.identical, "share": self.share, "differing": list(self.differing),
                "not_compared": list(self.not_compared), "accuracy": self.accuracy}


def compare_completions(name: str, first: Sequence[Completion], other: Sequence[Completion],
                        accuracy: float | None = None) -> CompletionAgreement:
    """`other` against `first`, the same questions in the same order: which completion texts differ."""
    if len(first) != len(other):
        raise ValueError(f"{name}: {len(first)} completions against {len(other)}; not the same questions")
    failed = tuple(i for i, (a, b) in enumerate(zip(first, other, strict=True))
                   if a.error is not None or b.error is not None)
    differing = tuple(i for i, (a, b) in enumerate(zip(first, other, strict=True))
                      if i not in failed and a.text != b.text)
    return CompletionAgreement(name, len(first), differing, failed, accuracy)


@dataclass
class Determinism:
    """The run whose completions were repeated (`label`), each later run against its first (`repeats`), and its
    completions without MTP against those with (`mtp`); `how` and `mtp_how` say how they were obtained."""

    label: str
    how: str
    first_accuracy: float
    repeats: list[CompletionAgreement] = field(default_factory=list)
    mtp: CompletionAgreement | None = None
    mtp_how: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"model": self.label, "how": self.how, "first_accuracy": self.first_accuracy}
        if self.repeats:
            data["repeat"] = {"explained": REPEAT_EXPLAINED, "runs": [r.to_dict() for r in self.repeats]}
        if self.mtp is not None:
            data["mtp"] = {"explained": MTP_EXPLAINED, "without_mtp": self.mtp_how, **self.mtp.to_dict()}
        return data


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.2f} %"


def _questions(numbers: Sequence[int]) -> str:
    shown = ", ".join(map(str, numbers[:DIFFERING_SHOWN]))
    more = len(numbers) - DIFFERING_SHOWN
    return (shown + (f" and {more} more (report.json)" if more > 0 else "")) or "none"


def _row(agreement: CompletionAgreement) -> list[str]:
    return [agreement.name, f"{agreement.identical} of {agreement.num_compared}", _percent(agreement.share),
            _percent(agreement.accuracy), _questions(agreement.differing)
            + (f" (not compared, a side failed: {_questions(agreement.not_compared)})" if agreement.not_compared
               else "")]


def determinism_markdown(determinism: Determinism) -> list[str]:
    """report.md's section: what each measure is, then one table row per comparison."""
    lines = ["## Determinism of greedy output", "",
             f"{determinism.label}, {determinism.how}; run 1's accuracy: {_percent(determinism.first_accuracy)} "
             "(the figures above are run 1's).", ""]
    if determinism.repeats:
        lines += [REPEAT_EXPLAINED, ""]
    if determinism.mtp is not None:
        lines += [MTP_EXPLAINED, f"Without MTP: {determinism.mtp_how}.", ""]
    rows = [_row(r) for r in determinism.repeats] + ([_row(determinism.mtp)] if determinism.mtp else [])
    lines += ["| compared | identical | share | accuracy of the later run | questions that differed |",
              "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines + [""]
