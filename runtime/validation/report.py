"""The validation report as data: what the validate command fills in (a ValidationReport; a section it leaves
empty is omitted) and report.json - every figure, protocol, seed, environment. report.md is written by
report_markdown.py, the plots by report_plots.py, all three files by report_files.py."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any

import npuport
from npuport.runtime.validation.determinism import Determinism
from npuport.runtime.validation.gsm8k_results import GSM8KResult
from npuport.runtime.validation.paired_stats import (
    DEFAULT_CONFIDENCE,
    DEFAULT_RESAMPLES,
    PairedComparison,
    compare_paired,
    wilson_interval,
)

REPORT_FORMAT = 1


# ---------------------------------------------------------------------------------------------------------
# What the validate command fills in


@dataclass
class AccuracyRow:
    """One GSM8K protocol: the candidate's result, optionally the reference's on the same questions and
    their paired comparison (of the headline score)."""

    candidate: GSM8KResult
    reference: GSM8KResult | None = None
    comparison: PairedComparison | None = None

    def __post_init__(self) -> None:
        ref = self.reference
        if ref is not None and (ref.protocol != self.candidate.protocol or ref.golds != self.candidate.golds):
            raise ValueError(f"the reference ran {ref.protocol} on {ref.num_questions} questions, the candidate "
                             f"{self.candidate.protocol} on {self.candidate.num_questions}: not the same questions")
        if self.comparison is not None and ref is None:
            raise ValueError("a comparison needs the reference result")

    @classmethod
    def paired(cls, candidate: GSM8KResult, reference: GSM8KResult, *, seed: int,
               resamples: int = DEFAULT_RESAMPLES) -> AccuracyRow:
        """Both results and their McNemar test and bootstrap interval (headline score)."""
        comparison = compare_paired(reference.correct, candidate.correct, seed=seed, resamples=resamples)
        return cls(candidate, reference, comparison)


FULL_KL = "full vocabulary"  # Fidelity.kl_method of the built-in runtime's fidelity


def topk_kl_method(k: int) -> str:
    """Fidelity.kl_method of an estimate from endpoints' top-k log-probabilities."""
    return f"top-{k} estimate from endpoint log-probabilities"


@dataclass
class Fidelity:
    """Agreement with the BF16 source on the same prompts. `kl_method` says what mean_kl is: the full-vocabulary
    KL (both models in the built-in runtime) or the top-k estimate from endpoints' log-probabilities
    (topk_kl.topk_kl_estimate); `topk_kl_estimates`: k -> that estimate on the same positions, where the full
    KL is known too (the estimate's bias, measured)."""

    greedy_token_agreement: float
    top1_agreement: float
    mean_kl: float
    layer_cosine: list[float] = field(default_factory=list)  # per decoder layer, in order
    num_prompts: int | None = None
    num_tokens: int | None = None
    kl_method: str = FULL_KL
    topk_kl_estimates: dict[int, float] = field(default_factory=dict)


# The figures of a ThroughputRun: (name in tables and plots, attribute, digits shown)
THROUGHPUT_COLUMNS = (
    ("prefill tok/s", "prefill_tokens_per_s", 1),
    ("decode tok/s", "decode_tokens_per_s", 1),
    ("time per output token ms", "time_per_output_token_ms", 2),
    ("output tok/s", "output_tokens_per_s", 1),
)
THROUGHPUT_FIGURES = tuple(attr for _, attr, _ in THROUGHPUT_COLUMNS)


@dataclass
class ThroughputRun:
    """One timed generation run of one model; `mtp` says whether speculative decoding with the MTP head was on.
    Each figure is measured over `repeats` timings (throughput.py); `ranges` holds, per figure (attribute name),
    its lowest and highest value over them - the spread that tells a difference from timing noise - with None at
    an end a repeat left without a bound (its decode not slower than its prefill)."""

    label: str
    mtp: bool
    batch_size: int
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    time_per_output_token_ms: float | None = None
    output_tokens_per_s: float | None = None
    num_speculative_tokens: int | None = None
    model: str | None = None  # which model ran (the report's candidate or reference label); None: not recorded
    repeats: int = 1
    ranges: dict[str, list[float | None]] = field(default_factory=dict)

    def spread(self, figure: str) -> float | None:
        """Highest - lowest of `figure` over the repeats (infinite when an end has no bound); None when it was
        not measured over several."""
        bounds = self.ranges.get(figure)
        if bounds is None or self.repeats < 2:
            return None
        low, high = bounds
        return math.inf if low is None or high is None else high - low


@dataclass(frozen=True)
class ThroughputDifference:
    """One figure of two runs that differ in one thing only - the same model with MTP against without, or the
    candidate against the reference with the same MTP setting - and whether timing noise can explain it: within
    noise when the larger of the two runs' spreads over repeats exceeds the difference."""

    figure: str  # a THROUGHPUT_FIGURES attribute
    run: str  # the label of the run compared
    baseline: str  # the label of the run it is compared with
    value: float
    baseline_value: float
    spread: float | None  # None: a run was timed once, so its spread is unknown

    @property
    def difference(self) -> float:
        return self.value - self.baseline_value

    @property
    def within_noise(self) -> bool:
        return self.spread is not None and self.spread > abs(self.difference)

    def noise_words(self, digits: int = 1) -> str:
        """'within noise: spread X, difference Y' (or 'beyond noise: ...', or 'spread unknown: one repeat')."""
        difference = f"difference {self.difference:+.{digits}f}"
        if self.spread is None:
            return f"spread unknown (one repeat), {difference}"
        verdict = "within noise" if self.within_noise else "beyond noise"
        spread = ("unbounded (a repeat's decode was not slower than its prefill)" if math.isinf(self.spread)
                  else f"{self.spread:.{digits}f}")
        return f"{verdict}: spread {spread}, {difference}"


def _difference(figure: str, run: ThroughputRun, baseline: ThroughputRun) -> ThroughputDifference | None:
    value, base = getattr(run, figure), getattr(baseline, figure)
    if value is None or base is None:
        return None
    spreads = [run.spread(figure), baseline.spread(figure)]
    spread = None if None in spreads else max(spreads)
    return ThroughputDifference(figure, run.label, baseline.label, value, base, spread)


def throughput_differences(runs: list[ThroughputRun]) -> list[ThroughputDifference]:
    """Every figure both runs of a pair measured, for each pair of runs of one batch size that differ in one thing:
    MTP on against off for the same model, or another model against the first one timed with the same MTP setting
    (models are never compared under different settings). Runs that do not name their model are not paired."""
    named = [r for r in runs if r.model is not None]
    pairs = [(r, b) for r in named for b in named if r.batch_size == b.batch_size and r.model == b.model
             and r.mtp and not b.mtp]
    first_model = named[0].model if named else None
    pairs += [(r, b) for r in named for b in named if r.batch_size == b.batch_size and r.model != b.model
              and b.model == first_model and r.num_speculative_tokens == b.num_speculative_tokens]
    found = [_difference(figure, r, b) for r, b in pairs for figure in THROUGHPUT_FIGURES]
    return [d for d in found if d is not None]


@dataclass(frozen=True)
class MTPSpeedup:
    """One model's decode tokens/s with MTP over its own decode tokens/s without, at the same batch size; `ratio`
    None with the `reason` when one of the two was not measured."""

    model: str
    run: str
    baseline: str | None
    ratio: float | None
    reason: str | None = None
    difference: ThroughputDifference | None = None
    num_speculative_tokens: int | None = None


def mtp_speedups(runs: list[ThroughputRun]) -> list[MTPSpeedup]:
    """The decode speed-up of each MTP run over the same model's run without MTP (never another model's)."""
    found = []
    for run in (r for r in runs if r.mtp):
        model = run.model or run.label
        plain = next((r for r in runs if not r.mtp and r.model is not None and r.model == run.model
                      and r.batch_size == run.batch_size), None)
        if run.model is None or plain is None:
            found.append(MTPSpeedup(model, run.label, None, None, f"no run of {model} without MTP at batch "
                                    f"{run.batch_size} to compare with", None, run.num_speculative_tokens))
            continue
        unmeasured = [r.label for r in (run, plain) if not r.decode_tokens_per_s]
        if unmeasured:
            found.append(MTPSpeedup(model, run.label, plain.label, None, f"the decode of {' and '.join(unmeasured)} "
                                    "was not measurable (timing noise above the decode time)", None,
                                    run.num_speculative_tokens))
            continue
        found.append(MTPSpeedup(model, run.label, plain.label, run.decode_tokens_per_s / plain.decode_tokens_per_s,
                                difference=_difference("decode_tokens_per_s", run, plain),
                                num_speculative_tokens=run.num_speculative_tokens))
    return found


@dataclass
class MTPAcceptance:
    """Speculative decoding with the MTP head: mean acceptance length (accepted drafts + 1 per round) and the
    acceptance rate of each draft position."""

    num_speculative_tokens: int
    mean_acceptance_length: float
    per_position: list[float]
    num_rounds: int | None = None


@dataclass
class Gate:
    """One pass/fail verdict on the figures, e.g. name "max-accuracy-drop 1.0 points", detail "W8A8 -0.4 vs BF16".
    A release is not packaged while any gate has passed=False (unless forced)."""

    name: str
    passed: bool
    detail: str = ""


@dataclass
class FailedQuestions:
    """The questions of one model's GSM8K run that got no usable answer (an endpoint's per-question errors:
    a malformed answer, an HTTP error after the retries, the deadline), by question number (0-based, as in
    completions.jsonl), each with its one-line error. They are scored as wrong."""

    label: str
    num_questions: int
    errors: dict[int, str] = field(default_factory=dict)

    @property
    def questions(self) -> list[int]:
        return sorted(self.errors)


@dataclass
class ValidationReport:
    """Everything one validation run measured. Empty sections (no reference, no MTP, ...) are left out."""

    artifact: str
    device: str
    seed: int
    artifact_checksum: str | None = None
    candidate_label: str = "W8A8"
    reference_label: str = "BF16"
    accuracy: list[AccuracyRow] = field(default_factory=list)
    fidelity: Fidelity | None = None
    throughput: list[ThroughputRun] = field(default_factory=list)
    mtp: MTPAcceptance | None = None
    mtp_reference: MTPAcceptance | None = None  # the reference's own drafts on the same prompts
    dtypes: dict[str, str] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)  # anything else the run records (URL, batch size)
    gates: list[Gate] = field(default_factory=list)
    failed_questions: list[FailedQuestions] = field(default_factory=list)  # runs that could fail per question
    determinism: Determinism | None = None  # --repeat, --mtp-reference-endpoint, --compare-without-mtp



# ---------------------------------------------------------------------------------------------------------
# report.json


def library_versions() -> dict[str, str | None]:
    """Installed versions of the libraries whose numerics the figures depend on (None: not installed)."""
    versions: dict[str, str | None] = {"npuport": npuport.__version__}
    for name in ("torch", "transformers", "torch_npu"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _result_dict(result: GSM8KResult) -> dict[str, Any]:
    data = result.to_dict()
    for score_data, score in zip(data["scores"], result.scores, strict=True):
        score_data["interval"] = list(wilson_interval(score.correct, DEFAULT_CONFIDENCE))
    data["interval"] = data["scores"][0]["interval"]
    data["interval_method"] = f"wilson {DEFAULT_CONFIDENCE:g}"
    return data


def _difference_dict(difference: ThroughputDifference) -> dict[str, Any]:
    """A ThroughputDifference as JSON (which has no infinity: an unbounded spread is null, spread_unbounded true)."""
    data = {**asdict(difference), "difference": difference.difference, "within_noise": difference.within_noise}
    if difference.spread is not None and math.isinf(difference.spread):
        data.update(spread=None, spread_unbounded=True)
    return data


def report_dict(report: ValidationReport) -> dict[str, Any]:
    """The report as JSON-ready data: every figure passed in, plus intervals and the environment."""
    data: dict[str, Any] = {
        "format": REPORT_FORMAT,
        "artifact": report.artifact,
        "artifact_checksum": report.artifact_checksum,
        "device": report.device,
        "seed": report.seed,
        "versions": library_versions(),
        "labels": {"candidate": report.candidate_label, "reference": report.reference_label},
    }
    if report.dtypes:
        data["dtypes"] = dict(report.dtypes)
    if report.settings:
        data["settings"] = dict(report.settings)
    if report.accuracy:
        rows = []
        for row in report.accuracy:
            entry: dict[str, Any] = {"protocol": row.candidate.protocol, "candidate": _result_dict(row.candidate)}
            if row.reference is not None:
                entry["reference"] = _result_dict(row.reference)
            if row.comparison is not None:
                entry["comparison"] = row.comparison.to_dict()
            rows.append(entry)
        data["gsm8k"] = rows
    if report.fidelity is not None:
        data["fidelity"] = asdict(report.fidelity)
    if report.throughput:
        data["throughput"] = [asdict(run) for run in report.throughput]
        data["throughput_differences"] = [_difference_dict(d) for d in throughput_differences(report.throughput)]
        data["mtp_decode_speedup"] = [
            {"model": s.model, "run": s.run, "baseline": s.baseline, "ratio": s.ratio, "reason": s.reason,
             "within_noise": None if s.difference is None else s.difference.within_noise}
            for s in mtp_speedups(report.throughput)]
    if report.mtp is not None:
        data["mtp"] = asdict(report.mtp)
    if report.mtp_reference is not None:
        data["mtp_reference"] = asdict(report.mtp_reference)
        if report.mtp is not None:
            data["mtp_change"] = {
                "mean_acceptance_length": report.mtp.mean_acceptance_length
                - report.mtp_reference.mean_acceptance_length,
                "per_position": [c - r for c, r in zip(report.mtp.per_position, report.mtp_reference.per_position,
                                                       strict=False)],
            }
    if report.determinism is not None:
        data["determinism"] = report.determinism.to_dict()
    if report.gates:
        data["gates"] = [asdict(gate) for gate in report.gates]
    if report.failed_questions:
        data["failed_questions"] = [
            {"model": f.label, "num_questions": f.num_questions, "failed": len(f.errors), "questions": f.questions,
             "errors": {str(i): f.errors[i] for i in f.questions}} for f in report.failed_questions]
    return data


