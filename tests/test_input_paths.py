"""Nothing is read from outside a model folder: shard names in a source's or an artifact's index that are absolute,
climb out with `..`, or are symlinks resolving elsewhere are refused by convert, `npuport check` and the runtime's
loader, with one line naming the folder and the entry and never the bytes of the file pointed at. The one
exception: a Hugging Face cache snapshot, whose files are symlinks into that same repo's blobs."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from npuport.cli import main
from npuport.errors import ArtifactError, CheckpointError
from npuport.runtime.loader import load_model

SOURCE_INDEX = "model.safetensors.index.json"
ARTIFACT_INDEX = "quant_model_weights.safetensors.index.json"
SECRET = b"hunter2:x:0:0:not a safetensors file\n"


def run(*args: str):
    return CliRunner().invoke(main, [*args])


def one_line_error(result, *needles: str) -> str:
    """The CLI's error line, after checking it failed with exit 1, one line, no traceback, naming every needle."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def copy_model(folder: Path, tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(folder, dst)
    return dst


def repoint_shard(model: Path, index_name: str, new_name: str) -> tuple[str, Path]:
    """Move the model's last shard to `tmp/elsewhere/` and make the index name it as `new_name`, formatted with
    {outside} (the shard's new path) and {shard} (its file name). Returns (the entry written, the moved file)."""
    index = json.loads((model / index_name).read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    outside = model.parent / "elsewhere" / shard
    outside.parent.mkdir(exist_ok=True)
    shutil.move(model / shard, outside)
    entry = new_name.format(outside=outside, shard=shard)
    index["weight_map"] = {k: entry if v == shard else v for k, v in index["weight_map"].items()}
    (model / index_name).write_text(json.dumps(index))
    return entry, outside


ENTRIES = {
    "absolute": "{outside}",
    "dot-dot": "../elsewhere/{shard}",
    "dot-dot-inside-first": "sub/../../elsewhere/{shard}",
}


@pytest.mark.parametrize("form", sorted(ENTRIES))
def test_convert_refuses_a_source_index_naming_a_shard_outside(tiny_checkpoints, tmp_path, form):
    src = copy_model(tiny_checkpoints["dense-text"], tmp_path, "src")
    entry, _ = repoint_shard(src, SOURCE_INDEX, ENTRIES[form])
    out = tmp_path / "out"
    one_line_error(run("convert-qwen35", "--a8w8", str(src), str(out), "--quiet"), str(src), repr(entry), "outside")
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_symlinks_are_followed_only_inside_the_folder(tiny_checkpoints, tmp_path):
    src = copy_model(tiny_checkpoints["dense-text"], tmp_path, "src")
    shard = sorted(p.name for p in src.glob("*.safetensors"))[-1]
    (src / "weights").mkdir()
    shutil.move(src / shard, src / "weights" / shard)
    (src / shard).symlink_to(Path("weights") / shard)  # inside: followed
    assert run("convert-qwen35", "--a8w8", str(src), str(tmp_path / "ok"), "--quiet").exit_code == 0
    shutil.move(src / "weights", tmp_path / "weights")
    (src / shard).unlink()
    (src / shard).symlink_to(Path("..") / "weights" / shard)  # out of the folder: refused
    out = tmp_path / "out"
    one_line_error(run("convert-qwen35", "--a8w8", str(src), str(out), "--quiet"), str(src), repr(shard),
                   "resolves outside the folder")
    assert not out.exists()
    with pytest.raises(CheckpointError, match="resolves outside the folder"):
        load_model(src, "cpu")


def test_a_copied_file_symlinked_out_of_the_source_is_refused(tiny_checkpoints, tmp_path):
    src = copy_model(tiny_checkpoints["dense-text"], tmp_path, "src")
    secret = tmp_path / "private.json"
    secret.write_bytes(SECRET)
    (src / "tokenizer_config.json").unlink()
    (src / "tokenizer_config.json").symlink_to(secret)  # would be copied into the artifact
    out = tmp_path / "out"
    line = one_line_error(run("convert-qwen35", "--a8w8", str(src), str(out), "--quiet"),
                          "'tokenizer_config.json'", "outside")
    assert "hunter2" not in line and not out.exists()


def test_an_entry_pointing_at_a_foreign_file_never_prints_its_bytes(tiny_checkpoints, tmp_path):
    src = copy_model(tiny_checkpoints["dense-text"], tmp_path, "src")
    secret = tmp_path / "passwd"
    secret.write_bytes(SECRET)
    index = json.loads((src / SOURCE_INDEX).read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../passwd"
    (src / SOURCE_INDEX).write_text(json.dumps(index))
    line = one_line_error(run("convert-qwen35", "--a8w8", str(src), str(tmp_path / "out"), "--quiet"),
                          "'../passwd'")
    first8 = struct.unpack("<Q", SECRET[:8])[0]
    assert "hunter2" not in line and str(first8) not in line and f"{first8:,}" not in line, line


@pytest.mark.parametrize("form", ["absolute", "dot-dot"])
def test_check_and_loader_refuse_an_artifact_whose_weights_are_outside(tiny_artifacts, tmp_path, form):
    art = copy_model(tiny_artifacts["dense-text"], tmp_path, "art")
    entry, _ = repoint_shard(art, ARTIFACT_INDEX, ENTRIES[form])
    result = run("check", str(art))
    assert result.exit_code == 1, result.output
    fails = [line for line in result.output.splitlines() if line.startswith("FAIL")]
    assert any(repr(entry) in line and "outside" in line for line in fails), result.output
    with pytest.raises(ArtifactError, match="outside the folder") as refused:
        load_model(art, "cpu")
    assert repr(entry) in str(refused.value) and "\n" not in str(refused.value)


def hub_snapshot(source: Path, cache: Path, repo: str = "models--org--tiny") -> Path:
    """`source` laid out as the Hugging Face cache lays a download out: every file a blob named by its hash in
    `<repo>/blobs`, and `<repo>/snapshots/<revision>/<file>` a relative symlink to it."""
    blobs, snapshot = cache / repo / "blobs", cache / repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for p in sorted(source.iterdir()):
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
        shutil.copyfile(p, blobs / digest)
        (snapshot / p.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    return snapshot


def test_a_hub_cache_snapshot_may_point_into_its_own_blobs_only(tiny_checkpoints, tmp_path):
    snapshot = hub_snapshot(tiny_checkpoints["dense-text"], tmp_path / "hub")
    assert run("convert-qwen35", "--a8w8", str(snapshot), str(tmp_path / "ok"), "--quiet").exit_code == 0
    assert load_model(snapshot, "cpu").config.num_hidden_layers > 0
    # a snapshot file pointing into another repo's blobs is outside what the user passed
    other = hub_snapshot(tiny_checkpoints["dense-text"], tmp_path / "hub", "models--someone--else")
    shard = sorted(p.name for p in snapshot.glob("*.safetensors"))[-1]
    blob = Path(os.readlink(other / shard)).name
    (snapshot / shard).unlink()
    (snapshot / shard).symlink_to(Path("..") / ".." / ".." / "models--someone--else" / "blobs" / blob)
    out = tmp_path / "out"
    one_line_error(run("convert-qwen35", "--a8w8", str(snapshot), str(out), "--quiet"), repr(shard),
                   "resolves outside the folder")
    assert not out.exists()
