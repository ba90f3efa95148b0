"""The validation report's PNG plots: accuracy with its intervals, MTP acceptance per draft position, throughput
with and without MTP (matplotlib's Agg canvas; pyplot's global state is never touched)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from npuport.runtime.validation.paired_stats import DEFAULT_CONFIDENCE, wilson_interval
from npuport.runtime.validation.report import MTPAcceptance, ThroughputRun, ValidationReport


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
