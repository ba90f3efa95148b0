"""The model card's table of measured results, in both directions: rows built from a report.json, rendered
as Markdown, and parsed back out of a card so that every figure and every label in it can be checked against the
report. The labels say what ran: the question set by the name the report gives it (never "GSM8K" for other
questions), and speed figures measured on a CPU marked ON_CPU, with the notes (speed_notes) that say what they
cannot show and whether timing noise explains their differences."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from npuport.jsonfile import JSONFieldError, JSONFields
from npuport.runtime.validation.report import FULL_KL, THROUGHPUT_COLUMNS
from npuport.runtime.validation.report_markdown import CPU_THROUGHPUT_NOTE

HEADING = "## Measured results"
MISSING = "–"
FIXED_COLUMNS = ("measure", "protocol", "questions")
DIFFERENCE_COLUMN = "difference"
ON_CPU = "on CPU"  # the suffix of a speed figure's label when the report's device is a CPU
UNNAMED_SET = "questions (set not recorded)"  # a report that does not name its question set
CPU_SPEED_MARK = f"Speed figures marked '{ON_CPU}'"  # opens the card's note under a CPU report's table


@dataclass(frozen=True)
class ResultRow:
    """One measured figure for the candidate, with the reference's and the difference where measured.
    `fmt` is the format spec of all three figures (the difference gets a sign)."""

    measure: str
    protocol: str
    questions: int | None
    candidate: float | None
    reference: float | None = None
    difference: float | None = None
    fmt: str = ".2f"

    @property
    def key(self) -> tuple[str, str]:
        return self.measure, self.protocol

    def figures(self) -> list[tuple[float | None, str]]:
        """(value, format spec) of the candidate, reference and difference cells."""
        return [(self.candidate, self.fmt), (self.reference, self.fmt), (self.difference, "+" + self.fmt)]


def _fmt(value: float | int | None, spec: str = "d") -> str:
    return MISSING if value is None else format(value, spec)


def model_labels(report: dict[str, Any]) -> tuple[str, str]:
    """The names of the candidate and the reference model in a report ("W8A8", "BF16" unless it says)."""
    labels = JSONFields(report).object("labels", optional=True)
    if labels is None:
        return "W8A8", "BF16"
    candidate, reference = labels.text("candidate", optional=True), labels.text("reference", optional=True)
    return "W8A8" if candidate is None else candidate, "BF16" if reference is None else reference


def questions_label(report: dict[str, Any]) -> str:
    """The name of the question set the report's accuracy was measured on (settings.questions_name, as validate
    records it: "GSM8K", "arithmetic (GSM8K format)"...)."""
    settings = JSONFields(report).object("settings", optional=True)
    name = settings.text("questions_name", optional=True) if settings is not None else None
    return UNNAMED_SET if name is None else name


def on_cpu(report: dict[str, Any]) -> bool:
    """Whether the report's figures were measured on a CPU (its device line, as validate writes it: "cpu (...)")."""
    device = JSONFields(report).text("device", optional=True)
    return device is not None and device.lower().startswith("cpu")


def _speed(name: str, report: dict[str, Any]) -> str:
    return f"{name} {ON_CPU}" if on_cpu(report) else name


def header(report: dict[str, Any]) -> list[str]:
    return [*FIXED_COLUMNS, *model_labels(report), DIFFERENCE_COLUMN]


def _gsm8k_rows(entry: JSONFields, report: dict[str, Any]) -> list[ResultRow]:
    questions = questions_label(report)
    cand, ref = entry.object("candidate"), entry.object("reference", optional=True)
    seed = cand.integer("seed", optional=True)
    protocol = f"{entry.text('protocol')}, {cand.integer('shots')}-shot" + (f", seed {seed}" if seed is not None
                                                                            else "")
    n = cand.integer("num_questions")
    scores, ref_scores = cand.objects("scores"), ref.objects("scores") if ref else []
    if ref and len(ref_scores) != len(scores):
        raise JSONFieldError(f"{ref.path('scores')} has {len(ref_scores)} entries, {cand.path('scores')} "
                             f"{len(scores)}")
    rows = []
    for i, score in enumerate(scores):
        c = score.number("accuracy") * 100
        r = ref_scores[i].number("accuracy") * 100 if ref else None
        rows.append(ResultRow(f"{questions} accuracy % ({score.text('name')})", protocol, n, c, r,
                              None if r is None else c - r))
    rows.append(ResultRow(f"{questions} invalid %", protocol, n, cand.number("invalid_rate") * 100,
                          ref.number("invalid_rate") * 100 if ref else None))
    cand_tps = cand.number("output_throughput", optional=True)
    ref_tps = ref.number("output_throughput", optional=True) if ref else None
    if cand_tps is not None or ref_tps is not None:
        rows.append(ResultRow(_speed(f"{questions} output tok/s", report), protocol, n, cand_tps, ref_tps,
                              fmt=".1f"))
    return rows


def _fidelity_rows(fidelity: JSONFields, reference: str) -> list[ResultRow]:
    prompts = fidelity.integer("num_prompts", optional=True)
    protocol = f"vs {reference}" + (f", {prompts} prompts" if prompts else "")
    kl_method = fidelity.text("kl_method", optional=True)
    rows = [ResultRow("greedy token agreement %", protocol, None, fidelity.number("greedy_token_agreement") * 100),
            ResultRow("top-1 agreement of next-token logits %", protocol, None,
                      fidelity.number("top1_agreement") * 100),
            ResultRow("mean KL divergence" + ("" if kl_method in (None, FULL_KL) else f" ({kl_method})"),
                      protocol, None, fidelity.number("mean_kl"), fmt=".4g")]
    cosines = fidelity.numbers("layer_cosine", optional=True)
    if cosines:
        rows.append(ResultRow("lowest per-layer output cosine", protocol, None, min(cosines), fmt=".5f"))
    return rows


def _throughput_rows(run: JSONFields, report: dict[str, Any]) -> list[ResultRow]:
    protocol = f"{run.text('label')}, MTP {'on' if run.flag('mtp') else 'off'}, batch {run.integer('batch_size')}"
    figures = [(name, run.number(attr, optional=True), digits) for name, attr, digits in THROUGHPUT_COLUMNS]
    return [ResultRow(_speed(name, report), protocol, None, value, fmt=f".{digits}f")
            for name, value, digits in figures if value is not None]


def _mtp_rows(mtp: JSONFields) -> list[ResultRow]:
    rounds = mtp.integer("num_rounds", optional=True)
    protocol = f"k={mtp.integer('num_speculative_tokens')}" + (f", {rounds} rounds" if rounds else "")
    rows = [ResultRow("MTP mean acceptance length", protocol, None, mtp.number("mean_acceptance_length"))]
    rows += [ResultRow(f"MTP acceptance rate, draft position {i}", protocol, None, rate, fmt=".3f")
             for i, rate in enumerate(mtp.numbers("per_position"), start=1)]
    return rows


def result_rows(report: dict[str, Any]) -> list[ResultRow]:
    """Every headline figure of a report.json, one row each, with a unique (measure, protocol) key. A figure (or
    what names it) that is missing or of the wrong type is a JSONFieldError naming the field."""
    fields = JSONFields(report)
    reference = model_labels(report)[1]
    rows: list[ResultRow] = []
    for entry in fields.objects("gsm8k", optional=True):
        rows += _gsm8k_rows(entry, report)
    if report.get("fidelity"):
        rows += _fidelity_rows(fields.object("fidelity"), reference)
    for run in fields.objects("throughput", optional=True):
        rows += _throughput_rows(run, report)
    if report.get("mtp"):
        rows += _mtp_rows(fields.object("mtp"))
    seen: dict[tuple[str, str], int] = {}
    unique = []
    for row in rows:  # the same protocol run twice: number the repeats so each row keeps its own key
        seen[row.key] = seen.get(row.key, 0) + 1
        if seen[row.key] > 1:
            row = replace(row, protocol=f"{row.protocol} #{seen[row.key]}")
        unique.append(row)
    return unique


def render_results_table(report: dict[str, Any]) -> list[str]:
    """The Markdown table of `result_rows(report)` (lines, ending with a blank one)."""
    lines = ["| " + " | ".join(header(report)) + " |", "|" + "---|" * len(header(report))]
    for row in result_rows(report):
        cells = [row.measure, row.protocol, _fmt(row.questions)] + [_fmt(v, spec) for v, spec in row.figures()]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def speed_notes(report: dict[str, Any]) -> list[str]:
    """Under the table of a report measured on a CPU that has speed figures: what they cannot show, and each
    difference between runs with the report's verdict on timing noise (lines, ending with a blank one; none
    otherwise)."""
    fields = JSONFields(report)
    if not on_cpu(report) or not any(r.measure.endswith(ON_CPU) for r in result_rows(report)):
        return []
    lines = [f"{CPU_SPEED_MARK} were measured on a CPU ({fields.text('device')}), not on an accelerator. "
             + CPU_THROUGHPUT_NOTE, ""]
    names = {attr: (name, digits) for name, attr, digits in THROUGHPUT_COLUMNS}
    verdicts = []
    for d in fields.objects("throughput_differences", optional=True):
        figure = d.text("figure")
        name, digits = names.get(figure, (figure, 1))
        spread = d.number("spread", optional=True)
        unbounded = d.flag("spread_unbounded", optional=True) is True
        difference = d.number("difference")
        if spread is None and not unbounded:
            verdict = "spread unknown (timed once): not told from timing noise"
        else:
            shown = "unbounded" if spread is None else f"{spread:.{digits}f}"
            verdict = (f"{'within' if d.flag('within_noise') else 'beyond'} timing noise (spread over the repeats "
                       f"{shown})")
        verdicts.append(f"- {name} {ON_CPU}, {d.text('run')} against {d.text('baseline')}: "
                        f"{difference:+.{digits}f}, {verdict}")
    if verdicts:
        lines += ["Differences between these runs, and whether timing noise explains them (validation/report.md, "
                  "\"Differences and timing noise\"):", ""] + verdicts + [""]
    return lines


def parse_results_table(markdown: str) -> list[list[str]] | None:
    """The cells of the first table under HEADING (header row first, separator dropped); None if there is none."""
    lines = markdown.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == HEADING)
    except StopIteration:
        return None
    table: list[list[str]] = []
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif table:
            break
    if not table:
        return None
    return [table[0]] + [row for row in table[1:] if not all(set(c) <= set("-: ") for c in row)]


def _number_problem(where: str, cell: str, value: float | int | None, spec: str) -> str | None:
    expected = _fmt(value, spec)
    if value is None:
        return None if cell == MISSING else f"{where}: the card says {cell}, report.json has no figure"
    try:
        same = float(cell) == float(expected)
    except ValueError:
        same = False
    return None if same else f"{where}: the card says {cell}, report.json says {expected}"


def compare_results(markdown: str, report: dict[str, Any], card_name: str = "README.md") -> list[str]:
    """Each difference between the card's results table and the figures of `report` (empty when they agree)."""
    table = parse_results_table(markdown)
    expected = result_rows(report)
    if table is None:
        return [f"{card_name}: no results table under '{HEADING}', report.json has {len(expected)} figure row(s)"] \
            if expected else []
    head, body = table[0], table[1:]
    if head != header(report):
        return [f"{card_name}: results table columns {head} differ from {header(report)}"]
    problems = []
    found: dict[tuple[str, str], list[str]] = {}
    for cells in body:
        if len(cells) != len(head):
            problems.append(f"{card_name}: results row {cells[:2]} has {len(cells)} cells, not {len(head)}")
        elif (cells[0], cells[1]) in found:
            problems.append(f"{card_name}: results row {cells[0]!r} ({cells[1]}) appears twice")
        else:
            found[(cells[0], cells[1])] = cells
    for row in expected:
        cells = found.pop(row.key, None)
        if cells is None:
            problems.append(f"{card_name}: results table lacks {row.measure!r} ({row.protocol}) from report.json")
            continue
        checks = [("questions", cells[2], row.questions, "d")]
        checks += [(col, cell, v, spec)
                   for col, cell, (v, spec) in zip(head[3:], cells[3:], row.figures(), strict=True)]
        for column, cell, value, spec in checks:
            problem = _number_problem(f"{card_name}: {row.measure!r} ({row.protocol}), {column}", cell, value, spec)
            if problem:
                problems.append(problem)
    for measure, protocol in found:
        problems.append(f"{card_name}: results row {measure!r} ({protocol}) is not in report.json")
    return problems
