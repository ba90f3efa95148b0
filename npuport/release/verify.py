"""`npuport verify-release`: every check a packaged release must pass, each problem listed: checksums,
the checkpoint contract, the model card's figures against report.json, and no BF16 source files anywhere."""

from __future__ import annotations

from pathlib import Path

from npuport.checksums import SUMS_NAME, parse_sums, sha256_file
from npuport.convert.check import check_artifact
from npuport.convert.converter import MANIFEST_NAME
from npuport.errors import NpuportError
from npuport.release.model_card import FORCED_MARK, read_front_matter
from npuport.release.package import (
    CARD_NAME,
    RECIPE_SUFFIX,
    REPORT_NAME,
    VALIDATION_DIR,
    failed_gates,
    load_report,
    recipe_files,
)
from npuport.release.results_table import compare_results, parse_results_table

FRONT_MATTER_KEYS = ("license", "base_model", "tags")


def _release_files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != SUMS_NAME}


def check_checksums(folder: Path) -> list[str]:
    """SHA256SUMS lists every file of the release, and every listed file still has its digest."""
    sums = folder / SUMS_NAME
    if not sums.is_file():
        return [f"{SUMS_NAME} is missing"]
    digests, problems = parse_sums(sums.read_text(encoding="utf-8"))
    present = _release_files(folder)
    for rel, digest in sorted(digests.items()):
        if rel not in present:
            problems.append(f"{rel}: listed in {SUMS_NAME} but missing")
        elif sha256_file(folder / rel) != digest:
            problems.append(f"{rel}: SHA-256 differs from {SUMS_NAME} (changed after packaging)")
    problems += [f"{rel}: not listed in {SUMS_NAME} (added after packaging)" for rel in sorted(present - set(digests))]
    return problems


def check_release_files(folder: Path) -> list[str]:
    """The files a release adds to the contract's: the manifest, one recipe, and no weights or index outside
    the top level (check_artifact covers the top level)."""
    problems = []
    if not (folder / MANIFEST_NAME).is_file():
        problems.append(f"{MANIFEST_NAME} is missing (the ignore-list and provenance)")
    if len(recipe_files(folder)) != 1:
        problems.append(f"expected one *{RECIPE_SUFFIX} (the recipe applied), found {len(recipe_files(folder))}")
    for p in sorted(folder.rglob("*")):
        if p.parent != folder and (p.name.endswith(".safetensors") or p.name.endswith("index.json")):
            problems.append(f"{p.relative_to(folder).as_posix()}: weights or an index outside the top level")
    return problems


def check_card(folder: Path) -> list[str]:
    """README.md: front matter that parses, and a results table equal to validation/report.json's figures."""
    card_path = folder / CARD_NAME
    if not card_path.is_file():
        return [f"{CARD_NAME} is missing"]
    card = card_path.read_text(encoding="utf-8")
    problems = []
    try:
        meta = read_front_matter(card)
        problems += [f"{CARD_NAME}: front matter has no {key!r}" for key in FRONT_MATTER_KEYS if key not in meta]
    except ValueError as e:
        problems.append(f"{CARD_NAME}: {e}")
    report_path = folder / VALIDATION_DIR / REPORT_NAME
    if not report_path.is_file():
        if parse_results_table(card) is not None:
            problems.append(f"{CARD_NAME}: has a results table, but the release has no {VALIDATION_DIR}/{REPORT_NAME}")
        return problems
    try:
        report = load_report(report_path)
    except NpuportError as e:
        return problems + [str(e).replace(str(folder) + "/", "")]
    problems += compare_results(card, report, CARD_NAME)
    failed = failed_gates(report)
    problems += [f"{VALIDATION_DIR}/{REPORT_NAME}: {p}" for p in failed]
    if failed and FORCED_MARK not in card:
        problems.append(f"{CARD_NAME}: the report has a failed gate but the card carries no '{FORCED_MARK}' warning")
    return problems


def verify_release(folder: str | Path) -> list[str]:
    """Every problem found in the release folder `folder` (empty when it is sound)."""
    folder = Path(folder)
    if not folder.is_dir():
        return [f"{folder}: not a folder"]
    problems = check_checksums(folder)
    problems += [f"contract: {p}" for p in check_artifact(folder)]
    problems += check_release_files(folder)
    problems += check_card(folder)
    return problems
