"""convert and package never lose data and never leave garbage: --force replaces only what npuport wrote, the swap
into place keeps the previous output until the new one is in, what a killed run left is put right by the next
run, stale partials do not count against the free space, every byte is written however short the writes, and a
full disk is one line naming the file. (Real signals and kills, in subprocesses: tests/test_signals.py.)"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import resource
import shutil
import signal
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

import npuport.checksums as checksums
import npuport.convert.safetensors_io as safetensors_io
import npuport.release.package as package_module
from npuport.cli import main
from npuport.convert.converter import convert_qwen35
from npuport.convert.safetensors_io import DTYPE_NAMES, OutSpec, ShardWriter
from npuport.errors import NpuportError
from npuport.release.package import ReleaseError, package_release

GIB = 1024**3


def silent(_: str) -> None:
    pass


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path (symlinks followed, as a user reading it would)."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(parent: Path) -> list[str]:
    """Hidden names npuport uses while writing, setting aside or swapping, found in `parent`."""
    return sorted(p.name for p in parent.iterdir() if ".npuport-" in p.name)


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


def the_error(result) -> str:
    """The one `error:` line of a failed command, after checking there is exactly one and no traceback."""
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    return errors[0]


@pytest.fixture
def src(tiny_checkpoints, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_checkpoints["dense-multimodal"], tmp_path / "src"))


@pytest.fixture(scope="module")
def artifact(tiny_checkpoints, tmp_path_factory) -> Path:
    """An artifact to package (never modified by the tests: each copies or reads it)."""
    out = tmp_path_factory.mktemp("artifact") / "art"
    return convert_qwen35(tiny_checkpoints["dense-multimodal"], out, show_progress=False, log=silent).out


def convert(src: Path, out: Path, **kwargs) -> Path:
    return convert_qwen35(src, out, show_progress=False, log=kwargs.pop("log", silent), **kwargs).out


# ---------------------------------------------------------------------------------------------------------
# 1. --force replaces only what npuport wrote, never a folder that holds the source or lies inside it


def test_force_never_deletes_a_folder_that_holds_the_source(tiny_checkpoints, tmp_path: Path) -> None:
    models = tmp_path / "models"
    source = Path(shutil.copytree(tiny_checkpoints["dense-multimodal"], models / "Qwen-src"))
    (models / "notes.txt").write_text("mine", encoding="utf-8")
    before = digests(models)
    error = the_error(cli("convert-qwen35", "--a8w8", str(source), str(models), "--force", "--quiet"))
    assert f"{models} contains the source {source}" in error
    assert digests(models) == before and leftovers(tmp_path) == []


def test_force_never_writes_into_the_source(src: Path, tmp_path: Path) -> None:
    before = digests(src)
    error = the_error(cli("convert-qwen35", "--a8w8", str(src), str(src / "w8a8"), "--force", "--quiet"))
    assert f"{src / 'w8a8'} is inside the source {src}" in error
    assert digests(src) == before and leftovers(src) == []


def _user_folder(out: Path, artifact: Path) -> None:
    out.mkdir()
    (out / "keep.txt").write_text("mine", encoding="utf-8")


def _foreign_manifest(out: Path, artifact: Path) -> None:
    shutil.copytree(artifact, out)
    (out / "npuport_manifest.json").write_text('{"tool": "somebody-else"}', encoding="utf-8")


def _artifact_with_a_subfolder(out: Path, artifact: Path) -> None:
    shutil.copytree(artifact, out)
    (out / "my-notes").mkdir()
    (out / "my-notes" / "todo.txt").write_text("mine", encoding="utf-8")


def _release_with_an_added_file(out: Path, artifact: Path) -> None:
    package_release(artifact, out, log=silent)
    (out / "notes.txt").write_text("mine", encoding="utf-8")


def _link_to_an_artifact(out: Path, artifact: Path) -> None:
    target = Path(shutil.copytree(artifact, out.parent / "elsewhere"))
    out.symlink_to(target, target_is_directory=True)


NOT_OURS = {
    "user folder": (_user_folder, "holds no npuport_manifest.json"),
    "foreign manifest": (_foreign_manifest, "npuport_manifest.json was not written by npuport"),
    "artifact with a subfolder": (_artifact_with_a_subfolder, "holds my-notes"),
    "release with an added file": (_release_with_an_added_file, "holds notes.txt, which its SHA256SUMS does not list"),
    "symlink to an artifact": (_link_to_an_artifact, "symbolic link"),
}


@pytest.mark.parametrize("kind", sorted(NOT_OURS))
def test_force_refuses_to_replace_what_npuport_did_not_write(kind: str, src: Path, artifact: Path,
                                                             tmp_path: Path) -> None:
    make, why = NOT_OURS[kind]
    out = tmp_path / "out"
    make(out, artifact)
    before = digests(out)
    error = the_error(cli("convert-qwen35", "--a8w8", str(src), str(out), "--force", "--quiet"))
    assert f"{out} already exists, and --force would not replace it" in error and why in error
    assert digests(out) == before and leftovers(tmp_path) == []


@pytest.mark.parametrize("kind", ["artifact", "release", "empty folder"])
def test_force_replaces_an_npuport_output_or_an_empty_folder(kind: str, src: Path, artifact: Path,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "out"
    if kind == "artifact":
        shutil.copytree(artifact, out)
    elif kind == "release":
        package_release(artifact, out, log=silent)
    else:
        out.mkdir()
    done = cli("convert-qwen35", "--a8w8", str(src), str(out), "--force", "--quiet")
    assert done.exit_code == 0, done.output
    assert not (out / "SHA256SUMS").exists() and (out / "npuport_manifest.json").is_file()
    assert leftovers(tmp_path) == []


def _tar_listing(tar_path: Path) -> dict[str, str]:
    with tarfile.open(tar_path) as tar:
        return {m.name: hashlib.sha256(tar.extractfile(m).read()).hexdigest() for m in tar.getmembers() if m.isfile()}


def test_package_force_replaces_its_own_release_and_archive(artifact: Path, tmp_path: Path) -> None:
    rel = tmp_path / "rel"
    package_release(artifact, rel, archive=True, base_model="org/first", log=silent)
    package_release(artifact, rel, archive=True, force=True, base_model="org/second", log=silent)
    card = (rel / "README.md").read_text(encoding="utf-8")
    assert "org/second" in card and "org/first" not in card
    tar_path = tmp_path / "rel.tar"
    digest = hashlib.sha256(tar_path.read_bytes()).hexdigest()
    assert (tmp_path / "rel.tar.sha256").read_text(encoding="utf-8") == f"{digest}  rel.tar\n"
    assert _tar_listing(tar_path) == {f"rel/{name}": d for name, d in digests(rel).items()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rel", "rel.tar", "rel.tar.sha256"]


def test_package_force_refuses_the_artifact_the_report_and_a_foreign_archive(artifact: Path, tmp_path: Path) -> None:
    with pytest.raises(ReleaseError, match="is the artifact"):
        package_release(artifact, artifact, force=True, log=silent)
    reports = tmp_path / "reports"
    (reports / "validation").mkdir(parents=True)
    (reports / "validation" / "report.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ReleaseError, match="contains the report"):
        package_release(artifact, reports, reports / "validation" / "report.json", force=True, log=silent)
    (tmp_path / "rel.tar").write_bytes(b"somebody's archive")
    with pytest.raises(ReleaseError, match=r"rel.tar already exists, and --force would not replace it: rel.tar has no"):
        package_release(artifact, tmp_path / "rel", archive=True, force=True, log=silent)
    assert (tmp_path / "rel.tar").read_bytes() == b"somebody's archive"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rel.tar", "reports"]


# ---------------------------------------------------------------------------------------------------------
# 3. The swap into place: the previous output survives a failure between the renames; leftovers are put right


def _failing_rename_into(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """os.rename fails when a partial output is moved onto `target` (after the previous one was set aside)."""
    real = os.rename

    def rename(a, b, *args, **kwargs):
        if Path(b) == target and os.fspath(a).endswith(".npuport-partial"):
            raise OSError(errno.EIO, "Input/output error")
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)


def test_a_failed_swap_keeps_the_previous_artifact(src: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    out = convert(src, tmp_path / "out")
    before = digests(out)
    _failing_rename_into(out, monkeypatch)
    with pytest.raises(NpuportError, match="Input/output error") as failure:
        convert(src, out, force=True, part_file_size_gb=0.0001)
    assert "\n" not in str(failure.value)
    assert digests(out) == before and leftovers(tmp_path) == []


def test_a_failed_swap_keeps_the_previous_release_and_its_archive(artifact: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    rel = tmp_path / "rel"
    package_release(artifact, rel, archive=True, base_model="org/first", log=silent)
    before = {name: digests(tmp_path)[name] for name in ("rel.tar", "rel.tar.sha256")} | digests(rel)
    _failing_rename_into(rel, monkeypatch)  # the new rel.tar is already in place when this fails
    with pytest.raises(ReleaseError, match="Input/output error"):
        package_release(artifact, rel, archive=True, force=True, base_model="org/second", log=silent)
    assert {name: digests(tmp_path)[name] for name in ("rel.tar", "rel.tar.sha256")} | digests(rel) == before
    assert leftovers(tmp_path) == []


def test_a_set_aside_artifact_is_restored_or_removed_by_the_next_run(src: Path, tmp_path: Path) -> None:
    out = convert(src, tmp_path / "out")
    before = digests(out)
    # What a kill between the renames of --force leaves: OUT set aside, nothing in its place, the new one partial.
    out.rename(tmp_path / ".out.npuport-old")
    (tmp_path / ".out.npuport-partial").mkdir()
    (tmp_path / ".out.npuport-partial" / "quant_model_weights-00001-of-00001.safetensors").write_bytes(bytes(1000))
    logs: list[str] = []
    with pytest.raises(NpuportError, match="already exists; pass --force to replace it"):
        convert(src, out, log=logs.append)
    assert any(line.startswith(f"restored {out} from .out.npuport-old") for line in logs), logs
    assert any(line.startswith("removed .out.npuport-partial") for line in logs), logs
    assert digests(out) == before and leftovers(tmp_path) == []

    shutil.copytree(out, tmp_path / ".out.npuport-old")  # killed after the new one was in place: only the old is left
    logs.clear()
    convert(src, out, force=True, log=logs.append)
    assert any(line.startswith("removed .out.npuport-old") for line in logs), logs
    assert leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------------------------------
# 4. Stale partials of our own do not count against the free space; when it is short, what holds it is named


def test_a_stale_partial_is_removed_before_the_free_space_check(src: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / ".out.npuport-partial"
    stale.mkdir()
    with open(stale / "quant_model_weights-00001-of-00002.safetensors", "wb") as f:
        f.truncate(GIB)  # sparse: takes its size on this fake disk only
    real = shutil.disk_usage

    def disk_of_one_gib(path):
        held = sum(p.stat().st_size for p in stale.rglob("*") if p.is_file()) if stale.exists() else 0
        return real(path)._replace(free=GIB - held)

    monkeypatch.setattr(shutil, "disk_usage", disk_of_one_gib)
    logs: list[str] = []
    convert(src, tmp_path / "out", log=logs.append)
    assert "removed .out.npuport-partial (1.00 GB), left by a run that was stopped" in logs
    assert leftovers(tmp_path) == []


def test_short_space_names_what_holds_it(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = convert(src, tmp_path / "out")
    other = tmp_path / ".other.npuport-partial"  # another output's: named, never removed
    other.mkdir()
    (other / "shard.safetensors").write_bytes(bytes(1000))
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=1000))
    error = the_error(cli("convert-qwen35", "--a8w8", str(src), str(out), "--force", "--quiet"))
    assert "not enough disk space" in error
    assert f"{out} (0.00 GB, kept until the new artifact is complete)" in error
    assert ".other.npuport-partial (0.00 GB, another npuport output, unfinished)" in error
    assert (other / "shard.safetensors").stat().st_size == 1000 and leftovers(tmp_path) == [".other.npuport-partial"]


# ---------------------------------------------------------------------------------------------------------
# 5. Every writer writes every byte, however few each write call takes


class ShortWrites(io.FileIO):
    """A raw file whose write() takes at most 1000 bytes per call, as the kernel may (e.g. 2 GiB - 4 KiB on Linux)."""

    def write(self, data) -> int:
        return super().write(bytes(memoryview(data).cast("B")[:1000]))


def short_writing_open(file, mode="r", buffering=-1, **kwargs):
    if "r" in mode:
        return open(file, mode, buffering, **kwargs)
    return ShortWrites(file, mode.replace("b", ""))


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(37, 53, generator=gen).to(torch.bfloat16),
            "b.weight": torch.randint(-128, 128, (300, 7), generator=gen, dtype=torch.int8),
            "d.ids": torch.arange(5, dtype=torch.int64)}


@pytest.mark.parametrize("with_scalar", [False, True], ids=["row-blocks", "and-a-scalar"])
def test_shard_writer_writes_every_byte_of_short_writes(with_scalar: bool, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = _tensors() | ({"c.scalar": torch.tensor(1.5, dtype=torch.float32)} if with_scalar else {})
    monkeypatch.setattr(safetensors_io, "open", short_writing_open, raising=False)
    writer = ShardWriter(tmp_path / "s.safetensors", [OutSpec(n, DTYPE_NAMES[t.dtype], tuple(t.shape))
                                                       for n, t in tensors.items()], {"format": "pt"})
    for name, t in tensors.items():
        for rows in (t.split(11) if t.dim() else [t]):  # a tensor in several pieces, as convert writes row blocks
            writer.write(name, rows)
    writer.close()
    loaded = load_file(tmp_path / "s.safetensors")
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    with safe_open(tmp_path / "s.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_package_copies_and_archives_every_byte_of_short_writes(artifact: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksums, "open", short_writing_open, raising=False)
    monkeypatch.setattr(package_module, "open", short_writing_open, raising=False)
    rel = package_release(artifact, tmp_path / "rel", archive=True, log=silent)
    monkeypatch.undo()
    assert {name: d for name, d in digests(rel).items() if name not in ("README.md", "SHA256SUMS")} == digests(artifact)
    sums = dict(line.split("  ")[::-1] for line in (rel / "SHA256SUMS").read_text(encoding="utf-8").splitlines())
    assert sums == {name: d for name, d in digests(rel).items() if name != "SHA256SUMS"}
    assert _tar_listing(tmp_path / "rel.tar") == {f"rel/{name}": d for name, d in digests(rel).items()}


# ---------------------------------------------------------------------------------------------------------
# 6. A full disk (here: the kernel's file-size limit, the same failing write) is one line naming the file


@contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """Writes past `limit` bytes of any file fail with EFBIG, as writes to a full disk fail with ENOSPC."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel's signal ends the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_disk_full_in_package_is_one_line_naming_the_file(artifact: Path, tmp_path: Path) -> None:
    rel = tmp_path / "rel"
    with file_size_limit(100_000):
        result = cli("package", str(artifact), "--out", str(rel), "--archive")
    error = the_error(result)
    shard = "quant_model_weights-00001-of-00001.safetensors"
    assert error == f"error: {rel}/{shard}: File too large; {rel} was not written"
    assert "BufferError" not in result.output and list(tmp_path.iterdir()) == []


def test_disk_full_in_convert_is_one_line_naming_the_file(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with file_size_limit(100_000):
        result = cli("convert-qwen35", "--a8w8", str(src), str(out), "--quiet")
    shard = "quant_model_weights-00001-of-00001.safetensors"
    assert the_error(result) == f"error: {out}/{shard}: File too large; {out} was not written"
    assert leftovers(tmp_path) == [] and not out.exists()
