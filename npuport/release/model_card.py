"""The release's README.md: a model card with YAML front matter, what was quantized and what was kept BF16
and why, the measured results copied from the validation report, serving commands, and how it was made."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from npuport import __version__
from npuport.convert.engine_facts import facts_for
from npuport.convert.qwen35_names import layer_kinds, split_param
from npuport.convert.recipe import QUANTIZED, W4A8_DYNAMIC, W8A8_DYNAMIC
from npuport.errors import NpuportError
from npuport.jsonfile import JSONFieldError, JSONFields, read_json_object
from npuport.release.results_table import HEADING as RESULTS_HEADING
from npuport.release.results_table import (
    model_labels,
    questions_label,
    render_results_table,
    result_rows,
    speed_notes,
)
from npuport.runtime.validation.command_line import renamed_command
from npuport.runtime.validation.gsm8k import PROTOCOLS

FORCED_MARK = "WARNING: packaged with --force"
TAGS = ("npuport", "w8a8", "int8", "msmodelslim", "ascend", "vllm-ascend", "sglang", "mtp")
SHORT_CHECKSUM = 12  # hex digits of a checksum shown in messages and on the card
VERIFY_PROVES = ("`npuport verify-release` proves that every file is the one packaged (`SHA256SUMS`), that the "
                 "report's figures were measured on these weights and configs (the `artifact_checksum` it records, "
                 "recomputed from the files), that this card states those figures, that the folder meets the "
                 "checkpoint contract and names no file outside itself, and that it holds no code.")
VERIFY_CANNOT_PROVE = ("It cannot prove who made the release: whoever can change the weights can rewrite "
                       "`SHA256SUMS`, the report and this card to match. Only a signature over `SHA256SUMS` with a "
                       "key you trust ties the release to its publisher.")

# CONTRACT.md, "Serving an artifact": the MTP head drafts k tokens (the card's k is the validation report's);
# sglang runs it unquantized.
VLLM_ASCEND_COMMAND = ("vllm serve {model} --quantization ascend "
                       "--speculative-config '{{\"method\":\"qwen3_5_mtp\",\"num_speculative_tokens\":{k}}}'")
SGLANG_COMMAND = ("python -m sglang.launch_server --model-path {model} --device npu --attention-backend ascend "
                  "--quantization modelslim --speculative-algorithm NEXTN --speculative-num-steps {k} "
                  "--speculative-eagle-topk 1 --speculative-num-draft-tokens {k_plus_1} "
                  "--speculative-draft-model-quantization unquant")


@dataclass
class CardFacts:
    """Everything the card states, gathered by the packager; nothing in the card comes from elsewhere."""

    release_name: str
    artifact_name: str
    base_model: str
    license_id: str
    license_file: str | None
    manifest: dict[str, Any]
    description: dict[str, Any]
    recipe_file: str
    package_command: str
    packaged_on: str
    files: dict[str, int]  # relative path -> bytes
    report: dict[str, Any] | None = None
    report_date: str | None = None
    report_files: list[str] = field(default_factory=list)  # relative paths of report.md and the plots
    forced_problems: list[str] = field(default_factory=list)
    artifact_checksum: str | None = None  # the report's artifact_checksum, checked equal to the artifact's
    report_dir: str = "validation"  # the name of the folder validate wrote the report to (package's --report)


def read_manifest(path: Path, error: type[NpuportError] = NpuportError) -> dict[str, Any]:
    """An artifact's npuport_manifest.json, each field the card states checked for type: `error` names the file and
    the field, before anything is copied."""
    manifest = read_json_object(path, error)
    try:
        fields = JSONFields(manifest)
        source = fields.object("source", optional=True) or JSONFields({}, "source")
        recipe = fields.object("recipe", optional=True) or JSONFields({}, "recipe")
        for part, key in [(fields, "scheme"), (fields, "command"), (fields, "version"), (source, "name"),
                          (source, "model_type"), (recipe, "name"), (recipe, "file")]:
            part.text(key, optional=True)
        recipe.texts("notes", optional=True)
        for entry in fields.objects("ignore_list", optional=True):
            entry.text("module")
            entry.text("reason")
    except JSONFieldError as e:
        raise error(f"{path}: {e}") from None
    return manifest


def check_report(report: dict[str, Any], path: Path, error: type[NpuportError] = NpuportError) -> None:
    """Each field of a validation report that the card states has the type the card needs - the figures and their
    labels, the npuport version, the gates' details - else `error` naming the file and the field."""
    try:
        result_rows(report)
        speed_notes(report)
        fields = JSONFields(report)
        (fields.object("settings", optional=True) or JSONFields({}, "settings")).text("command", optional=True)
        (fields.object("versions", optional=True) or JSONFields({}, "versions")).text("npuport", optional=True)
        for gate in fields.objects("gates", optional=True):
            gate.text("detail", optional=True)
    except JSONFieldError as e:
        raise error(f"{path}: {e}") from None


def short_checksum(value: str) -> str:
    """A checksum cut to SHORT_CHECKSUM characters for a one-line message (control characters escaped)."""
    text = value[:SHORT_CHECKSUM].encode("unicode_escape").decode("ascii")
    return text + ("..." if len(value) > SHORT_CHECKSUM else "")


def license_id(text: str | None) -> str:
    """The Hugging Face license identifier of a LICENSE text: apache-2.0, mit, other; unknown without one."""
    if text is None:
        return "unknown"
    if "Apache License" in text and "Version 2.0" in text:
        return "apache-2.0"
    if "MIT License" in text or "Permission is hereby granted, free of charge" in text:
        return "mit"
    return "other"


def _pattern_list(modules: list[str]) -> str:
    return ", ".join(f"`{p}` ({n})" if n > 1 else f"`{p}`" for p, n in layer_kinds(modules).items())


def _front_matter(facts: CardFacts) -> list[str]:
    model_type = (facts.manifest.get("source") or {}).get("model_type")
    meta: dict[str, Any] = {"license": facts.license_id}
    if facts.license_id == "other" and facts.license_file:
        meta.update({"license_name": "base-model-license", "license_link": facts.license_file})
    meta.update({"base_model": facts.base_model, "base_model_relation": "quantized",
                 "tags": [*TAGS, *([model_type] if model_type else [])]})
    return ["---", yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip(), "---", ""]


def _forced_warning(problems: list[str]) -> list[str]:
    if not problems:
        return []
    return [f"> **{FORCED_MARK}.** This release failed the checks below; do not publish or quote it as is.", ">"] \
        + [f"> - {markdown_text(p)}" for p in problems] + [""]


# What the tensors of a quantized layer hold, by its label
SCHEME_TENSORS = {
    W8A8_DYNAMIC: "int8 weight, float32 per-channel scale, zero offset",
    W4A8_DYNAMIC: "int4 weight packed two to a byte along the output channels, float32 per-channel scale, zero "
                  "offset, and the scale_bias msModelSlim's NPU kernels read",
}


def _intro(facts: CardFacts) -> list[str]:
    scheme = facts.manifest.get("scheme", W8A8_DYNAMIC)
    return [f"# {facts.base_model}, {scheme} for Ascend NPUs", "",
            f"Release `{facts.release_name}`, packaged by npuport from the artifact `{facts.artifact_name}`.", "",
            f"{scheme} quantization of `{facts.base_model}` for Ascend NPUs, in msModelSlim's ascendV1 format: "
            + ("int4 routed-expert weights (two to a byte, one scale per output channel, found by msModelSlim's ssz "
               "search) and int8 weights elsewhere, " if scheme == W4A8_DYNAMIC else "int8 weights ")
            + "with one scale per output channel, int8 activations with one scale per token computed "
            "at run time. The multi-token-prediction head (`mtp.*`) stays BF16, so speculative decoding with it "
            "works unchanged. vllm-ascend (`--quantization ascend`) and sglang (`--quantization modelslim`) load "
            "msModelSlim's format; `npuport check` and the serving section below say which releases load this "
            "folder.", ""]


def _results(facts: CardFacts) -> list[str]:
    lines = [RESULTS_HEADING, ""]
    report = facts.report
    if report is None:
        return lines + ["No validation report was packaged with this release: nothing here is measured.", ""]
    lines += [f"Questions: {markdown_text(questions_label(report))}.", ""]
    lines += render_results_table(report)
    cand, ref = model_labels(report)
    version = (report.get("versions") or {}).get("npuport")
    lines += [f"Measured by npuport {version} on {report.get('device')}, seed {report.get('seed')}; report written "
              f"{facts.report_date}. Accuracy is the share of questions answered correctly, in percent; "
              f"difference = {cand} - {ref} in points, on the same questions. The protocol column names the harness "
              "whose GSM8K prompt, stop strings and answer extraction were followed "
              f"({', '.join(PROTOCOLS)}) and its shots; intervals, paired tests and per-layer figures are in "
              "[validation/report.md](validation/report.md), every raw figure in `validation/report.json`.", ""]
    lines += speed_notes(report)
    lines += [_binding(facts), ""]
    gates = report.get("gates") or []
    failed = sum(not g["passed"] for g in gates)
    if gates:
        verdict = (f"**{failed} of {len(gates)} gate(s) FAILED**: these figures do not meet the validation's own bar."
                   if failed else f"All {len(gates)} gate(s) passed.")
        lines += [f"Gates: {verdict}", ""] + [f"- {'pass' if g['passed'] else 'FAIL'}: {markdown_text(g['name'])}"
                                   + (f" ({markdown_text(g['detail'])})" if g.get("detail") else "")
                                   for g in gates] + [""]
    lines += [f"![{p.rsplit('/', 1)[-1][:-4]}]({p})" for p in facts.report_files if p.endswith(".png")]
    return lines + [""]


def _binding(facts: CardFacts) -> str:
    """Whether the figures are tied to these files: the report's artifact_checksum, equal to the artifact's."""
    if facts.artifact_checksum is None:
        return ("`validation/report.json` records no `artifact_checksum`: nothing ties these figures to the weights "
                "of this release.")
    return (f"The figures were measured on exactly this release's weights and configs: the report's "
            f"`artifact_checksum` (`{short_checksum(facts.artifact_checksum)}`) is the sha256 of the `SHA256SUMS` "
            "listing of every file here but `README.md`, `SHA256SUMS` and `validation/`.")


def _quantization(facts: CardFacts) -> list[str]:
    desc = facts.description
    by_scheme = {scheme: [split_param(name)[0] for name, label in desc.items()
                          if label == scheme and split_param(name)[1] == "weight"] for scheme in QUANTIZED}
    quantized = [module for modules in by_scheme.values() for module in modules]
    ignore = facts.manifest.get("ignore_list") or []
    by_reason: dict[str, list[str]] = {}
    for entry in ignore:
        by_reason.setdefault(entry["reason"], []).append(entry["module"])
    linear = set(quantized) | {e["module"] for e in ignore}
    others = [name for name, label in desc.items()
              if isinstance(label, str) and label not in QUANTIZED and split_param(name)[0] not in linear]
    lines = ["## What is quantized", ""]
    for scheme, modules in by_scheme.items():
        if modules:
            lines += [f"{len(modules)} linear layers are {scheme} ({SCHEME_TENSORS[scheme]}):", ""]
            lines += [f"- `{p}`" + (f" ({n} layers)" if n > 1 else "") for p, n in layer_kinds(modules).items()]
            lines.append("")
    lines += ["## Kept in BF16, and why", "",
              f"{len(ignore)} linear layers are on the ignore-list (`npuport_manifest.json`), grouped by reason:", ""]
    rows = [[markdown_text(reason), str(len(mods)), _pattern_list(mods)] for reason, mods in by_reason.items()]
    lines += _table(["reason", "layers", "which"], rows)
    lines += [f"{len(others)} other tensors (embeddings, lm_head, norms, GDN conv1d / A_log / dt_bias, biases) are "
              "not linear layers and keep the source dtype; each is labelled FLOAT in "
              "`quant_model_description.json`.", ""]
    return lines


def markdown_text(text: str) -> str:
    """`text` escaped so Markdown shows it literally (a glob like '*visual*' is not emphasis; '|' ends no cell)."""
    return re.sub(r"([\\`*_|<\[\]])", r"\\\1", text)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table; cells are Markdown already (escape plain text with markdown_text)."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] \
        + ["| " + " | ".join(row) + " |" for row in rows] + [""]


def serving_commands(model: str, k: int | None) -> dict[str, str]:
    """The commands that serve `model` with MTP speculative decoding (k draft tokens), by engine; k None: the
    shell variable K in its place."""
    if k is None:
        return {"vllm-ascend": VLLM_ASCEND_COMMAND.format(model=model, k="'\"$K\"'"),
                "sglang": SGLANG_COMMAND.format(model=model, k="$K", k_plus_1="$((K + 1))")}
    return {"vllm-ascend": VLLM_ASCEND_COMMAND.format(model=model, k=k),
            "sglang": SGLANG_COMMAND.format(model=model, k=k, k_plus_1=k + 1)}


def validated_draft_tokens(report: dict[str, Any] | None) -> int | None:
    """The MTP draft tokens per round the validation report measured acceptance with; None when it measured none."""
    mtp = (report or {}).get("mtp")
    return mtp.get("num_speculative_tokens") if isinstance(mtp, dict) else None


def _serving(facts: CardFacts) -> list[str]:
    k = validated_draft_tokens(facts.report)
    drafts = (f"{k} draft tokens, as validated: `validation/report.json`, `mtp.num_speculative_tokens`" if k is not None
              else "K draft tokens: set K first; the validation report measured no MTP, so `npuport validate --mtp K` "
              "the artifact before relying on it")
    lines = ["## Serving", "",
             f"With MTP speculative decoding ({drafts}); add the engine's parallelism "
             "flags (e.g. `--tensor-parallel-size`, `--tp-size`) for the number of NPUs. The MTP head is BF16 in "
             "this release: vllm-ascend reads that from `quant_model_description.json`, sglang needs "
             "`--speculative-draft-model-quantization unquant`.", ""]
    labels = {name: label for name, label in facts.description.items() if isinstance(label, str)}
    known = facts_for(labels)
    for engine, command in serving_commands(f"./{facts.release_name}", k).items():
        lines += [f"{engine}:", "", "```bash", command, "```", ""]
        mine = [f for f in known if f.engine == engine]
        loads = [f for f in mine if f.kind == "loads"]
        lines.append("Versions known to load an artifact like this one: " + (
            "; ".join(f"{f.versions}: {markdown_text(f.effect)} ({f.source})" for f in loads)
            if loads else "none recorded in npuport's table of engine facts."))
        problems = [f"- **{'Cannot load it' if f.kind == 'cannot_load' else 'Known problem'}** "
                    f"({markdown_text(f.versions)}" + (f", with `{f.trigger}`" if f.trigger else "")
                    + f"): {markdown_text(f.effect)}. Workaround: {markdown_text(f.workaround)}. Source: {f.source}"
                    + ("" if f.checked else " (not re-checked)") for f in mine if f.kind in ("breaks", "cannot_load")]
        lines += [""] + (problems + [""] if problems else [])
    return lines


def validate_line(facts: CardFacts) -> str:
    """The `npuport validate` line the report records, its folders named as the card names them; a comment when
    there is no report, or it records no command."""
    if facts.report is None:
        return "# not validated: no report was packaged"
    command = ((facts.report.get("settings") or {}).get("command"))
    if not isinstance(command, str):
        return "# validate: the report records no command line (validation/report.json, settings)"
    try:
        return renamed_command(command, {"artifact": facts.artifact_name, "out": facts.report_dir},
                               lambda path: Path(path).name)
    except ValueError:  # not shell words
        return "# validate: the report's command line does not parse (validation/report.json, settings)"


def _provenance(facts: CardFacts) -> list[str]:
    m = facts.manifest
    source = m.get("source") or {}
    recipe = m.get("recipe") or {}
    convert = shlex.join(["npuport", *str(m.get("command", "convert-qwen35 --a8w8")).split(), "--recipe",
                          f"{facts.release_name}/{facts.recipe_file}", source.get("name", "SOURCE"),
                          facts.artifact_name])
    lines = ["## How it was made", "",
             f"- source: `{source.get('name')}` ({source.get('model_type')}); the checksums identifying it are in "
             "`npuport_manifest.json` (`source.checksums`)",
             f"- recipe: `{recipe.get('name')}` ({recipe.get('file')}), saved here as `{facts.recipe_file}`"]
    lines += [f"- recipe note: {note}" for note in recipe.get("notes") or []]
    lines += [f"- converted with npuport {m.get('version')}, packaged with npuport {__version__} on "
              f"{facts.packaged_on}", "",
              "The commands, run in one folder that holds the source, the artifact, the report folder and this "
              "release, each by its folder name:", "",
              "```bash", convert, validate_line(facts), facts.package_command, "```", ""]
    return lines


def _files(facts: CardFacts) -> list[str]:
    rows = [[f"`{path}`", f"{size:,}"] for path, size in sorted(facts.files.items())]
    return ["## Files", ""] + _table(["file", "bytes"], rows) + [
        "`SHA256SUMS` lists the SHA-256 of every file; check them with `sha256sum -c SHA256SUMS`, or run "
        "`npuport verify-release .` for the checksums, the checkpoint contract and this card's figures.", "",
        VERIFY_PROVES + " " + VERIFY_CANNOT_PROVE, ""]


def _license(facts: CardFacts) -> list[str]:
    if facts.license_file:
        text = f"The weights derive from `{facts.base_model}`; its license applies: see [{facts.license_file}]" \
               f"({facts.license_file})."
    else:
        text = f"The weights derive from `{facts.base_model}`, whose license applies; no LICENSE file was in the " \
               "artifact."
    return ["## License", "", text, ""]


def render_model_card(facts: CardFacts) -> str:
    """README.md for the release described by `facts`."""
    lines = _front_matter(facts) + _forced_warning(facts.forced_problems) + _intro(facts) + _results(facts)
    lines += _quantization(facts) + _serving(facts) + _provenance(facts) + _files(facts) + _license(facts)
    return "\n".join(lines).rstrip("\n") + "\n"


def read_front_matter(card: str) -> dict[str, Any]:
    """The YAML front matter at the top of a card, parsed; ValueError when there is none or it is not a mapping."""
    if not card.startswith("---\n"):
        raise ValueError("does not start with YAML front matter ('---')")
    end = card.find("\n---\n", 4)
    if end < 0:
        raise ValueError("YAML front matter is not closed by '---'")
    try:
        meta = yaml.safe_load(card[4:end])
    except yaml.YAMLError as e:
        raise ValueError(f"YAML front matter does not parse ({e})") from None
    except RecursionError:  # PyYAML recurses once per level of nesting
        raise ValueError("YAML front matter is nested too deep to parse") from None
    if not isinstance(meta, dict):
        raise ValueError("YAML front matter is not a mapping")
    return meta
