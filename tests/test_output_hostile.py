"""The output folder against hostile timing, with real processes and real signals: two runs writing the same OUT
(the second refuses at once and names the first, which finishes untouched), a signal during the swap into place
(the run is done once OUT is in place, and says so), SIGINT and SIGTERM at many points while package copies (the
usual `stopped by` line every time, never a traceback), and an output folder nobody may write in (one line).

The runs are forks of one warm server process (SERVER below), which imports npuport once for the whole module:
each run is still a process of its own, signalled by this one, but starts in milliseconds instead of seconds."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import npuport.checksums as checksums
from npuport.checksums import copy_with_sha256
from npuport.convert.converter import convert_qwen35
from npuport.release.package import ReleaseError, package_release
from npuport.release.verify import verify_release
from tests.test_output_safety import cli, leftovers, silent, the_error

SERVER = r"""
import json, os, sys, threading, time, traceback
from pathlib import Path

import npuport.checksums as checksums
import npuport.release.package as package
from npuport.cli import main


def wait_for_go(mark):
    mark.write_text("paused")
    go, deadline = Path(f"{mark}.go"), time.monotonic() + 60
    while not go.exists():
        if time.monotonic() > deadline:
            raise RuntimeError("never told to go on")
        time.sleep(0.005)


def install(point, mark):
    if point == "pause-copy":  # before the first file package copies
        real_copy = package.copy_with_sha256
        def copy(src, dst):
            if not mark.exists():
                wait_for_go(mark)
            return real_copy(src, dst)
        package.copy_with_sha256 = copy
    elif point.startswith("pause-rename:"):  # before a partial output is moved onto NAME
        name, real_rename = point.split(":", 1)[1], os.rename
        def rename(a, b, *rest, **kwargs):
            if os.path.basename(os.fspath(b)) == name and os.fspath(a).endswith(".npuport-partial"):
                wait_for_go(mark)
            return real_rename(a, b, *rest, **kwargs)
        os.rename = rename
    elif point == "slow-writer":  # the thread writing a copy takes 20 ms a chunk: the copying thread waits on it
        real_write = checksums.write_fully
        def write(out, data):
            if threading.current_thread().name == "copy-writer":
                time.sleep(0.02)
            real_write(out, data)
        checksums.write_fully = write


for line in sys.stdin:
    run = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(run["cwd"])
            log = os.open(run["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(log, 1)
            os.dup2(log, 2)
            install(run["point"], Path(run["mark"]))
            sys.argv = ["npuport", *run["args"]]
            main(run["args"], prog_name="npuport")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""

TIMEOUT = 60.0  # bounds a hang only


class Server:
    """The warm process that forks each run (SERVER); one run at a time."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(s) for s in self.proc.stdout], daemon=True).start()
        self.runs = 0
        self.outstanding: ForkedRun | None = None

    def reply(self) -> str:
        try:
            return self.lines.get(timeout=TIMEOUT).strip()
        except queue.Empty:
            pytest.fail("the run server did not answer")

    def start(self, cwd: Path, point: str, *args: str | Path) -> ForkedRun:
        """`npuport ARGS` in a fork of the server, in `cwd`, with the pause or slowdown `point` (see SERVER)."""
        self.runs += 1
        run = ForkedRun(self, cwd.parent / f"run{self.runs}.mark", cwd.parent / f"run{self.runs}.log")
        self.proc.stdin.write(json.dumps({"cwd": str(cwd), "point": point, "mark": str(run.mark),
                                          "log": str(run.log), "args": [str(a) for a in args]}) + "\n")
        self.proc.stdin.flush()
        run.pid = int(self.reply())
        self.outstanding = run
        return run

    def end_outstanding(self) -> None:
        """Kill a run that a failed test left paused, so that the next one starts at once."""
        if self.outstanding is not None:
            os.kill(self.outstanding.pid, signal.SIGKILL)
            self.outstanding.result()

    def close(self) -> None:
        self.end_outstanding()
        self.proc.stdin.close()
        self.proc.wait(timeout=TIMEOUT)


class ForkedRun:
    def __init__(self, server: Server, mark: Path, log: Path) -> None:
        self.server, self.mark, self.log, self.pid = server, mark, log, 0

    def wait_for(self, path: Path) -> None:
        """Until `path` exists: the run reached that point."""
        deadline = time.monotonic() + TIMEOUT
        while not path.exists():
            if time.monotonic() > deadline:
                pytest.fail(f"{path.name} never appeared: {self.log.read_text()}")
            time.sleep(0.002)

    def go_on(self) -> None:
        Path(f"{self.mark}.go").write_text("go")

    def result(self) -> tuple[int, str]:
        """The exit status (-N: killed by signal N) and everything the run printed."""
        status = int(self.server.reply())
        self.server.outstanding = None
        return status, self.log.read_text()


@pytest.fixture(scope="module")
def warm_server():
    s = Server()
    yield s
    s.close()


@pytest.fixture
def server(warm_server: Server):
    yield warm_server
    warm_server.end_outstanding()


@pytest.fixture(scope="module")
def artifact(tiny_checkpoints, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("artifact") / "art"
    return convert_qwen35(tiny_checkpoints["dense-multimodal"], out, show_progress=False, log=silent).out


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """Where the runs write their output (their marks and logs go beside it)."""
    (tmp_path / "work").mkdir()
    return tmp_path / "work"


def card_of(release: Path) -> str:
    return (release / "README.md").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------
# Two runs, one OUT


@pytest.mark.parametrize("point", ["pause-copy", "pause-rename:rel"], ids=["while-copying", "between-renames"])
def test_a_second_run_on_the_same_out_refuses_at_once_and_names_the_first(point: str, server: Server, artifact: Path,
                                                                          work: Path) -> None:
    rel = work / "rel"
    package_release(artifact, rel, base_model="org/old", log=silent)  # replaced by the first run, with --force
    first = server.start(work, point, "package", artifact, "--out", rel, "--force", "--base-model", "org/first")
    first.wait_for(first.mark)
    second = cli("package", str(artifact), "--out", str(rel), "--force", "--base-model", "org/second")
    error = the_error(second)
    assert error.startswith(f"error: {rel} is being written by another npuport run (pid {first.pid}: npuport "
                            "package"), error
    first.go_on()
    status, log = first.result()
    assert status == 0 and "Traceback" not in log, log
    assert verify_release(rel) == [] and "org/first" in card_of(rel)
    assert leftovers(work) == []


def test_an_archive_run_is_refused_while_another_writes_a_release_named_like_its_archive(server: Server,
                                                                                         artifact: Path,
                                                                                         work: Path) -> None:
    """`package --out rel --archive` writes rel.tar too: while another run writes a release folder named rel.tar it
    is refused, naming that run and the lock file, and the other run's partial folder is left as it is."""
    first = server.start(work, "pause-copy", "package", artifact, "--out", work / "rel.tar")
    first.wait_for(first.mark)
    partial = work / ".rel.tar.npuport-partial"
    before = sorted(p.name for p in partial.iterdir())
    error = the_error(cli("package", str(artifact), "--out", str(work / "rel"), "--archive"))
    assert error.startswith(f"error: {work / 'rel.tar'} is being written by another npuport run (pid {first.pid}: "
                            "npuport package"), error
    assert error.endswith(f"(its lock file: {work / '.rel.tar.npuport-lock'})"), error
    assert partial.is_dir() and sorted(p.name for p in partial.iterdir()) == before
    first.go_on()
    status, log = first.result()
    assert status == 0 and "Traceback" not in log, log
    assert verify_release(work / "rel.tar") == [] and not (work / "rel").exists() and leftovers(work) == []


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_a_deleted_lock_file_lets_no_second_run_touch_the_first_ones_work(force: bool, server: Server,
                                                                         artifact: Path, work: Path) -> None:
    """Someone deletes the lock file of a run that is writing: a second run takes a fresh lock, but finds the first
    one's partial output held (flock on the folder itself) and refuses, naming it; the first run finishes."""
    rel = work / "rel"
    first = server.start(work, "pause-copy", "package", artifact, "--out", rel)
    first.wait_for(first.mark)
    locks = sorted(work.glob(".rel*.npuport-lock"))  # rel's, and rel.tar's and rel.tar.sha256's (package replaces them)
    assert [p.name for p in locks] == [".rel.npuport-lock", ".rel.tar.npuport-lock", ".rel.tar.sha256.npuport-lock"]
    for lock in locks:
        lock.unlink()
    partial = work / ".rel.npuport-partial"
    error = the_error(cli("package", str(artifact), "--out", str(rel), *(["--force"] if force else [])))
    assert error == (f"error: {partial} is being written by another npuport run, whose lock file someone deleted; "
                     "wait for that run to end, or stop it (nothing was changed)"), error
    assert partial.is_dir()
    first.go_on()
    status, log = first.result()
    assert status == 0 and "Traceback" not in log, log
    assert verify_release(rel) == [] and leftovers(work) == []


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_lock_file_that_is_not_a_regular_file_is_one_line_naming_it(kind: str, artifact: Path,
                                                                      work: Path) -> None:
    lock = work / ".rel.npuport-lock"
    if kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.mkdir()
    what = "a named pipe (FIFO)" if kind == "fifo" else "a folder"
    error = the_error(cli("package", str(artifact), "--out", str(work / "rel")))
    assert error == f"error: {lock} is {what}, which npuport's lock file never is; remove it", error
    assert sorted(p.name for p in work.iterdir()) == [lock.name]


def test_an_output_named_like_npuports_own_files_is_refused(artifact: Path, work: Path) -> None:
    error = the_error(cli("package", str(artifact), "--out", str(work / ".rel.npuport-partial")))
    assert error.startswith(f"error: {work / '.rel.npuport-partial'}: a name ending in .npuport-partial"), error
    assert list(work.iterdir()) == []


def test_a_killed_run_leaves_no_lock_that_blocks_the_next(server: Server, artifact: Path, work: Path) -> None:
    rel = work / "rel"
    run = server.start(work, "pause-copy", "package", artifact, "--out", rel)
    run.wait_for(run.mark)
    os.kill(run.pid, signal.SIGKILL)
    assert run.result()[0] == -signal.SIGKILL
    logs: list[str] = []
    package_release(artifact, rel, log=logs.append)
    assert any(line.startswith("removed .rel.npuport-partial") for line in logs), logs
    assert verify_release(rel) == [] and leftovers(work) == []


def test_a_lock_file_that_is_a_symbolic_link_is_refused_and_its_target_kept(artifact: Path, work: Path) -> None:
    victim = work / "notes.txt"
    victim.write_text("mine", encoding="utf-8")
    (work / ".rel.npuport-lock").symlink_to(victim)
    with pytest.raises(ReleaseError, match=r"\.rel\.npuport-lock is a symbolic link"):
        package_release(artifact, work / "rel", log=silent)
    assert victim.read_text(encoding="utf-8") == "mine" and not (work / "rel").exists()


def test_a_file_system_without_locks_still_gets_its_output(artifact: Path, work: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    logs: list[str] = []
    package_release(artifact, work / "rel", log=logs.append)
    warnings = [line for line in logs if line.startswith("warning:") and "no --report" not in line]
    assert warnings == [f"warning: {work} does not take locks (No locks available); another run writing "
                        f"{work / 'rel'} at the same time would not be refused"], logs
    assert verify_release(work / "rel") == [] and leftovers(work) == []


# ---------------------------------------------------------------------------------------------------------
# A signal during the swap


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_the_swap_ends_the_run_as_done(signum: int, server: Server, artifact: Path,
                                                       work: Path) -> None:
    rel = work / "rel"
    package_release(artifact, rel, archive=True, base_model="org/old", log=silent)
    run = server.start(work, "pause-rename:rel", "package", artifact, "--out", rel, "--archive", "--force",
                       "--base-model", "org/new")
    run.wait_for(run.mark)  # the old release set aside, the new rel.tar in place, the new folder not yet
    os.kill(run.pid, signum)
    run.go_on()
    status, log = run.result()
    name = signal.Signals(signum).name
    assert status == 0 and "stopped" not in log and "Traceback" not in log, log
    assert f"{name} arrived while {rel} was moved into place; the new output is complete" in log, log
    assert f"wrote release {rel}" in log
    assert verify_release(rel) == [] and "org/new" in card_of(rel) and leftovers(work) == []


# ---------------------------------------------------------------------------------------------------------
# Signals at many points while package copies


def test_signals_at_many_points_of_package_stop_it_without_a_traceback(server: Server, artifact: Path,
                                                                       work: Path) -> None:
    """Ten runs, each signalled a little later than the one before (0 to 90 ms after its partial folder
    appeared), while the thread writing each copy is slowed so that copying lasts longer than that: every signal
    lands while the copying thread hashes, hands a chunk over or waits for the writer."""
    rel, partial = work / "rel", work / ".rel.npuport-partial"
    outcomes = []
    for i in range(10):
        signum = (signal.SIGTERM, signal.SIGINT)[i % 2]
        run = server.start(work, "slow-writer", "package", artifact, "--out", rel, "--archive")
        run.wait_for(partial)
        time.sleep(i * 0.01)
        os.kill(run.pid, signum)
        status, log = run.result()
        assert "Traceback" not in log and "Exception" not in log, f"run {i}, signalled after {i * 10} ms:\n{log}"
        if status == 128 + signum:
            assert f"error: stopped by {signal.Signals(signum).name}" in log and leftovers(work) == []
            assert sorted(p.name for p in work.iterdir()) == [], log
        else:  # finished before the signal came (a loaded machine): a complete release
            assert status in (0, -signum) and verify_release(rel) == [], log
            for p in work.iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        outcomes.append(status)
    finished = [s for s in outcomes if s in (0, -signal.SIGINT, -signal.SIGTERM)]
    assert len(finished) < 5, f"most runs must be stopped while copying, the point of this test: {outcomes}"


# ---------------------------------------------------------------------------------------------------------
# An output folder nobody may write in

READ_ONLY_RUNNER = r"""
import json, sys
from click.testing import CliRunner
from npuport.cli import main

for args in json.loads(sys.argv[1]):
    result = CliRunner().invoke(main, args)
    print(json.dumps({"exit_code": result.exit_code, "output": result.output}))
"""


def run_in_read_only(folder: Path, commands: list[list[str]]) -> tuple[list[dict], str]:
    """Each command through the CLI, in one process that sees `folder` read-only - as a read-only mount: mounted
    read-only over itself in the process's own user and mount namespaces (`unshare -rm`). Permissions would not
    do: the tests run as root, whom no mode bit stops; a read-only mount stops root too (EROFS). As another user,
    taking the write permission away is enough. Returns the outcomes and the reason the system gives."""
    script = [sys.executable, "-c", READ_ONLY_RUNNER, json.dumps(commands)]
    if os.geteuid() != 0:
        folder.chmod(0o555)
        argv, reason = script, os.strerror(errno.EACCES)
    else:
        if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"],
                                                             capture_output=True).returncode != 0:
            pytest.skip("running as root, and no user namespace for a read-only mount")
        mount = f'mount --bind "{folder}" "{folder}" && mount -o remount,bind,ro "{folder}" && exec "$@"'
        argv, reason = ["unshare", "-rm", "sh", "-c", mount, "sh", *script], os.strerror(errno.EROFS)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT * 2)
    finally:
        folder.chmod(0o755)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()], reason


class Result:
    def __init__(self, outcome: dict) -> None:
        self.exit_code, self.output = outcome["exit_code"], outcome["output"]


def test_a_read_only_output_folder_is_one_line_naming_it(artifact: Path, tiny_checkpoints, tmp_path: Path) -> None:
    folder = tmp_path / "read-only"
    folder.mkdir()
    src = tiny_checkpoints["dense-multimodal"]
    (package, convert, deeper, tiny), reason = run_in_read_only(folder, [
        ["package", str(artifact), "--out", str(folder / "rel")],
        ["convert-qwen35", "--a8w8", str(src), str(folder / "out"), "--quiet"],
        ["package", str(artifact), "--out", str(folder / "releases" / "rel")],  # a folder to create in it first
        ["make-tiny", str(folder / "tiny"), "--quiet"],
    ])
    assert the_error(Result(package)) == f"error: cannot write in {folder}: {reason}; {folder / 'rel'} was not written"
    assert the_error(Result(convert)) == f"error: cannot write in {folder}: {reason}; {folder / 'out'} was not written"
    assert the_error(Result(deeper)) == (f"error: cannot write in {folder}: {reason}; {folder / 'releases' / 'rel'} "
                                         "was not written")
    assert the_error(Result(tiny)).startswith("error: ") and str(folder) in the_error(Result(tiny))
    assert list(folder.iterdir()) == []


def test_ctrl_c_while_a_copy_waits_for_its_writer_is_a_keyboard_interrupt(artifact: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The root of the BufferError above: Ctrl-C raised while the copying thread waits for the writing one, which
    still holds a view of the source's memory map. Here the writer sends it as it starts, then takes its time."""
    real_write = checksums.write_fully

    def write_after_ctrl_c(out, data) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        real_write(out, data)

    monkeypatch.setattr(checksums, "write_fully", write_after_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        copy_with_sha256(artifact / "quant_model_weights-00001-of-00001.safetensors", tmp_path / "copy")
