"""`npuport verify-release`: every check a packaged release must pass, each problem listed: the path rule for
every file it holds or names, checksums, the release contract, the model card's figures against report.json,
the report bound to these weights, and no BF16 source files or code anywhere."""

from __future__ import annotations

import os
from pathlib import Path

from npuport.checksums import SUMS_NAME, listing_checksum, parse_sums, sha256_file
from npuport.convert.check import check_artifact
from npuport.errors import NpuportError
from npuport.jsonfile import read_text
from npuport.output_folder import MAX_SUMS_BYTES
from npuport.release.model_card import FORCED_MARK, VERIFY_CANNOT_PROVE, VERIFY_PROVES, read_front_matter
from npuport.release.package import (
    CARD_NAME,
    CHECKSUM_KEY,
    RECIPE_SUFFIX,
    REPORT_NAME,
    VALIDATION_DIR,
    checksum_mismatch,
    code_problems,
    failed_gates,
    from_artifact,
    index_shard_problems,
    load_report,
    missing_release_files,
    path_rule_problem,
    recipe_files,
)
from npuport.release.results_table import CPU_SPEED_MARK, compare_results, parse_results_table, speed_notes

FRONT_MATTER_KEYS = ("license", "base_model", "tags")
SCOPE = VERIFY_PROVES + " " + VERIFY_CANNOT_PROVE  # what an OK from verify-release means, and what it cannot


def walk_release(folder: Path) -> tuple[list[str], list[str]]:
    """The release's files (relative paths of regular files inside it, sorted) and a problem for each entry that
    breaks the path rule: a symlink that resolves outside the folder, or something that is not a regular file.
    Nothing out of the folder is followed: a symlinked folder is checked, never entered."""
    files, problems = [], []
    for root, dirs, names in os.walk(folder):  # followlinks=False
        here = Path(root)
        for name in dirs:
            rel = (here / name).relative_to(folder).as_posix()
            if (here / name).is_symlink() and (problem := path_rule_problem(folder, rel, "the folder listing",
                                                                            must_exist=False)):
                problems.append(problem)
        for name in names:
            rel = (here / name).relative_to(folder).as_posix()
            problem = path_rule_problem(folder, rel, "the folder listing")
            if problem:
                problems.append(problem)
            else:
                files.append(rel)
    return sorted(files), problems


def check_checksums(folder: Path, digests: dict[str, str]) -> list[str]:
    """SHA256SUMS lists every file of the release with its digest (`digests`: each file's actual SHA-256 by
    relative path, SHA256SUMS excluded), and names no file outside the release (a violation, not followed)."""
    sums = folder / SUMS_NAME
    if not sums.is_file():
        return [f"{SUMS_NAME} is missing"]
    size = sums.stat().st_size
    if size > MAX_SUMS_BYTES:  # a line per file: no release comes near; reading one of 200 MB took minutes
        return [f"{SUMS_NAME}: {size:,} bytes, more than the listing of any release takes ({MAX_SUMS_BYTES:,} at "
                "most); not read"]
    try:
        listed, problems = parse_sums(read_text(sums, NpuportError))
    except NpuportError as e:
        return [_in_release(e, folder)]
    for rel, digest in sorted(listed.items()):
        outside = path_rule_problem(folder, rel, SUMS_NAME, must_exist=False)
        if outside:
            problems.append(outside)
        elif rel not in digests:
            problems.append(f"{rel}: listed in {SUMS_NAME} but missing")
        elif digests[rel] != digest:
            problems.append(f"{rel}: SHA-256 differs from {SUMS_NAME} (changed after packaging)")
    added = sorted(set(digests) - set(listed))
    return problems + [f"{rel}: not listed in {SUMS_NAME} (added after packaging)" for rel in added]


def check_release_files(folder: Path, files: list[str]) -> list[str]:
    """The release contract (RELEASE_FILES), one recipe, no code, and no weights or index outside the top level
    (check_artifact covers the top level). `files`: the release's files, as walk_release lists them."""
    problems = missing_release_files(folder, [rel for rel in files if "/" not in rel])
    if len(recipe_files(folder)) != 1:
        problems.append(f"expected one *{RECIPE_SUFFIX} (the recipe applied), found {len(recipe_files(folder))}")
    problems += code_problems(folder, files)
    for rel in files:
        name = rel.rsplit("/", 1)[-1]
        if "/" in rel and (name.endswith(".safetensors") or name.endswith("index.json")):
            problems.append(f"{rel}: weights or an index outside the top level")
    return problems


def check_card(folder: Path) -> list[str]:
    """README.md: front matter that parses, and a results table equal to validation/report.json's figures."""
    card_path = folder / CARD_NAME
    if not card_path.is_file():
        return [f"{CARD_NAME} is missing"]
    try:
        card = read_text(card_path, NpuportError)
    except NpuportError as e:
        return [_in_release(e, folder)]
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
        return problems + [_in_release(e, folder)]
    problems += compare_results(card, report, CARD_NAME)
    if speed_notes(report) and CPU_SPEED_MARK not in card:
        problems.append(f"{CARD_NAME}: report.json's speed figures were measured on a CPU, but the card carries no "
                        f"'{CPU_SPEED_MARK} ...' note saying so")
    failed = failed_gates(report)
    problems += [f"{VALIDATION_DIR}/{REPORT_NAME}: {p}" for p in failed]
    if failed and FORCED_MARK not in card:
        problems.append(f"{CARD_NAME}: the report has a failed gate but the card carries no '{FORCED_MARK}' warning")
    return problems


def _in_release(error: NpuportError, folder: Path) -> str:
    """An error's message with the release's files named by their paths inside it."""
    return str(error).replace(str(folder) + "/", "")


def check_report_binding(folder: Path, digests: dict[str, str]) -> list[str]:
    """validation/report.json's artifact_checksum equals the checksum of the release's weights and configs,
    recomputed from the files (`digests`, as check_checksums takes them): the figures were measured on them."""
    report_path = folder / VALIDATION_DIR / REPORT_NAME
    if not report_path.is_file():
        return []
    try:
        recorded = load_report(report_path).get(CHECKSUM_KEY)
    except NpuportError:
        return []  # check_card reports a report that does not load
    if recorded is None:
        return []  # the card says that nothing ties its figures to the weights
    actual = listing_checksum({rel: digest for rel, digest in digests.items() if from_artifact(rel)})
    if recorded == actual:
        return []
    label = f"{VALIDATION_DIR}/{REPORT_NAME}"
    if not isinstance(recorded, str):
        return [f"{label}: {CHECKSUM_KEY} must be a string, is {type(recorded).__name__}"]
    return [checksum_mismatch(label, recorded, actual, "this release's weights and configs")]


def release_warnings(folder: str | Path) -> list[str]:
    """What a sound release may still lack, one line each (not problems: verify_release passes it): a measurement."""
    if not (Path(folder) / VALIDATION_DIR / REPORT_NAME).is_file():
        return [f"{folder} carries no measurement: no {VALIDATION_DIR}/{REPORT_NAME}, so nothing in it says how "
                "well the model answers; its card says so"]
    return []


def verify_release(folder: str | Path) -> list[str]:
    """Every problem found in the release folder `folder` (empty when it is sound; SCOPE says what that proves).
    A path that leads out of the folder is reported and never followed: with one in the folder itself nothing
    else is read; with one in the weight index the contract check (which reads the shards) is skipped."""
    folder = Path(folder)
    if not folder.is_dir():
        return [f"{folder}: not a folder"]
    files, problems = walk_release(folder)
    if problems:
        return problems
    digests = {rel: sha256_file(folder / rel) for rel in files if rel != SUMS_NAME}
    problems = check_checksums(folder, digests)
    outside = index_shard_problems(folder)
    problems += outside if outside else [f"contract: {p}" for p in check_artifact(folder)]
    problems += check_release_files(folder, files)
    problems += check_card(folder)
    return problems + check_report_binding(folder, digests)
