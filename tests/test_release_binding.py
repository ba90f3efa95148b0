"""A release binds its figures to its weights: package refuses a report measured on other files (even with
--force), verify-release recomputes the report's artifact_checksum; every file a release holds or names stays
inside it (reported, never followed); the release contract lists the files an engine needs; code is flagged.

The reference for a checksum is hashlib over the `sha256sum` listing, written here; the releases that today's
code would have accepted are built by hand, with a SHA256SUMS rewritten to match (as a careless or hostile
packager would)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from npuport.convert.converter import convert_qwen35
from npuport.fixtures.tiny_checkpoint import TinySpec, make_tiny
from npuport.release.package import ReleaseError, package_release
from npuport.release.verify import verify_release
from tests.test_release import SOURCE_NAME, make_report, silent

SHARD = "quant_model_weights-00001-of-00001.safetensors"
INDEX = "quant_model_weights.safetensors.index.json"
SECRET = b"SECRET-BYTES-0123456789"  # the start of every file planted outside a folder: never printed


def listing_checksum(folder: Path, names: list[str]) -> str:
    """sha256 of the `sha256sum` listing (`<hex>  <name>` lines, sorted by name) of `names` in `folder`."""
    lines = "".join(f"{hashlib.sha256((folder / n).read_bytes()).hexdigest()}  {n}\n" for n in sorted(names))
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


def folder_checksum(folder: Path) -> str:
    """What `validate` records as artifact_checksum: the listing checksum of every file under `folder`."""
    return listing_checksum(folder, [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()])


def artifact_part_checksum(release: Path) -> str:
    """The listing checksum of a release's files but README.md, SHA256SUMS and validation/."""
    names = [p.relative_to(release).as_posix() for p in release.rglob("*") if p.is_file()]
    return listing_checksum(release, [n for n in names if n.split("/")[0] not in ("README.md", "SHA256SUMS",
                                                                                   "validation")])


def report_for(folder: Path, out: Path) -> Path:
    """A validation report (test_release's figures) that records `folder`'s checksum, as validate does."""
    path = make_report(out)
    data = json.loads(path.read_text(encoding="utf-8"))
    data["artifact_checksum"] = folder_checksum(folder)
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")
    return path


def rewrite_sums(release: Path) -> None:
    """SHA256SUMS rewritten to match the release as it is now (what a packager that checks nothing writes)."""
    names = sorted(p.relative_to(release).as_posix() for p in release.rglob("*")
                   if p.name != "SHA256SUMS" and (p.is_file() or p.is_symlink()))
    lines = [f"{hashlib.sha256((release / n).read_bytes()).hexdigest() if (release / n).exists() else '0' * 64}  {n}"
             for n in names]
    (release / "SHA256SUMS").write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def plant_outside(path: Path) -> Path:
    """A file outside every folder under test, starting with SECRET."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(SECRET + bytes(64))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two artifacts of the same architecture (different weights) and a report measured on each."""
    root = tmp_path_factory.mktemp("binding-inputs")
    found = {}
    for key, seed in (("a", 0), ("b", 1)):
        src = make_tiny(root / f"{SOURCE_NAME}-{key}", TinySpec(seed=seed))
        art = convert_qwen35(src, root / f"{SOURCE_NAME}-{key}-w8a8", show_progress=False, log=silent).out
        found[key] = art
        found[f"report_{key}"] = report_for(art, root / f"report-{key}")
    return found


@pytest.fixture(scope="module")
def release_a(inputs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return package_release(inputs["a"], tmp_path_factory.mktemp("binding-releases") / "rel-a", inputs["report_a"],
                           log=silent)


@pytest.fixture
def damaged(release_a: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(release_a, tmp_path / "release"))


@pytest.fixture
def artifact(inputs: dict[str, Path], tmp_path: Path) -> Path:
    """A fresh copy of artifact a, for a test to change."""
    return Path(shutil.copytree(inputs["a"], tmp_path / "art"))


# ---------------------------------------------------------------------------------------------------------
# 1. package binds the report to the artifact


@pytest.mark.parametrize("force", [False, True])
def test_package_refuses_a_report_from_another_artifact_even_with_force(inputs: dict[str, Path], tmp_path: Path,
                                                                       force: bool) -> None:
    recorded, actual = folder_checksum(inputs["a"]), folder_checksum(inputs["b"])
    assert recorded != actual
    with pytest.raises(ReleaseError) as refused:
        package_release(inputs["b"], tmp_path / "rel", inputs["report_a"], force=force, archive=True, log=silent)
    message = str(refused.value)
    assert "\n" not in message and str(inputs["report_a"]) in message
    assert recorded[:12] in message and actual[:12] in message
    assert recorded not in message and actual not in message  # shortened
    assert list(tmp_path.iterdir()) == []


def test_cli_package_with_a_report_from_another_artifact_exits_1_with_one_line(inputs: dict[str, Path],
                                                                             tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "npuport.cli", "package", str(inputs["b"]), "--out",
                           str(tmp_path / "rel"), "--report", str(inputs["report_a"]), "--force"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "artifact_checksum" in errors[0] and folder_checksum(inputs["a"])[:12] in errors[0]
    assert "Traceback" not in done.stderr + done.stdout and not (tmp_path / "rel").exists()


def test_release_card_states_the_bound_checksum_and_what_verify_proves(release_a: Path,
                                                                      inputs: dict[str, Path]) -> None:
    card = (release_a / "README.md").read_text(encoding="utf-8")
    checksum = folder_checksum(inputs["a"])
    assert artifact_part_checksum(release_a) == checksum
    assert f"`artifact_checksum` (`{checksum[:12]}...`)" in card
    assert "signature over `SHA256SUMS`" in card
    assert verify_release(release_a) == []


# ---------------------------------------------------------------------------------------------------------
# 2. verify-release recomputes the checksum


def test_verify_release_catches_other_weights_under_the_report(damaged: Path, inputs: dict[str, Path]) -> None:
    """The weights of b put under a's report and card, SHA256SUMS rewritten: only the checksum tells."""
    for name in (SHARD, "quant_model_description.json", "config.json"):
        shutil.copyfile(inputs["b"] / name, damaged / name)
    rewrite_sums(damaged)
    recorded, actual = folder_checksum(inputs["a"]), artifact_part_checksum(damaged)
    assert actual != recorded
    assert verify_release(damaged) == [
        f"validation/report.json: artifact_checksum {recorded[:12]}... is not the checksum of this release's weights "
        f"and configs ({actual[:12]}...): the report measured other weights or configs, so its figures are not "
        "this model's"]


def test_verify_release_catches_a_changed_checksum_in_the_report(damaged: Path) -> None:
    path = damaged / "validation" / "report.json"
    report = json.loads(path.read_text(encoding="utf-8"))
    report["artifact_checksum"] = "0" * 64
    path.write_text(json.dumps(report), encoding="utf-8")
    rewrite_sums(damaged)
    problems = verify_release(damaged)
    assert len(problems) == 1 and problems[0].startswith("validation/report.json: artifact_checksum 000000000000...")
    assert f"({artifact_part_checksum(damaged)[:12]}...)" in problems[0]


# ---------------------------------------------------------------------------------------------------------
# 3. the path rule, for artifacts and releases


@pytest.mark.parametrize("how", ["absolute", "parent", "symlink"])
@pytest.mark.parametrize("force", [False, True])
def test_package_refuses_an_artifact_whose_weights_are_not_in_it(artifact: Path, inputs: dict[str, Path],
                                                                 tmp_path: Path, how: str, force: bool) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(artifact / SHARD, elsewhere / SHARD)
    if how == "symlink":
        (artifact / SHARD).symlink_to(elsewhere / SHARD)
        expected = f"names '{SHARD}', which resolves outside the folder"
    else:
        named = str(elsewhere / SHARD) if how == "absolute" else f"../elsewhere/{SHARD}"
        index = json.loads((artifact / INDEX).read_text(encoding="utf-8"))
        index["weight_map"] = {k: named for k in index["weight_map"]}
        (artifact / INDEX).write_text(json.dumps(index), encoding="utf-8")
        expected = f"{INDEX} names {named!r}, outside the folder"
    with pytest.raises(ReleaseError, match="outside the folder") as refused:
        package_release(artifact, tmp_path / "rel", inputs["report_a"], force=force, log=silent)
    assert expected in str(refused.value) and "\n" not in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "elsewhere"]


def test_package_refuses_a_file_that_links_out_of_the_artifact(artifact: Path, tmp_path: Path) -> None:
    secret = plant_outside(tmp_path / "private" / "notes.txt")
    (artifact / "LICENSE").symlink_to(secret)
    with pytest.raises(ReleaseError, match="'LICENSE', which resolves outside the folder") as refused:
        package_release(artifact, tmp_path / "rel", force=True, log=silent)
    assert SECRET.decode() not in str(refused.value) and not (tmp_path / "rel").exists()


@pytest.mark.parametrize("how", ["absolute", "parent"])
def test_verify_release_fails_a_release_whose_weights_are_not_in_it(damaged: Path, tmp_path: Path, how: str) -> None:
    """What today's package writes from an artifact whose index names shards elsewhere: no weights inside. The
    index names the real shard moved out (absolute), or a private file (relative, `../`)."""
    if how == "absolute":
        named = str(tmp_path / "elsewhere" / SHARD)
        Path(named).parent.mkdir()
        shutil.move(damaged / SHARD, named)
    else:
        plant_outside(tmp_path / "private" / "notes.txt")
        named = "../private/notes.txt"
        (damaged / SHARD).unlink()
    index = json.loads((damaged / INDEX).read_text(encoding="utf-8"))
    index["weight_map"] = {k: named for k in index["weight_map"]}
    (damaged / INDEX).write_text(json.dumps(index), encoding="utf-8")
    rewrite_sums(damaged)
    problems = verify_release(damaged)
    assert f"{INDEX} names {named!r}, outside the folder (only files inside it are read)" in problems
    assert not any(p.startswith("contract:") for p in problems)  # the shards were not read
    assert not any(SECRET.decode() in p for p in problems)


def test_verify_release_reports_a_symlink_out_instead_of_following_it(damaged: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere" / SHARD
    outside.parent.mkdir()
    shutil.move(damaged / SHARD, outside)
    (damaged / SHARD).symlink_to(outside)  # the same bytes: SHA256SUMS still matches through the link
    assert verify_release(damaged) == [
        f"the folder listing names '{SHARD}', which resolves outside the folder (a symlink out of it)"]


def test_verify_release_reports_sha256sums_entries_outside_the_release(damaged: Path, tmp_path: Path) -> None:
    secret = plant_outside(tmp_path / "private" / "key.txt")
    sums = damaged / "SHA256SUMS"
    digest = hashlib.sha256(secret.read_bytes()).hexdigest()
    sums.write_text(sums.read_text(encoding="utf-8") + f"{digest}  {secret}\n{digest}  ../private/key.txt\n",
                    encoding="utf-8")
    assert verify_release(damaged) == [
        "SHA256SUMS names '../private/key.txt', outside the folder (only files inside it are read)",
        f"SHA256SUMS names {str(secret)!r}, outside the folder (only files inside it are read)"]


# ---------------------------------------------------------------------------------------------------------
# 4. the release contract, and code


@pytest.mark.parametrize(("removed", "expected"), [
    ("tokenizer.json", "release contract: no tokenizer (needs tokenizer.json or vocab.json + merges.txt or "
                       "tokenizer.model)"),
    ("tokenizer_config.json", "release contract: no tokenizer config (needs tokenizer_config.json)"),
    ("chat_template.jinja", "release contract: no chat template (needs chat_template.jinja or chat_template.json "
                            "or 'chat_template' in tokenizer_config.json)"),
])
def test_verify_release_requires_the_files_engines_need(damaged: Path, removed: str, expected: str) -> None:
    template = (damaged / "chat_template.jinja").read_text(encoding="utf-8")
    (damaged / removed).unlink()
    rewrite_sums(damaged)
    problems = verify_release(damaged)
    assert [p for p in problems if p.startswith("release contract:")] == [expected]
    # an engine rule may say it as well (the tokenizer files), in a line of its own
    assert all(p == expected or "[engine rule " in p for p in problems[:-1])
    # the files are no longer those the report measured, and the checksum says so too
    assert problems[-1].startswith("validation/report.json: artifact_checksum ")
    if removed == "chat_template.jinja":  # the older layout: the template inside the tokenizer config
        config = json.loads((damaged / "tokenizer_config.json").read_text(encoding="utf-8"))
        (damaged / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}),
                                                       encoding="utf-8")
        rewrite_sums(damaged)
        assert [p for p in verify_release(damaged) if p.startswith("release contract")] == []


def test_package_refuses_an_artifact_without_a_chat_template_unless_forced(artifact: Path, tmp_path: Path) -> None:
    (artifact / "chat_template.jinja").unlink()
    with pytest.raises(ReleaseError, match="release contract: no chat template"):
        package_release(artifact, tmp_path / "rel", log=silent)
    out = package_release(artifact, tmp_path / "rel", force=True, log=silent)
    head = (out / "README.md").read_text(encoding="utf-8").split("# ", 1)[0]
    assert "WARNING: packaged with --force" in head and "no chat template" in head
    assert any(p.startswith("release contract: no chat template") for p in verify_release(out))


def test_code_in_an_artifact_is_refused_and_flagged_in_the_release(artifact: Path, tmp_path: Path) -> None:
    (artifact / "modeling_qwen3_5.py").write_text("import os\nos.system('true')\n", encoding="utf-8")
    config = json.loads((artifact / "config.json").read_text(encoding="utf-8"))
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_qwen3_5.Qwen3_5ForCausalLM"}
    (artifact / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ReleaseError) as refused:
        package_release(artifact, tmp_path / "rel", log=silent)
    assert "code: modeling_qwen3_5.py is Python code" in str(refused.value)
    assert "code: config.json has 'auto_map'" in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]

    out = package_release(artifact, tmp_path / "rel", force=True, log=silent)
    assert sorted(p for p in verify_release(out) if p.startswith("code:")) == [
        "code: config.json has 'auto_map', which makes transformers import Python classes (trust_remote_code)",
        "code: modeling_qwen3_5.py is Python code; a release of weights carries none"]


def test_verify_release_flags_code_added_to_a_release(damaged: Path) -> None:
    (damaged / "validation" / "plot_helper.py").write_text("print('hi')\n", encoding="utf-8")
    config = json.loads((damaged / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["auto_map"] = {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}
    (damaged / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    rewrite_sums(damaged)
    problems = verify_release(damaged)
    assert "code: validation/plot_helper.py is Python code; a release of weights carries none" in problems
    assert ("code: tokenizer_config.json has 'auto_map', which makes transformers import Python classes "
            "(trust_remote_code)") in problems


def test_verify_release_reads_nothing_through_a_folder_linked_out(damaged: Path, tmp_path: Path) -> None:
    outside = Path(shutil.copytree(damaged / "validation", tmp_path / "elsewhere"))
    shutil.rmtree(damaged / "validation")
    os.symlink(outside, damaged / "validation")
    assert verify_release(damaged) == [
        "the folder listing names 'validation', which resolves outside the folder (a symlink out of it)"]
