"""The pass/fail verdicts of a validation run: accuracy above a floor - by default above chance, which needs no
reference -, accuracy no more than N points below the reference, MTP mean acceptance length no lower than a floor
(VALIDATION.md, "Tolerances in use elsewhere"), and every question answered when an endpoint ran them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from npuport.runtime.validation.gsm8k_results import GSM8KResult
from npuport.runtime.validation.labels import BF16, W8A8
from npuport.runtime.validation.report import AccuracyRow, FailedQuestions, Gate, MTPAcceptance

DEFAULT_MAX_ACCURACY_DROP = 1.0  # points: vllm-ascend nightly's |accuracy - baseline| <= 1 on most GSM8K cases
# --min-accuracy's default: the accuracy must be above chance, the accuracy of always giving the answer that is
# most common among the questions' gold answers (what a model that learned only which answer is frequent scores;
# a free-form number has no other chance level). A model answering at chance - or every question wrong - fails.
CHANCE = "chance"
MIN_ACCURACY_RULE = ("above chance: higher than the accuracy of always giving the most common gold answer of the "
                     "questions run")
_QUESTIONS_NAMED = 20  # failed questions a gate's detail names before "and N more" (report.json lists them all)


def accuracy_drop_gate(row: AccuracyRow, max_drop_points: float, candidate: str = W8A8,
                       reference: str = BF16) -> Gate:
    """Fails when the candidate's headline accuracy is more than `max_drop_points` percentage points below the
    reference's on the same questions (point estimates; the paired interval is given in the detail)."""
    if row.reference is None:
        raise ValueError("the accuracy gate needs the reference's result")
    difference = (row.candidate.accuracy - row.reference.accuracy) * 100
    detail = (f"{row.candidate.protocol}, {row.candidate.num_questions} questions: {candidate} "
              f"{row.candidate.accuracy * 100:.2f} % vs {reference} {row.reference.accuracy * 100:.2f} %, "
              f"{difference:+.2f} points")
    if row.comparison is not None:
        low, high = row.comparison.interval
        detail += (f" ({row.comparison.confidence:.0%} paired bootstrap interval {low * 100:+.2f} to "
                   f"{high * 100:+.2f}; McNemar p {row.comparison.mcnemar_p:.3g})")
    return Gate(f"max-accuracy-drop {max_drop_points:g} points", difference >= -max_drop_points, detail)


def acceptance_gate(mtp: MTPAcceptance, min_length: float) -> Gate:
    """Fails when the MTP mean acceptance length (accepted drafts + 1 per verify round) is below `min_length`."""
    rates = ", ".join(f"{r:.2f}" for r in mtp.per_position)
    detail = (f"mean acceptance length {mtp.mean_acceptance_length:.2f} with k={mtp.num_speculative_tokens}"
              + (f" over {mtp.num_rounds} rounds" if mtp.num_rounds is not None else "")
              + f"; per draft position [{rates}]")
    return Gate(f"min-acceptance {min_length:g} (mean acceptance length)", mtp.mean_acceptance_length >= min_length,
                detail)


def answered_gate(failed: FailedQuestions) -> Gate:
    """Fails when any question got no usable answer: its score (wrong) then measures the server, not the model."""
    if not failed.errors:
        return Gate("every question answered", True, f"{failed.label}: all {failed.num_questions} questions answered")
    named = ", ".join(map(str, failed.questions[:_QUESTIONS_NAMED]))
    more = len(failed.errors) - _QUESTIONS_NAMED
    detail = (f"{failed.label}: {len(failed.errors)} of {failed.num_questions} questions failed (question "
              f"{named}{f' and {more} more' if more > 0 else ''}), scored as wrong; the first error: "
              f"{failed.errors[failed.questions[0]]}")
    return Gate("every question answered", False, detail)


def chance_accuracy(golds: Sequence[str]) -> tuple[float, str, int]:
    """The accuracy of always answering the most common of `golds` (the first of equals, in order), that answer
    and how many questions have it."""
    answer, count = Counter(golds).most_common(1)[0]
    return count / len(golds), answer, count


def min_accuracy_gate(result: GSM8KResult, floor: float | str, candidate: str = W8A8) -> Gate:
    """Fails when the candidate's headline accuracy is not above chance (`floor` CHANCE: chance_accuracy of the
    questions run), or is below `floor` percent. Needs no reference."""
    accuracy = result.accuracy * 100
    measured = (f"{result.protocol}, {result.num_questions} questions: {candidate} {accuracy:.2f} % "
                f"({sum(result.correct)} right)")
    if floor == CHANCE:
        chance, answer, count = chance_accuracy(result.golds)
        detail = (f"{measured}; chance {chance * 100:.2f} %: always answering {answer}, the most common gold "
                  f"answer ({count} of {result.num_questions} questions)")
        return Gate(f"min-accuracy above chance ({chance * 100:.2f} %)", accuracy > chance * 100, detail)
    if not isinstance(floor, (int, float)) or not 0 <= floor <= 100:
        raise ValueError(f"min-accuracy must be {CHANCE!r} or a percentage from 0 to 100, not {floor!r}")
    return Gate(f"min-accuracy {floor:g} %", accuracy >= floor, measured)
