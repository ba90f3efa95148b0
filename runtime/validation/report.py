"""The validation report: report.json (every figure, protocol, seed, environment), report.md (tables a person
reads) and PNG plots. The validate command fills a ValidationReport; a section it leaves empty is omitted."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import npuport
from npuport.runtime.validation.gsm8k import GSM8KResult, Score
from npuport.runtime.validation.paired_stats import (
    DEFAULT_CONFIDENCE,
    DEFAULT_RESAMPLES,
    PairedComparison,
    compare_paired,
    wilson_interval,
)

REPORT_FORMAT = 1
_MISSING = "–"


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
    (logprobs.topk_kl_estimate); `topk_kl_estimates`: k -> that estimate on the same positions, where the full
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


@dataclass(frozen=True)
class ReportFiles:
    json: Path
    markdown: Path
    plots: list[Path]


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


# ---------------------------------------------------------------------------------------------------------
# report.md


def _fmt(value: float | int | None, digits: int = 2) -> str:
    if value is None:
        return _MISSING
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


def _pct(score: Score) -> str:
    low, high = wilson_interval(score.correct, DEFAULT_CONFIDENCE)
    return f"{score.accuracy * 100:.2f} ({low * 100:.2f}–{high * 100:.2f})"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines + [""]


def _accuracy_section(report: ValidationReport) -> list[str]:
    cand, ref = report.candidate_label, report.reference_label
    with_ref = any(row.reference is not None for row in report.accuracy)
    header = ["protocol", "score", "shots", "questions", f"{cand} accuracy % (95% interval)", f"{cand} invalid %"]
    if with_ref:
        header += [f"{ref} accuracy % (95% interval)", f"{ref} invalid %"]
    rows = []
    for row in report.accuracy:
        result = row.candidate
        for i, score in enumerate(result.scores):
            cells = [result.protocol, score.name, str(result.shots), str(result.num_questions), _pct(score),
                     f"{score.invalid_rate * 100:.2f}"]
            if with_ref and row.reference is not None:
                ref_score = row.reference.scores[i]
                cells += [_pct(ref_score), f"{ref_score.invalid_rate * 100:.2f}"]
            elif with_ref:
                cells += [_MISSING, _MISSING]
            rows.append(cells)
    lines = ["## GSM8K accuracy", "", "Intervals: Wilson, 95%. The protocols follow VALIDATION.md; the "
             "headline score of each protocol is its first row.", ""]
    lines += _table(header, rows)

    timed = [(label, r) for row in report.accuracy for label, r in ((cand, row.candidate), (ref, row.reference))
             if r is not None and r.latency_s is not None]
    if timed:
        lines += ["### GSM8K generation", ""]
        lines += _table(["protocol", "model", "questions", "latency s", "completion tokens", "output tok/s"],
                        [[r.protocol, label, str(r.num_questions), _fmt(r.latency_s), _fmt(r.completion_tokens),
                          _fmt(r.output_throughput, 1)] for label, r in timed])
    return lines


def _comparison_section(report: ValidationReport) -> list[str]:
    cand, ref = report.candidate_label, report.reference_label
    compared = [row for row in report.accuracy if row.comparison is not None]
    if not compared:
        return []
    rows = []
    for row in compared:
        c = row.comparison
        rows.append([row.candidate.protocol, row.candidate.scores[0].name, str(c.num_questions),
                     f"{c.candidate_accuracy * 100:.2f}", f"{c.reference_accuracy * 100:.2f}",
                     f"{c.difference * 100:+.2f}", f"{c.interval[0] * 100:+.2f} to {c.interval[1] * 100:+.2f}",
                     f"{c.mcnemar_p:.3g}", str(c.only_candidate), str(c.only_reference)])
    lines = [f"## {cand} against {ref} (same questions, paired)", "",
             f"Difference = {cand} - {ref}, in points. Interval: paired bootstrap, "
             f"{compared[0].comparison.confidence:.0%}, {compared[0].comparison.resamples} resamples, "
             f"seed {compared[0].comparison.seed}. McNemar: exact two-sided test on the questions only one "
             "model got right.", ""]
    lines += _table(["protocol", "score", "questions", f"{cand} %", f"{ref} %", "difference", "95% interval",
                     "McNemar p", f"only {cand} right", f"only {ref} right"], rows)
    return lines


def _fidelity_section(report: ValidationReport, fidelity: Fidelity) -> list[str]:
    rows = [["greedy token agreement", f"{fidelity.greedy_token_agreement * 100:.2f} %"],
            ["top-1 agreement of next-token logits", f"{fidelity.top1_agreement * 100:.2f} %"],
            ["mean KL divergence" + ("" if fidelity.kl_method == FULL_KL else f" ({fidelity.kl_method})"),
             f"{fidelity.mean_kl:.4g}"]]
    rows += [[f"top-{k} KL estimate, as from an endpoint (its bias: against the row above)", f"{value:.4g}"]
             for k, value in sorted(fidelity.topk_kl_estimates.items())]
    if fidelity.layer_cosine:
        worst = min(range(len(fidelity.layer_cosine)), key=fidelity.layer_cosine.__getitem__)
        mean = sum(fidelity.layer_cosine) / len(fidelity.layer_cosine)
        rows += [["per-layer output cosine, mean", f"{mean:.5f}"],
                 ["per-layer output cosine, lowest", f"{fidelity.layer_cosine[worst]:.5f} (layer {worst})"]]
    if fidelity.num_prompts is not None:
        rows.append(["prompts", str(fidelity.num_prompts)])
    if fidelity.num_tokens is not None:
        rows.append(["tokens compared", str(fidelity.num_tokens)])
    lines = [f"## Fidelity against {report.reference_label}", ""] + _table(["measure", "value"], rows)
    if fidelity.layer_cosine:
        lines += _table(["layer", "output cosine"],
                        [[str(i), f"{c:.5f}"] for i, c in enumerate(fidelity.layer_cosine)])
    return lines


_THROUGHPUT_COLUMNS = (
    ("prefill tok/s", "prefill_tokens_per_s", 1),
    ("decode tok/s", "decode_tokens_per_s", 1),
    ("time per output token ms", "time_per_output_token_ms", 2),
    ("output tok/s", "output_tokens_per_s", 1),
)


def _throughput_section(report: ValidationReport) -> list[str]:
    runs = report.throughput
    columns = [c for c in _THROUGHPUT_COLUMNS if any(getattr(r, c[1]) is not None for r in runs)]
    rows = [[r.label, "yes" if r.mtp else "no", str(r.batch_size)] + [_fmt(getattr(r, attr), d)
                                                                     for _, attr, d in columns] for r in runs]
    lines = ["## Throughput", "", f"Device: {report.device}.", ""]
    lines += _table(["run", "MTP", "batch"] + [name for name, _, _ in columns], rows)
    plain = next((r for r in runs if not r.mtp and r.decode_tokens_per_s), None)
    spec = next((r for r in runs if r.mtp and r.decode_tokens_per_s), None)
    if plain and spec:
        speedup = spec.decode_tokens_per_s / plain.decode_tokens_per_s
        lines += [f"Decode speed-up with MTP ({spec.label} over {plain.label}): {speedup:.2f}x", ""]
        if speedup < 1 and report.mtp is not None:
            lines += [_why_mtp_is_slower(report.mtp.mean_acceptance_length, speedup), ""]
    return lines


def _why_mtp_is_slower(mean_length: float, speedup: float) -> str:
    """Why an MTP run decoded slower than plain decoding, from what was measured: a round yields mean_length
    tokens in the time of mean_length / speedup plain decode steps."""
    return (f"MTP is slower here because a round - the drafts through the MTP head, one target forward verifying "
            f"them, the head catching up - took the time of {mean_length / speedup:.2f} plain decode steps and "
            f"yielded {mean_length:.2f} tokens (the mean acceptance length above). It pays where a round costs "
            f"less than it yields: on models large enough that verifying a few tokens at once costs little more "
            f"than decoding one, not on a model this small on this device.")


def _mtp_section(report: ValidationReport, mtp: MTPAcceptance) -> list[str]:
    lines = ["## MTP acceptance", "",
             f"Draft tokens per round: {mtp.num_speculative_tokens}. Mean acceptance length (accepted drafts + 1 "
             f"per round): {mtp.mean_acceptance_length:.2f}"
             + (f", over {mtp.num_rounds} rounds." if mtp.num_rounds is not None else "."), ""]
    ref = report.mtp_reference
    if ref is None:
        return lines + _table(["draft position", "acceptance rate"],
                              [[str(i + 1), f"{rate:.3f}"] for i, rate in enumerate(mtp.per_position)])
    lines += [f"{report.reference_label} on the same prompts: {ref.mean_acceptance_length:.2f} "
              f"(change {mtp.mean_acceptance_length - ref.mean_acceptance_length:+.3f}).", ""]
    rows = [[str(i + 1), f"{c:.3f}", f"{r:.3f}", f"{c - r:+.3f}"]
            for i, (c, r) in enumerate(zip(mtp.per_position, ref.per_position, strict=False))]
    return lines + _table(["draft position", report.candidate_label, report.reference_label, "change"], rows)


def _gates_section(gates: Sequence[Gate]) -> list[str]:
    failed = sum(not gate.passed for gate in gates)
    verdict = f"{failed} of {len(gates)} gate(s) FAILED." if failed else f"All {len(gates)} gate(s) passed."
    return ["## Gates", "", verdict, ""] + _table(
        ["gate", "result", "detail"],
        [[gate.name, "pass" if gate.passed else "FAIL", gate.detail.replace("|", "\\|")] for gate in gates])


# Failed questions listed one by one in report.md; report.json lists every one.
_FAILURES_SHOWN = 50


def _failed_questions_section(failed: Sequence[FailedQuestions]) -> list[str]:
    lines = ["## Failed questions", ""]
    for f in failed:
        if not f.errors:
            lines += [f"{f.label}: all {f.num_questions} questions answered.", ""]
            continue
        lines += [f"{f.label}: **{len(f.errors)} of {f.num_questions} questions FAILED** (no usable answer; "
                  f"scored as wrong, so the accuracy below is a lower bound and the gate fails): questions "
                  f"{', '.join(map(str, f.questions))}.", ""]
        shown = f.questions[:_FAILURES_SHOWN]
        lines += _table(["question", "error"], [[str(i), f.errors[i].replace("|", "\\|")] for i in shown])
        if len(f.errors) > len(shown):
            lines += [f"{len(f.errors) - len(shown)} more in report.json.", ""]
    return lines


def render_markdown(report: ValidationReport, plots: Sequence[Path] = ()) -> str:
    """report.md: the tables a person reads, then the plots."""
    versions = library_versions()
    lines = ["# npuport validation report", "", f"- artifact: `{report.artifact}`"]
    if report.artifact_checksum:
        lines.append(f"- checksum: `{report.artifact_checksum}`")
    lines += [f"- device: {report.device}", f"- seed: {report.seed}",
              "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v is not None)]
    if report.dtypes:
        lines.append("- dtypes: " + ", ".join(f"{k} {v}" for k, v in report.dtypes.items()))
    for key, value in report.settings.items():
        lines.append(f"- {key}: {value}")
    lines.append("")
    if report.gates:
        lines += _gates_section(report.gates)
    if report.failed_questions:
        lines += _failed_questions_section(report.failed_questions)
    if report.accuracy:
        lines += _accuracy_section(report) + _comparison_section(report)
    if report.fidelity is not None:
        lines += _fidelity_section(report, report.fidelity)
    if report.throughput:
        lines += _throughput_section(report)
    if report.mtp is not None:
        lines += _mtp_section(report, report.mtp)
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Plots (matplotlib's Agg canvas; pyplot's global state is never touched)


def _new_figure(width: float = 6.4, height: float = 4.0) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def plot_accuracy(report: ValidationReport, path: Path) -> Path:
    """Headline accuracy per protocol with its 95% interval, candidate next to reference."""
    figure = _new_figure()
    axes = figure.add_subplot()
    series = [(report.candidate_label, [row.candidate for row in report.accuracy])]
    if any(row.reference is not None for row in report.accuracy):
        series.append((report.reference_label, [row.reference for row in report.accuracy]))
    spread = 0.3 / len(series)
    for s, (label, results) in enumerate(series):
        xs, heights, below, above = [], [], [], []
        for i, result in enumerate(results):
            if result is None:
                continue
            low, high = wilson_interval(result.correct, DEFAULT_CONFIDENCE)
            xs.append(i + (s - (len(series) - 1) / 2) * spread)
            heights.append(result.accuracy * 100)
            below.append((result.accuracy - low) * 100)
            above.append((high - result.accuracy) * 100)
        axes.errorbar(xs, heights, yerr=[below, above], fmt="o", capsize=5, label=label)
    axes.set_xticks(range(len(report.accuracy)),
                    [f"{row.candidate.protocol}\n{row.candidate.scores[0].name}" for row in report.accuracy])
    axes.set_ylabel("GSM8K accuracy % (95% interval)")
    axes.set_xlim(-0.5, len(report.accuracy) - 0.5)
    axes.legend()
    figure.savefig(path, dpi=120)
    return path


def plot_acceptance(mtp: MTPAcceptance, path: Path) -> Path:
    """Acceptance rate of each MTP draft position."""
    figure = _new_figure()
    axes = figure.add_subplot()
    positions = list(range(1, len(mtp.per_position) + 1))
    axes.bar(positions, mtp.per_position)
    axes.set_xticks(positions)
    axes.set_xlabel("draft position")
    axes.set_ylabel("acceptance rate")
    axes.set_ylim(0, 1)
    axes.set_title(f"MTP acceptance (mean acceptance length {mtp.mean_acceptance_length:.2f})")
    figure.savefig(path, dpi=120)
    return path


def plot_throughput(runs: Sequence[ThroughputRun], path: Path) -> Path | None:
    """Decode tokens/s (else output tokens/s) of each run, with MTP and without; None if no run has either."""
    measured = [(r, r.decode_tokens_per_s if r.decode_tokens_per_s is not None else r.output_tokens_per_s)
                for r in runs]
    measured = [(r, v) for r, v in measured if v is not None]
    if not measured:
        return None
    figure = _new_figure()
    axes = figure.add_subplot()
    axes.bar(range(len(measured)), [v for _, v in measured],
             color=["tab:orange" if r.mtp else "tab:blue" for r, _ in measured])
    axes.set_xticks(range(len(measured)), [f"{r.label}\n(batch {r.batch_size})" for r, _ in measured])
    axes.set_ylabel("tokens/s (decode, else output)")
    axes.set_title("Throughput with (orange) and without (blue) MTP")
    figure.savefig(path, dpi=120)
    return path


# ---------------------------------------------------------------------------------------------------------


def write_report(report: ValidationReport, out_dir: str | Path) -> ReportFiles:
    """Write report.json, the plots and report.md into `out_dir` (created if needed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots: list[Path] = []
    if report.accuracy:
        plots.append(plot_accuracy(report, out / "accuracy.png"))
    if report.mtp is not None and report.mtp.per_position:
        plots.append(plot_acceptance(report.mtp, out / "mtp_acceptance.png"))
    if report.throughput:
        throughput_plot = plot_throughput(report.throughput, out / "throughput.png")
        if throughput_plot is not None:
            plots.append(throughput_plot)
    json_path = out / "report.json"
    json_path.write_text(json.dumps(report_dict(report), indent=2) + "\n", encoding="utf-8")
    md_path = out / "report.md"
    md_path.write_text(render_markdown(report, plots), encoding="utf-8")
    return ReportFiles(json_path, md_path, plots)
