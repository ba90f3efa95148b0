"""report.md: the validation report's tables a person reads - gates, failed questions, accuracy on the question set
(named as the report names it) and the paired comparison, fidelity, throughput, MTP acceptance - then its plots."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from npuport.runtime.validation.determinism import determinism_markdown
from npuport.runtime.validation.gsm8k_results import Score
from npuport.runtime.validation.paired_stats import DEFAULT_CONFIDENCE, wilson_interval
from npuport.runtime.validation.report import (
    FULL_KL,
    THROUGHPUT_COLUMNS,
    FailedQuestions,
    Fidelity,
    Gate,
    MTPAcceptance,
    ThroughputRun,
    ValidationReport,
    library_versions,
    mtp_speedups,
    throughput_differences,
)

MISSING = "–"
VALIDATION_DOC = "data/VALIDATION.md"  # inside the npuport package; docs/VALIDATION.md in the repository links to it
VALIDATION_REFERENCE = (f"VALIDATION.md (`npuport/{VALIDATION_DOC}` in the installed npuport package, "
                        "`docs/VALIDATION.md` in its repository)")


def _fmt(value: float | int | None, digits: int = 2) -> str:
    if value is None:
        return MISSING
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
                cells += [MISSING, MISSING]
            rows.append(cells)
    questions = report.settings.get("questions_name", "GSM8K")
    lines = [f"## {questions} accuracy", "", f"Intervals: Wilson, 95%. The protocols follow {VALIDATION_REFERENCE}; "
             "the headline score of each protocol is its first row.", ""]
    lines += _table(header, rows)

    timed = [(label, r) for row in report.accuracy for label, r in ((cand, row.candidate), (ref, row.reference))
             if r is not None and r.latency_s is not None]
    if timed:
        lines += [f"### {questions} generation", ""]
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


_COLUMN = {attr: (name, digits) for name, attr, digits in THROUGHPUT_COLUMNS}

# Said under a CPU run's throughput: what its figures cannot show, and where the accelerator figures are.
CPU_THROUGHPUT_NOTE = (
    "On a CPU these figures do not show what W8A8 and MTP buy: both gains are properties of accelerators - W8A8 "
    "of int8 matrix units that multiply int8 faster than BF16, MTP of memory-bound decode, where verifying several "
    "tokens costs about one read of the weights - while a CPU without int8 matrix units emulates the int8 GEMMs and "
    "its decode is compute-bound; the figures measured on GPUs are in bench/RESULTS.md of npuport's repository.")


def _bound(value: float | None, digits: int) -> str:
    return "unbounded" if value is None else f"{value:.{digits}f}"


def _figure_cell(run: ThroughputRun, attr: str) -> str:
    """The figure, and in brackets its lowest and highest over the repeats when there were several."""
    digits = _COLUMN[attr][1]
    value, bounds = getattr(run, attr), run.ranges.get(attr)
    if value is None or bounds is None or run.repeats < 2:
        return _fmt(value, digits)
    return f"{value:.{digits}f} ({_bound(bounds[0], digits)}–{_bound(bounds[1], digits)})"


def _speedup_lines(report: ValidationReport) -> list[str]:
    """Each model's decode speed-up with MTP over its own decode without, its noise verdict, and why a slower one
    is slower (from that model's acceptance)."""
    speedups = mtp_speedups(report.throughput)
    if not speedups:
        return []
    acceptance = {report.candidate_label: report.mtp, report.reference_label: report.mtp_reference}
    lines = ["Decode speed-up with MTP, each model over itself without MTP (never over another model):", ""]
    slower = []
    for s in speedups:
        k = "" if s.num_speculative_tokens is None else f" k={s.num_speculative_tokens}"
        if s.ratio is None:
            lines.append(f"- {s.model}, MTP{k}: not given: {s.reason}.")
            continue
        noise = f" ({s.difference.noise_words()} tok/s)" if s.difference is not None else ""
        lines.append(f"- {s.model}, MTP{k} over no MTP: {s.ratio:.2f}x{noise}")
        mtp = acceptance.get(s.model)
        if s.ratio < 1 and mtp is not None and not (s.difference is not None and s.difference.within_noise):
            slower.append(_why_mtp_is_slower(mtp.mean_acceptance_length, s.ratio))
    return lines + [""] + [line for why in slower for line in (why, "")]


def _differences_lines(runs: Sequence[ThroughputRun]) -> list[str]:
    differences = throughput_differences(list(runs))
    if not differences:
        return []
    rows = []
    for d in differences:
        name, digits = _COLUMN[d.figure]
        spread = (MISSING if d.spread is None else "unbounded" if math.isinf(d.spread)
                  else f"{d.spread:.{digits}f}")
        verdict = MISSING if d.spread is None else "within noise" if d.within_noise else "beyond noise"
        rows.append([name, d.run, d.baseline, f"{d.value:.{digits}f}", f"{d.baseline_value:.{digits}f}",
                     f"{d.difference:+.{digits}f}", spread, verdict])
    return ["### Differences and timing noise", "",
            "Runs that differ in one thing only: a model with MTP against itself without, or a model against the "
            "first one timed with the same MTP setting. Spread: the larger of the two runs' (highest - lowest over "
            "the repeats); a difference smaller than it is within noise and shows nothing.", ""] + _table(
        ["measure", "run", "against", "run's", "against's", "difference", "spread", "verdict"], rows)


def _throughput_section(report: ValidationReport) -> list[str]:
    runs = report.throughput
    columns = [c for c in THROUGHPUT_COLUMNS if any(getattr(r, c[1]) is not None for r in runs)]
    rows = [[r.label, "yes" if r.mtp else "no", str(r.batch_size)] + [_figure_cell(r, attr) for _, attr, _ in columns]
            for r in runs]
    lines = ["## Throughput", "", f"Device: {report.device}.", ""]
    if report.device.lower().startswith("cpu"):
        lines += [CPU_THROUGHPUT_NOTE, ""]
    repeats = max(r.repeats for r in runs)
    if repeats > 1:
        lines += [f"Each run timed {repeats} times (a one-token call, then the full call); in brackets each "
                  "figure's lowest and highest over those repeats.", ""]
    lines += _table(["run", "MTP", "batch"] + [name for name, _, _ in columns], rows)
    return lines + _speedup_lines(report) + _differences_lines(runs)


def _why_mtp_is_slower(mean_length: float, speedup: float) -> str:
    """Why an MTP run decoded slower than plain decoding, from what was measured: a round yields mean_length
    tokens in the time of mean_length / speedup plain decode steps."""
    return (f"MTP is slower here because a round - the drafts through the MTP head, one target forward verifying "
            f"them, the head catching up - took the time of {mean_length / speedup:.2f} plain decode steps and "
            f"yielded {mean_length:.2f} tokens (the mean acceptance length below). It pays where a round costs "
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
    if report.determinism is not None:
        lines += determinism_markdown(report.determinism)
    if report.fidelity is not None:
        lines += _fidelity_section(report, report.fidelity)
    if report.throughput:
        lines += _throughput_section(report)
    if report.mtp is not None:
        lines += _mtp_section(report, report.mtp)
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    return "\n".join(lines)
