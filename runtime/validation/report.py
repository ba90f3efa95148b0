"""The validation report as data: what the validate command fills in (a ValidationReport; a section it leaves
empty is omitted) and report.json - every figure, protocol, seed, environment. report.md is written by
report_markdown.py, the plots by report_plots.py, all three files by report_files.py."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any

import npuport
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


@dataclass
class ThroughputRun:
    """One timed generation run; `mtp` says whether speculative decoding with the MTP head was on."""

    label: str
    mtp: bool
    batch_size: int
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    time_per_output_token_ms: float | None = None
    output_tokens_per_s: float | None = None
    num_speculative_tokens: int | None = None


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
    if report.gates:
        data["gates"] = [asdict(gate) for gate in report.gates]
    if report.failed_questions:
        data["failed_questions"] = [
            {"model": f.label, "num_questions": f.num_questions, "failed": len(f.errors), "questions": f.questions,
             "errors": {str(i): f.errors[i] for i in f.questions}} for f in report.failed_questions]
    return data


