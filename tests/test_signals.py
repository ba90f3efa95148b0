"""Fault injection with real signals: `npuport convert-qwen35 --a8w8` and `npuport package` run as subprocesses
and get SIGINT, SIGTERM or SIGKILL at known points (while shards are written with --workers 2, while files are
copied, between the renames of the swap). Afterwards nothing of npuport's is left beside OUT, OUT is absent or the
previous one intact, and a re-run succeeds. Two more points are reached in this process, the command sending
itself the signal (SIGHUP while package copies, SIGTERM between the renames of the swap).

The subprocess is the CLI with one pause added (RUNNER below): the slowed steps keep the command busy long
enough to be signalled at that point, whatever the machine's speed."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import npuport.release.package as package_module
from npuport.cli import main
from npuport.convert.check import check_artifact
from npuport.convert.converter import convert_qwen35
from npuport.errors import NpuportError
from npuport.release.package import package_release
from tests.test_output_safety import digests, leftovers, silent

RUNNER = r"""
import os, sys, time
from pathlib import Path

point, args = sys.argv[1], sys.argv[2:]
mark = Path(os.environ["NPUPORT_TEST_MARK"])
if point == "slow-shards":  # every block a shard writer takes waits 50 ms; each shard opened is logged to `mark`
    from npuport.convert.safetensors_io import ShardWriter
    real_init, real_write = ShardWriter.__init__, ShardWriter.write
    def init(self, path, *rest):
        with open(mark, "a") as log:
            log.write(Path(path).name + "\n")
        real_init(self, path, *rest)
    def write(self, name, data):
        time.sleep(0.05)
        real_write(self, name, data)
    ShardWriter.__init__, ShardWriter.write = init, write
elif point == "slow-copies":  # every file package copies waits 200 ms first
    import npuport.release.package as package
    real_copy = package.copy_with_sha256
    def copy(src, dst):
        time.sleep(0.2)
        return real_copy(src, dst)
    package.copy_with_sha256 = copy
else:  # "<seconds>:<name>": pause before a partial output is renamed to <name>; `mark` says the pause began
    seconds, name = point.split(":")
    real_rename = os.rename
    def rename(a, b, *rest, **kwargs):
        if os.path.basename(os.fspath(b)) == name and os.fspath(a).endswith(".npuport-partial"):
            mark.write_text("paused")
            time.sleep(float(seconds))
        return real_rename(a, b, *rest, **kwargs)
    os.rename = rename
from npuport.cli import main
main(args, prog_name="npuport")
"""

SMALL_SHARDS = ("--part-file-size", "0.00005")  # 15 shards of the tiny checkpoint




class Run:
    """`npuport ARGS` in a subprocess, paused or slowed at `point` (see RUNNER)."""

    def __init__(self, tmp_path: Path, point: str, *args: str | Path) -> None:
        self.mark = tmp_path / "mark.log"
        env = {**os.environ, "NPUPORT_TEST_MARK": str(self.mark)}
        self.proc = subprocess.Popen([sys.executable, "-c", RUNNER, point, *map(str, args)], cwd=tmp_path, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_for(self, path: Path, timeout: float = 60.0) -> None:
        """Until `path` exists (the command reached the point); fails if the command ends first."""
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                out, err = self.proc.communicate()
                pytest.fail(f"{path.name} never appeared (exit {self.proc.returncode}):\n{out}\n{err}")
            time.sleep(0.005)

    def signal(self, signum: int) -> tuple[int, str, float]:
        """Send `signum`; the exit status, stderr and seconds until the process ended."""
        sent = time.monotonic()
        self.proc.send_signal(signum)
        _, err = self.proc.communicate(timeout=60)
        return self.proc.returncode, err, time.monotonic() - sent

    def opened_shards(self) -> int:
        return len(self.mark.read_text().splitlines()) if self.mark.exists() else 0


@pytest.fixture
def src(tiny_checkpoints, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_checkpoints["dense-multimodal"], tmp_path / "src"))


def convert(src: Path, out: Path, **kwargs) -> Path:
    return convert_qwen35(src, out, show_progress=False, log=kwargs.pop("log", silent), **kwargs).out


def test_ctrl_c_with_two_workers_stops_promptly_and_leaves_nothing(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = Run(tmp_path, "slow-shards", "convert-qwen35", "--a8w8", src, out, "--workers", "2", *SMALL_SHARDS,
              "--quiet")
    run.wait_for(tmp_path / ".out.npuport-partial")
    run.wait_for(run.mark)
    opened = run.opened_shards()
    status, err, seconds = run.signal(signal.SIGINT)
    assert run.opened_shards() <= opened + 2, "queued shards were started after Ctrl-C"
    assert seconds < 5.0
    # what the run said, should it leave something behind (seen once under a loaded machine, not reproduced since)
    assert not out.exists() and leftovers(tmp_path) == [], f"exit {status}, shards opened {run.opened_shards()}:\n{err}"
    assert status == 128 + signal.SIGINT and "error: stopped by SIGINT" in err and "Traceback" not in err, err
    convert(src, out, workers=2, part_file_size_gb=0.00005)
    assert check_artifact(out) == [] and leftovers(tmp_path) == []


def test_sigterm_during_convert_keeps_the_previous_artifact(src: Path, tmp_path: Path) -> None:
    out = convert(src, tmp_path / "out")
    before = digests(out)
    run = Run(tmp_path, "slow-shards", "convert-qwen35", "--a8w8", src, out, "--force", "--workers", "2",
              *SMALL_SHARDS, "--quiet")
    run.wait_for(tmp_path / ".out.npuport-partial")
    status, err, _ = run.signal(signal.SIGTERM)
    assert digests(out) == before and leftovers(tmp_path) == []
    assert status == 128 + signal.SIGTERM and "error: stopped by SIGTERM" in err and "Traceback" not in err, err
    convert(src, out, force=True, part_file_size_gb=0.00005)
    assert check_artifact(out) == [] and digests(out) != before and leftovers(tmp_path) == []


def test_sigkill_between_the_renames_is_put_right_by_the_next_run(src: Path, tmp_path: Path) -> None:
    out = convert(src, tmp_path / "out")
    before = digests(out)
    run = Run(tmp_path, "60:out", "convert-qwen35", "--a8w8", src, out, "--force", *SMALL_SHARDS, "--quiet")
    run.wait_for(run.mark)
    status, _, _ = run.signal(signal.SIGKILL)
    assert status == -signal.SIGKILL
    assert not out.exists() and (tmp_path / ".out.npuport-old").is_dir()  # killed between the two renames
    logs: list[str] = []
    with pytest.raises(NpuportError, match="already exists; pass --force to replace it"):
        convert(src, out, log=logs.append)
    assert any(line.startswith(f"restored {out} from .out.npuport-old") for line in logs), logs
    assert digests(out) == before and leftovers(tmp_path) == []


@pytest.fixture
def artifact(tiny_checkpoints, tmp_path: Path) -> Path:
    return convert(tiny_checkpoints["dense-multimodal"], tmp_path / "art")


def test_sigterm_during_package_leaves_nothing(artifact: Path, tmp_path: Path) -> None:
    rel = tmp_path / "rel"
    run = Run(tmp_path, "slow-copies", "package", artifact, "--out", rel, "--archive")
    run.wait_for(tmp_path / ".rel.npuport-partial")
    status, err, _ = run.signal(signal.SIGTERM)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    assert status == 128 + signal.SIGTERM and "error: stopped by SIGTERM" in err and "Traceback" not in err, err
    package_release(artifact, rel, archive=True, log=silent)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "rel", "rel.tar", "rel.tar.sha256"]


def test_sigkill_between_the_archive_and_its_folder_is_put_right_by_the_next_run(artifact: Path,
                                                                                 tmp_path: Path) -> None:
    rel = tmp_path / "rel"
    run = Run(tmp_path, "60:rel", "package", artifact, "--out", rel, "--archive")
    run.wait_for(run.mark)
    status, _, _ = run.signal(signal.SIGKILL)
    assert status == -signal.SIGKILL
    assert (tmp_path / "rel.tar").is_file() and not rel.exists()  # the archive in place, its folder not yet
    logs: list[str] = []
    package_release(artifact, rel, archive=True, log=logs.append)
    assert any(line.startswith(f"removed {tmp_path / 'rel.tar'}: moved into place by a run stopped") for line in logs)
    digest = hashlib.sha256((tmp_path / "rel.tar").read_bytes()).hexdigest()
    assert (tmp_path / "rel.tar.sha256").read_text(encoding="utf-8") == f"{digest}  rel.tar\n"
    with tarfile.open(tmp_path / "rel.tar") as tar:
        assert {m.name for m in tar.getmembers() if m.isfile()} == {f"rel/{name}" for name in digests(rel)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "mark.log", "rel", "rel.tar", "rel.tar.sha256"]


# ---------------------------------------------------------------------------------------------------------
# In this process: the command signals itself at a point a test could not hit from outside reliably


class SignalReachedTheTest(Exception):
    pass


@pytest.fixture
def guarded_signals():
    """While a test runs, SIGTERM and SIGHUP that get past the command's own handling fail the test instead of
    ending pytest (their default action)."""
    def reached(signum, frame):
        raise SignalReachedTheTest(signal.Signals(signum).name)

    previous = {s: signal.signal(s, reached) for s in (signal.SIGTERM, signal.SIGHUP)}
    yield
    for s, handler in previous.items():
        signal.signal(s, handler)


def test_sighup_during_package_cleans_up_like_ctrl_c(artifact: Path, tmp_path: Path, guarded_signals,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    real_copy, copied = package_module.copy_with_sha256, []

    def copy_then_hang_up(src: Path, dst: Path) -> str:
        copied.append(dst)
        if len(copied) == 3:
            os.kill(os.getpid(), signal.SIGHUP)  # the terminal closed while files are copied
        return real_copy(src, dst)

    monkeypatch.setattr(package_module, "copy_with_sha256", copy_then_hang_up)
    result = CliRunner().invoke(main, ["package", str(artifact), "--out", str(tmp_path / "rel"), "--archive"])
    assert result.exit_code == 128 + signal.SIGHUP and "error: stopped by SIGHUP" in result.output, result.output
    assert len(copied) == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_sigterm_between_the_renames_lets_them_finish_and_the_run_ends_as_done(
        src: Path, tmp_path: Path, guarded_signals, monkeypatch: pytest.MonkeyPatch) -> None:
    out = convert(src, tmp_path / "out")
    before = digests(out)
    real_rename = os.rename

    def rename(a, b, *rest, **kwargs):
        if Path(b) == out and os.fspath(a).endswith(".npuport-partial"):
            os.kill(os.getpid(), signal.SIGTERM)  # the previous artifact is set aside, the new one not yet in
        return real_rename(a, b, *rest, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    result = CliRunner().invoke(main, ["convert-qwen35", "--a8w8", str(src), str(out), "--force", *SMALL_SHARDS,
                                       "--quiet"])
    assert result.exit_code == 0 and "stopped" not in result.output, result.output
    assert "SIGTERM arrived while" in result.output and "the run ends as done" in result.output, result.output
    assert check_artifact(out) == [] and digests(out) != before and leftovers(tmp_path) == []
