"""`npuport package`: assemble a release folder from a checked artifact and its validation report: the
artifact's files, the report and its plots under validation/, a model card README.md and SHA256SUMS.

The release is built in a temporary folder beside OUT and renamed into place only when complete. Every source
file is hashed when it is checked, before anything is written; then copied and hashed in the same pass (positioned
reads into buffers, no memory map; no hard links, so editing the release can never change the artifact it came
from), and each copy's digest must equal its checked one: a file changed or truncated in between refuses the whole
release, one line naming the file, and nothing is left behind.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import tarfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from npuport.checksums import SUMS_NAME, HashingWriter, copy_with_sha256, format_sums, listing_checksum, sha256_file
from npuport.convert.ascend_writer import DESCRIPTION_NAME, INDEX_NAME
from npuport.convert.check import check_artifact
from npuport.convert.converter import GB, MANIFEST_NAME
from npuport.errors import NpuportError
from npuport.jsonfile import read_json_object, read_text
from npuport.output_folder import OutputFolder, archive_paths
from npuport.paths import file_inside
from npuport.release.model_card import (
    CardFacts,
    check_report,
    license_id,
    read_manifest,
    render_model_card,
    short_checksum,
)
from npuport.runtime.validation.report import REPORT_FORMAT

CARD_NAME = "README.md"
VALIDATION_DIR = "validation"
REPORT_NAME = "report.json"
REPORT_MD_NAME = "report.md"
RECIPE_SUFFIX = "_best_practice.yaml"
RESERVED_NAMES = (CARD_NAME, SUMS_NAME, VALIDATION_DIR)
LICENSE_PREFIX = "LICENSE"  # LICENSE, LICENSE.txt, LICENSE.md: the base model's, copied by the converter
_PLOT_LINK = re.compile(r"!\[[^\]]*\]\(([^)\s]+\.png)\)")
CHECKSUM_KEY = "artifact_checksum"  # report.json: validate's artifact_checksum of the folder it measured
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
AUTO_MAP_KEY = "auto_map"  # a config key naming Python classes that transformers imports (trust_remote_code)
CODE_SUFFIX = ".py"


@dataclass(frozen=True)
class RequiredFile:
    """One thing a release must hold: present when every file of one of `alternatives` is, or when the JSON file
    `in_json[0]` has the key `in_json[1]`."""

    what: str
    alternatives: tuple[tuple[str, ...], ...]
    in_json: tuple[str, str] | None = None


# The contract of a release: what vllm-ascend and sglang need to load and serve it (CONTRACT.md, "Files in an
# artifact"), plus npuport's manifest. The shards are the files the weight index names; the path rule and the
# contract check (npuport check) hold them. The recipe and the card are checked on their own.
RELEASE_FILES = (
    RequiredFile("model config", (("config.json",),)),
    RequiredFile("quantization description", ((DESCRIPTION_NAME,),)),
    RequiredFile("weight index", ((INDEX_NAME,),)),
    RequiredFile("tokenizer", (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))),
    RequiredFile("tokenizer config", ((TOKENIZER_CONFIG_NAME,),)),
    RequiredFile("chat template", (("chat_template.jinja",), ("chat_template.json",)),
                 in_json=(TOKENIZER_CONFIG_NAME, "chat_template")),  # older layouts keep it in the tokenizer config
    RequiredFile("npuport manifest", ((MANIFEST_NAME,),)),  # the ignore-list and provenance
)


class ReleaseError(NpuportError):
    """An artifact or report cannot be packaged, or the release folder cannot be written."""


# ---------------------------------------------------------------------------------------------------------
# Reading the inputs


def load_report(path: Path) -> dict[str, Any]:
    """A validation report.json (runtime/validation/report.py's format), with its gates checked for shape."""
    data = read_json_object(path, ReleaseError)
    if data.get("format") != REPORT_FORMAT:
        raise ReleaseError(f"{path}: not an npuport validation report (format {data.get('format')!r}, "
                           f"expected {REPORT_FORMAT})")
    gates = data.get("gates", [])
    if not isinstance(gates, list) or not all(isinstance(g, dict) and isinstance(g.get("name"), str)
                                              and isinstance(g.get("passed"), bool) for g in gates):
        raise ReleaseError(f"{path}: 'gates' must be a list of {{name, passed, detail}} objects")
    check_report(data, path, ReleaseError)
    return data


def failed_gates(report: dict[str, Any]) -> list[str]:
    """A line for each gate of a report that did not pass."""
    return [f"gate failed: {g['name']}" + (f" ({g['detail']})" if g.get("detail") else "")
            for g in report.get("gates", []) if not g["passed"]]


def report_attachments(report_json: Path) -> list[Path]:
    """report.md next to report.json and every plot it shows (all three written by write_report), each a regular
    file inside the report's folder (the path rule: a symlink out of it is refused, not copied)."""
    folder = report_json.parent
    md = folder / REPORT_MD_NAME
    if not md.is_file():
        raise ReleaseError(f"{md}: missing; write_report writes it next to {report_json.name}")
    file_inside(folder, REPORT_MD_NAME, "the report folder", ReleaseError)
    plots = []
    for link in dict.fromkeys(_PLOT_LINK.findall(read_text(md, ReleaseError))):
        plot = folder / link
        if "/" in link or not plot.is_file():
            raise ReleaseError(f"{md}: shows {link}, which is not a file next to it")
        plots.append(file_inside(folder, link, REPORT_MD_NAME, ReleaseError))
    return [md, *plots]


def path_rule_problem(folder: Path, name: str, what: str, must_exist: bool = True) -> str | None:
    """npuport.paths.file_inside's verdict on `name`, named by `what` in `folder`: None when it holds, else the
    problem without the folder's path in front."""
    try:
        file_inside(folder, name, what, ReleaseError, must_exist=must_exist)
    except ReleaseError as e:
        return str(e).removeprefix(f"{folder}: ")
    return None


def index_shard_problems(folder: Path) -> list[str]:
    """Where the weight index of `folder` breaks the path rule: a shard it names that lies outside the folder,
    is a symlink out of it, is missing or is not a regular file; or a weight_map that is not {tensor: file}.
    Empty when there is no readable index (the contract check reports that)."""
    try:
        index = read_json_object(folder / INDEX_NAME, ReleaseError)
    except ReleaseError:
        return []
    weight_map = index.get("weight_map")
    if weight_map is None:
        return []
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        return [f"{INDEX_NAME}: weight_map must map each tensor name to a file name"]
    problems = (path_rule_problem(folder, shard, INDEX_NAME) for shard in sorted(set(weight_map.values())))
    return [p for p in problems if p is not None]


def missing_release_files(folder: Path, names: Iterable[str]) -> list[str]:
    """A line for each entry of RELEASE_FILES that the top-level files `names` of `folder` do not provide."""
    present = set(names)
    problems = []
    for required in RELEASE_FILES:
        if any(present.issuperset(files) for files in required.alternatives) or _has_json_key(folder, present,
                                                                                                required.in_json):
            continue
        choices = [" + ".join(files) for files in required.alternatives]
        if required.in_json:
            choices.append(f"{required.in_json[1]!r} in {required.in_json[0]}")
        problems.append(f"release contract: no {required.what} (needs {' or '.join(choices)})")
    return problems


def _has_json_key(folder: Path, present: set[str], in_json: tuple[str, str] | None) -> bool:
    if in_json is None or in_json[0] not in present:
        return False
    try:
        return in_json[1] in read_json_object(folder / in_json[0], ReleaseError)
    except ReleaseError:
        return False


def code_problems(folder: Path, names: Iterable[str]) -> list[str]:
    """Code that a release of the files `names` (relative to `folder`) would carry: Python files, and an
    `auto_map` in a top-level config, which makes transformers import Python classes (trust_remote_code). A
    W8A8 Qwen3.5 needs neither; an engine told to trust remote code would run it. So is a top-level config that is
    not a JSON object, which no engine reads and which cannot be checked for `auto_map` (config.json aside: the
    contract check reports it)."""
    problems = []
    for name in sorted(names):
        if name.endswith(CODE_SUFFIX):
            problems.append(f"code: {name} is Python code; a release of weights carries none")
        elif "/" not in name and name.endswith("config.json"):
            try:
                config = read_json_object(folder / name, ReleaseError)
            except ReleaseError as e:
                if name != "config.json":  # the contract check reports config.json
                    problems.append(str(e).removeprefix(f"{folder}/"))
                continue
            if AUTO_MAP_KEY in config:
                problems.append(f"code: {name} has {AUTO_MAP_KEY!r}, which makes transformers import Python "
                                "classes (trust_remote_code)")
    return problems


def from_artifact(relative: str) -> bool:
    """Whether a file of a release (relative path) came from the artifact: all but README.md, SHA256SUMS and
    validation/. These are the files whose checksum validate records as the report's artifact_checksum."""
    return relative.split("/", 1)[0] not in RESERVED_NAMES


def checksum_mismatch(report: str, recorded: str, actual: str, measured: str) -> str:
    """The one-line refusal of a report whose artifact_checksum is not the checksum of what it is packaged with."""
    return (f"{report}: {CHECKSUM_KEY} {short_checksum(recorded)} is not the checksum of {measured} "
            f"({short_checksum(actual)}): the report measured other weights or configs, so its figures are not "
            "this model's")


def bound_checksum(artifact: Path, report_path: Path, report: dict[str, Any], digests: dict[str, str]) -> str | None:
    """The artifact's checksum (as validate computes it, from `digests`: the sha256 of each of its files by name)
    when the report records the same one; None when the report records none. Refuses a report that records another:
    a card must never state another model's figures, so --force does not override this."""
    recorded = report.get(CHECKSUM_KEY)
    if recorded is None:
        return None
    if not isinstance(recorded, str):
        raise ReleaseError(f"{report_path}: {CHECKSUM_KEY} must be a string, is {type(recorded).__name__}")
    actual = listing_checksum(digests)
    if recorded != actual:
        raise ReleaseError(checksum_mismatch(str(report_path), recorded, actual, f"the artifact {artifact}"))
    return actual


def recipe_files(folder: Path) -> list[Path]:
    """The `<ModelName>_best_practice.yaml` recipe(s) in a folder (an artifact holds exactly one)."""
    return sorted(p for p in folder.iterdir() if p.name.endswith(RECIPE_SUFFIX))


def _artifact_files(artifact: Path) -> list[Path]:
    """The artifact's files, each a regular file inside it (the path rule: a symlink out of it is refused)."""
    files = []
    for p in sorted(artifact.iterdir()):
        if p.name in RESERVED_NAMES:
            raise ReleaseError(f"{p}: the release writes its own {p.name}; remove it from the artifact")
        if p.is_dir():
            raise ReleaseError(f"{p}: an artifact holds files only, not folders or special files")
        files.append(file_inside(artifact, p.name, "the folder listing", ReleaseError))
    return files


def _report_date(path: Path, report: dict[str, Any]) -> str:
    for key in ("date", "created"):
        if isinstance(report.get(key), str):
            return report[key]
    mtime = datetime.fromtimestamp(path.stat().st_mtime, tz=timezone.utc)
    return f"{mtime:%Y-%m-%d} (the date of report.json)"


def _name(path: Path) -> str:
    """A folder or file by its own name, as the card's commands name everything (no machine paths)."""
    return Path(os.path.abspath(path)).name


def report_dir_name(report: Path | None) -> str:
    """The name of the folder holding report.json, as the card's validate and package lines call it."""
    return "validation" if report is None else _name(Path(os.path.abspath(report)).parent)


def package_command(artifact: Path, out: Path, report: Path | None, force: bool, archive: bool) -> str:
    """The `npuport package` command line equivalent to a package_release call, every folder by its name (as the
    card's other commands name them)."""
    parts = ["npuport", "package", _name(artifact), "--out", _name(out)]
    if report is not None:
        parts += ["--report", f"{report_dir_name(report)}/{_name(report)}"]
    return shlex.join(parts + ["--force"] * force + ["--archive"] * archive)


# ---------------------------------------------------------------------------------------------------------
# Writing the release


def _tar_member(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def write_archive(folder: Path, name: str, tar_path: Path) -> str:
    """Write `folder` as `tar_path`, an empty file (OutputFolder.create_partial made it), with members under
    `name/`, sorted; return the tar's SHA-256, hashed while it is written."""
    with open(tar_path, "r+b") as raw:
        stream = HashingWriter(raw)
        with tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as tar:
            tar.add(folder, arcname=name, recursive=False, filter=_tar_member)
            for p in sorted(folder.rglob("*")):
                tar.add(p, arcname=f"{name}/{p.relative_to(folder).as_posix()}", recursive=False,
                        filter=_tar_member)
        return stream.hexdigest()


@dataclass
class _Inputs:
    """What a release is made of, read and checked before anything is written."""

    artifact: Path
    manifest: dict[str, Any]
    description: dict[str, Any]
    recipe: Path
    files: list[Path]  # the artifact's, all top-level
    report_path: Path | None
    report: dict[str, Any] | None
    attachments: list[Path]  # report.json, report.md, plots
    artifact_checksum: str | None  # the artifact's, when the report records it (and so is bound to it)
    sources: dict[str, Path]  # every file the release copies, by its path in the release
    checked: dict[str, str]  # the sha256 of each of `sources`, taken when it was checked: each copy must match

    def problems(self) -> list[str]:
        """Why this should not be released (each overridable by --force, then stated on the card): contract
        violations, files the release contract needs, code, failed gates."""
        names = [p.name for p in self.files]
        problems = [f"contract: {p}" for p in check_artifact(self.artifact)]
        problems += missing_release_files(self.artifact, names) + code_problems(self.artifact, names)
        return problems + (failed_gates(self.report) if self.report else [])


def _read_inputs(artifact: Path, report_path: Path | None) -> _Inputs:
    """Everything a release is made of, with the refusals that --force does not override: a file outside the
    artifact (a symlink out of it, an index naming shards elsewhere: the release would lack its weights) and a
    report measured on other files than the artifact's."""
    files = _artifact_files(artifact)
    for required in (MANIFEST_NAME, DESCRIPTION_NAME):
        if not (artifact / required).is_file():
            raise ReleaseError(f"{artifact}: no {required}; package an artifact written by npuport convert-qwen35")
    recipes = recipe_files(artifact)
    if len(recipes) != 1:
        raise ReleaseError(f"{artifact}: expected one *{RECIPE_SUFFIX} (the recipe applied), found {len(recipes)}")
    outside = index_shard_problems(artifact)
    if outside:
        more = f" (and {len(outside) - 1} more)" if len(outside) > 1 else ""
        raise ReleaseError(f"{artifact}: {outside[0]}{more}; a release holds its weights in its own folder")
    report = None if report_path is None else load_report(report_path)
    attachments = [] if report_path is None else [report_path, *report_attachments(report_path)]
    sources = {p.name: p for p in files} | {f"{VALIDATION_DIR}/{p.name}": p for p in attachments}
    checked = {rel: sha256_file(src) for rel, src in sources.items()}
    artifact_digests = {p.name: checked[p.name] for p in files}
    checksum = None if report is None else bound_checksum(artifact, report_path, report, artifact_digests)
    return _Inputs(artifact, read_manifest(artifact / MANIFEST_NAME, ReleaseError),
                   read_json_object(artifact / DESCRIPTION_NAME, ReleaseError),
                   recipes[0], files, report_path, report, attachments, checksum, sources, checked)


def copy_checked(src: Path, dst: Path, checked: str, out: Path, state: str) -> str:
    """Copy `src` to `dst`, hashing what is written (copy_with_sha256), and return the digest; refuse, naming the
    file, when it differs from `checked`, the digest `src` had when it was checked (it was changed, truncated or
    replaced since: the release would not hold the files that were checked). `state`: what became of `out`."""
    digest = copy_with_sha256(src, dst)
    if digest != checked:
        raise ReleaseError(f"{src}: changed after it was checked (sha256 {short_checksum(checked)} when checked, "
                           f"{short_checksum(digest)} as copied, {dst.stat().st_size:,} bytes); {out} {state}: "
                           "package it again once nothing writes to it")
    return digest


def _card_facts(inputs: _Inputs, out: Path, sizes: dict[str, int], command: str, base_model: str | None,
                problems: list[str]) -> CardFacts:
    license_file = next((p for p in inputs.files if p.name.startswith(LICENSE_PREFIX)), None)
    license_text = license_file.read_text(encoding="utf-8", errors="replace") if license_file else None
    report_path, report = inputs.report_path, inputs.report
    return CardFacts(
        release_name=out.name, artifact_name=inputs.artifact.name,
        base_model=base_model or (inputs.manifest.get("source") or {}).get("name") or inputs.artifact.name,
        license_id=license_id(license_text), license_file=license_file.name if license_file else None,
        manifest=inputs.manifest, description=inputs.description, recipe_file=inputs.recipe.name,
        package_command=command, packaged_on=f"{datetime.now(timezone.utc):%Y-%m-%d}", files=sizes,
        report=report, report_date=None if report_path is None or report is None else _report_date(report_path, report),
        report_files=[f"{VALIDATION_DIR}/{p.name}" for p in inputs.attachments[1:]], forced_problems=problems,
        artifact_checksum=inputs.artifact_checksum, report_dir=report_dir_name(report_path))


def package_release(artifact: str | Path, out: str | Path, report: str | Path | None = None, force: bool = False,
                    archive: bool = False, *, base_model: str | None = None,
                    log: Callable[[str], None] = print) -> Path:
    """Package the W8A8 artifact folder `artifact` (and optionally its validation `report`.json) as a release
    folder `out`; with `archive`, also `<out>.tar` and `<out>.tar.sha256`. Refuses an artifact that fails the
    contract check or a report with a failed gate unless `force`, which the card then says in its first lines.
    With `force`, an existing `out` (and `<out>.tar`, `<out>.tar.sha256`) is replaced once the new release is
    complete, if npuport packaged it (npuport.output_folder says how that is told). Returns `out`. `base_model`
    (e.g. a hub id) defaults to the source folder's name in the manifest."""
    artifact, out = Path(artifact), Path(out)
    report_path = None if report is None else Path(report)
    if not artifact.is_dir():
        raise ReleaseError(f"{artifact}: not an artifact folder")
    folder = OutputFolder(out, ReleaseError, log, archive=True)  # an earlier --archive may have left OUT.tar
    folder.prepare({"artifact": artifact, "report": report_path}, force)
    tar_path, tar_sum_path = archive_paths(out)
    inputs = _read_inputs(artifact, report_path)
    problems = inputs.problems()
    if problems and not force:
        raise ReleaseError(f"refusing to package {artifact}: " + "; ".join(problems)
                           + " (--force packages it anyway, with a warning at the top of the model card)")
    for p in problems:
        log(f"warning (--force): {p}")

    if inputs.report is None:
        log(f"warning: no --report: {out} will carry no measurement (its card says so); validate the artifact and "
            "package it with --report REPORT/report.json")
    sources = inputs.sources
    total = sum(p.stat().st_size for p in sources.values())
    with folder.building(total * (2 if archive else 1) + 1024 * 1024, "release") as tmp:
        log(f"copying and hashing {len(sources)} files ({total / GB:.2f} GB), each checked against its checksum")
        if inputs.attachments:
            (tmp / VALIDATION_DIR).mkdir()
        state = "is unchanged" if folder.replacing else "was not written"
        digests = {rel: copy_checked(src, tmp / rel, inputs.checked[rel], out, state) for rel, src in sources.items()}
        command = package_command(artifact, out, report_path, force, archive)
        facts = _card_facts(inputs, out, {rel: (tmp / rel).stat().st_size for rel in digests}, command, base_model,
                            problems)
        card = render_model_card(facts).encode("utf-8")
        (tmp / CARD_NAME).write_bytes(card)
        digests[CARD_NAME] = hashlib.sha256(card).hexdigest()
        (tmp / SUMS_NAME).write_text(format_sums(digests), encoding="utf-8")
        if archive:
            log(f"writing {tar_path.name}")
            tar_digest = write_archive(tmp, out.name, folder.create_partial(tar_path))
            folder.create_partial(tar_sum_path).write_text(format_sums({tar_path.name: tar_digest}), encoding="utf-8")
        folder.commit()
    log(f"wrote release {out} ({len(digests)} files, {total / GB:.2f} GB)" + (f" and {tar_path.name}" if archive
                                                                               else ""))
    return out
