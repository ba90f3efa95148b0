"""`npuport package`: assemble a release folder from a checked artifact and its validation report: the
artifact's files, the report and its plots under validation/, a model card README.md and SHA256SUMS.

The release is built in a temporary folder beside OUT and renamed into place only when complete. Every file
is copied and hashed in the same pass (each byte read once; no hard links, so editing the release can never
change the artifact it came from).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from npuport.checksums import SUMS_NAME, HashingWriter, copy_with_sha256, format_sums
from npuport.convert.ascend_writer import DESCRIPTION_NAME
from npuport.convert.check import check_artifact
from npuport.convert.converter import GB, MANIFEST_NAME
from npuport.errors import NpuportError
from npuport.jsonfile import read_json_object
from npuport.release.model_card import CardFacts, license_id, render_model_card
from npuport.runtime.validation.report import REPORT_FORMAT

CARD_NAME = "README.md"
VALIDATION_DIR = "validation"
REPORT_NAME = "report.json"
REPORT_MD_NAME = "report.md"
RECIPE_SUFFIX = "_best_practice.yaml"
RESERVED_NAMES = (CARD_NAME, SUMS_NAME, VALIDATION_DIR)
LICENSE_PREFIX = "LICENSE"  # LICENSE, LICENSE.txt, LICENSE.md: the base model's, copied by the converter
_PLOT_LINK = re.compile(r"!\[[^\]]*\]\(([^)\s]+\.png)\)")


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
    return data


def failed_gates(report: dict[str, Any]) -> list[str]:
    """A line for each gate of a report that did not pass."""
    return [f"gate failed: {g['name']}" + (f" ({g['detail']})" if g.get("detail") else "")
            for g in report.get("gates", []) if not g["passed"]]


def report_attachments(report_json: Path) -> list[Path]:
    """report.md next to report.json and every plot it shows (all three written by write_report)."""
    md = report_json.parent / REPORT_MD_NAME
    if not md.is_file():
        raise ReleaseError(f"{md}: missing; write_report writes it next to {report_json.name}")
    plots = []
    for link in dict.fromkeys(_PLOT_LINK.findall(md.read_text(encoding="utf-8"))):
        plot = report_json.parent / link
        if "/" in link or not plot.is_file():
            raise ReleaseError(f"{md}: shows {link}, which is not a file next to it")
        plots.append(plot)
    return [md, *plots]


def recipe_files(folder: Path) -> list[Path]:
    """The `<ModelName>_best_practice.yaml` recipe(s) in a folder (an artifact holds exactly one)."""
    return sorted(p for p in folder.iterdir() if p.name.endswith(RECIPE_SUFFIX))


def _artifact_files(artifact: Path) -> list[Path]:
    files = []
    for p in sorted(artifact.iterdir()):
        if p.name in RESERVED_NAMES:
            raise ReleaseError(f"{p}: the release writes its own {p.name}; remove it from the artifact")
        if not p.is_file():
            raise ReleaseError(f"{p}: an artifact holds files only, not folders or special files")
        files.append(p)
    return files


def _report_date(path: Path, report: dict[str, Any]) -> str:
    for key in ("date", "created"):
        if isinstance(report.get(key), str):
            return report[key]
    mtime = datetime.fromtimestamp(path.stat().st_mtime, tz=timezone.utc)
    return f"{mtime:%Y-%m-%d} (the date of report.json)"


def _shown(path: Path) -> str:
    """A path as the card shows it: as typed when relative, by its name when absolute (no machine paths)."""
    return str(path) if not path.is_absolute() else path.name


def package_command(artifact: Path, out: Path, report: Path | None, force: bool, archive: bool) -> str:
    """The `npuport package` command line equivalent to a package_release call."""
    parts = ["npuport", "package", _shown(artifact), "--out", _shown(out)]
    if report is not None:
        parts += ["--report", str(report) if not report.is_absolute() else f"{report.parent.name}/{report.name}"]
    return " ".join(parts + ["--force"] * force + ["--archive"] * archive)


# ---------------------------------------------------------------------------------------------------------
# Writing the release


def archive_paths(out: Path) -> tuple[Path, Path]:
    """`<OUT>.tar` and its `<OUT>.tar.sha256`, beside OUT."""
    tar = out.parent / f"{out.name}.tar"
    return tar, tar.parent / f"{tar.name}.sha256"


def _check_disk(parent: Path, needed: int) -> None:
    free = shutil.disk_usage(parent).free
    if needed > free * 0.98:
        raise ReleaseError(f"not enough disk space in {parent}: the release needs {needed / GB:.2f} GB, "
                           f"{free / GB:.2f} GB free")


def _tar_member(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def write_archive(folder: Path, name: str, tar_path: Path) -> str:
    """Write `folder` as `tar_path` (members under `name/`, sorted) and return the tar's SHA-256, hashed
    while it is written."""
    with open(tar_path, "xb") as raw:
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

    def problems(self) -> list[str]:
        """Why this should not be released: contract violations and failed gates."""
        problems = [f"contract: {p}" for p in check_artifact(self.artifact)]
        return problems + (failed_gates(self.report) if self.report else [])


def _read_inputs(artifact: Path, report_path: Path | None) -> _Inputs:
    for required in (MANIFEST_NAME, DESCRIPTION_NAME):
        if not (artifact / required).is_file():
            raise ReleaseError(f"{artifact}: no {required}; package an artifact written by npuport convert-qwen35")
    recipes = recipe_files(artifact)
    if len(recipes) != 1:
        raise ReleaseError(f"{artifact}: expected one *{RECIPE_SUFFIX} (the recipe applied), found {len(recipes)}")
    return _Inputs(artifact, read_json_object(artifact / MANIFEST_NAME, ReleaseError),
                   read_json_object(artifact / DESCRIPTION_NAME, ReleaseError),
                   recipes[0], _artifact_files(artifact), report_path,
                   None if report_path is None else load_report(report_path),
                   [] if report_path is None else [report_path, *report_attachments(report_path)])


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
        report_files=[f"{VALIDATION_DIR}/{p.name}" for p in inputs.attachments[1:]], forced_problems=problems)


def package_release(artifact: str | Path, out: str | Path, report: str | Path | None = None, force: bool = False,
                    archive: bool = False, *, base_model: str | None = None,
                    log: Callable[[str], None] = print) -> Path:
    """Package the W8A8 artifact folder `artifact` (and optionally its validation `report`.json) as a release
    folder `out`; with `archive`, also `<out>.tar` and `<out>.tar.sha256`. Refuses an artifact that fails the
    contract check or a report with a failed gate unless `force`, which the card then says in its first lines.
    Returns `out`. `base_model` (e.g. a hub id) defaults to the source folder's name in the manifest."""
    artifact, out = Path(artifact), Path(out)
    report_path = None if report is None else Path(report)
    if not artifact.is_dir():
        raise ReleaseError(f"{artifact}: not an artifact folder")
    if out.exists():
        raise ReleaseError(f"{out} already exists; choose a new folder")
    if out.resolve().is_relative_to(artifact.resolve()):
        raise ReleaseError(f"{out} is inside the artifact {artifact}; choose a folder outside it")
    tar_path, tar_sum_path = archive_paths(out)
    if archive and (tar_path.exists() or tar_sum_path.exists()):
        raise ReleaseError(f"{tar_path} already exists; choose a new folder name or move it away")
    inputs = _read_inputs(artifact, report_path)
    problems = inputs.problems()
    if problems and not force:
        raise ReleaseError(f"refusing to package {artifact}:\n  " + "\n  ".join(problems)
                           + "\n(--force packages it anyway, with a warning at the top of the model card)")
    for p in problems:
        log(f"warning (--force): {p}")

    sources = {p.name: p for p in inputs.files} | {f"{VALIDATION_DIR}/{p.name}": p for p in inputs.attachments}
    total = sum(p.stat().st_size for p in sources.values())
    out.parent.mkdir(parents=True, exist_ok=True)
    _check_disk(out.parent, total * (2 if archive else 1) + 1024 * 1024)
    tmp = out.parent / f".{out.name}.npuport-partial"
    tar_tmp = tar_path.parent / f".{tar_path.name}.npuport-partial"
    placed: list[Path] = []
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        log(f"copying and hashing {len(sources)} files ({total / GB:.2f} GB)")
        if inputs.attachments:
            (tmp / VALIDATION_DIR).mkdir()
        digests = {rel: copy_with_sha256(src, tmp / rel) for rel, src in sources.items()}
        command = package_command(artifact, out, report_path, force, archive)
        facts = _card_facts(inputs, out, {rel: (tmp / rel).stat().st_size for rel in digests}, command, base_model,
                            problems)
        card = render_model_card(facts).encode("utf-8")
        (tmp / CARD_NAME).write_bytes(card)
        digests[CARD_NAME] = hashlib.sha256(card).hexdigest()
        (tmp / SUMS_NAME).write_text(format_sums(digests), encoding="utf-8")
        if archive:
            tar_tmp.unlink(missing_ok=True)
            log(f"writing {tar_path.name}")
            tar_digest = write_archive(tmp, out.name, tar_tmp)
            tar_tmp.rename(tar_path)
            placed.append(tar_path)
            tar_sum_path.write_text(format_sums({tar_path.name: tar_digest}), encoding="utf-8")
            placed.append(tar_sum_path)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in [tar_tmp, *placed]:
            p.unlink(missing_ok=True)
        raise
    log(f"wrote release {out} ({len(digests)} files, {total / GB:.2f} GB)" + (f" and {tar_path.name}" if archive
                                                                               else ""))
    return out
