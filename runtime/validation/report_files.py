"""The validation report's files in a folder: report.json, the plots and report.md."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from npuport.runtime.validation.report import ValidationReport, report_dict
from npuport.runtime.validation.report_markdown import render_markdown
from npuport.runtime.validation.report_plots import plot_acceptance, plot_accuracy, plot_throughput


@dataclass(frozen=True)
class ReportFiles:
    json: Path
    markdown: Path
    plots: list[Path]


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
