"""The validation report's PNG plots: accuracy with its intervals, MTP acceptance per draft position, throughput
with and without MTP, one axis per measure (matplotlib's Agg canvas; pyplot's global state is never touched)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from npuport.runtime.validation.paired_stats import DEFAULT_CONFIDENCE, wilson_interval
from npuport.runtime.validation.report import (
    THROUGHPUT_COLUMNS,
    MTPAcceptance,
    ThroughputRun,
    ValidationReport,
    throughput_differences,
)


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
    axes.set_ylabel(f"{report.settings.get('questions_name', 'GSM8K')} accuracy % (95% interval)")
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


_TICK_WIDTH = 18  # characters per line of a run's name under its bar
_NOTE_WIDTH = 70  # characters per line of a noise note under an axis

# The rates plotted, one axis each (time per output token is the decode rate's inverse: not plotted again)
PLOTTED_RATES = ("prefill_tokens_per_s", "decode_tokens_per_s", "output_tokens_per_s")


def _error_bar(run: ThroughputRun, figure: str, value: float) -> tuple[float, float]:
    """Below and above `value`: its range over the repeats (an unbounded upper end drawn to twice the value)."""
    low, high = run.ranges.get(figure, [value, value]) if run.repeats > 1 else [value, value]
    return value - (0.0 if low is None else low), (2 * value if high is None else high) - value


def plot_throughput(runs: Sequence[ThroughputRun], path: Path) -> Path | None:
    """throughput_figure(runs) as a PNG at `path`; None if no run has any of the rates."""
    figure = throughput_figure(runs)
    if figure is None:
        return None
    figure.savefig(path, dpi=120)
    return path


def throughput_figure(runs: Sequence[ThroughputRun]) -> Any | None:
    """One axis per rate (prefill, decode, output tokens/s), each labelled with its measure: a bar per run, its
    range over the repeats as the error bar, and under the axis each difference there that timing noise can
    explain, in words. None if no run has any of the rates."""
    measures = [f for f in PLOTTED_RATES if any(getattr(r, f) is not None for r in runs)]
    if not measures:
        return None
    names = {attr: name for name, attr, _ in THROUGHPUT_COLUMNS}
    noisy = [d for d in throughput_differences(list(runs)) if d.within_noise]
    notes = {m: [textwrap.fill(f"{d.run} vs {d.baseline}: {d.noise_words()}", _NOTE_WIDTH)
                 for d in noisy if d.figure == m] for m in measures}
    note_lines = max(sum(n.count("\n") + 1 for n in notes[m]) for m in measures)
    figure = _new_figure(width=4.2 * len(measures), height=4.6 + 0.12 * note_lines)
    for i, measure in enumerate(measures):
        axes = figure.add_subplot(1, len(measures), i + 1)
        measured = [(r, getattr(r, measure)) for r in runs if getattr(r, measure) is not None]
        bars = [_error_bar(r, measure, v) for r, v in measured]
        axes.bar(range(len(measured)), [v for _, v in measured],
                 yerr=[[b for b, _ in bars], [a for _, a in bars]], capsize=4,
                 color=["tab:orange" if r.mtp else "tab:blue" for r, _ in measured])
        axes.set_xticks(range(len(measured)), [textwrap.fill(f"{r.label} (batch {r.batch_size})", _TICK_WIDTH)
                                               for r, _ in measured], fontsize=6)
        axes.set_ylabel(names[measure])
        axes.set_title(f"{names[measure]} (orange: MTP on)", fontsize=9)
        if notes[measure]:
            axes.set_xlabel("\n".join(notes[measure]), fontsize=6, color="tab:red")
    return figure
