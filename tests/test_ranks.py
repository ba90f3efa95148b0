"""run_on_ranks / from_torchrun over real torch.distributed (gloo, 2 spawned processes on CPU): every rank gets its
place and a working group; a rank that raises, dies or waits on a hung peer ends the run with one NpuportError line
naming it, quickly, with no child left running; too many devices fail before anything starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from npuport.errors import NpuportError
from npuport.runtime import ranks
from npuport.runtime.ranks import DEBUG_ENV, RankInfo, RankTraceback, from_torchrun, run_on_ranks

CPU = torch.device("cpu")


def note_pid(info: RankInfo, pid_dir: Path) -> None:
    """<rank>.pid holding this process's id, whole when it appears."""
    part = pid_dir / f"{info.rank}.part"
    part.write_text(str(os.getpid()))
    part.replace(pid_dir / f"{info.rank}.pid")


def running(pid: int) -> bool:
    """Whether pid is a live process (a zombie is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def assert_ranks_gone(pid_dir: Path, world: int = 2) -> None:
    pids = [int((pid_dir / f"{rank}.pid").read_text()) for rank in range(world)]
    assert os.getpid() not in pids  # they ran in children
    assert not [pid for pid in pids if running(pid)]
    assert not mp.active_children()


def assert_quiet(err: str) -> None:
    """Nothing of the failure reached the terminal but the NpuportError: no traceback, no torch notes."""
    assert "Traceback" not in err and "Terminating process" not in err and "gloo" not in err


def place_and_sum(info: RankInfo, pid_dir: Path) -> tuple[list, torch.Tensor]:
    """Every rank's (rank, world, device, is_first), gathered; the rank ids all-reduced, in a tensor far larger
    than a pipe's buffer (rank 0 sends it while the parent watches the ranks)."""
    note_pid(info, pid_dir)
    places = [None] * info.world
    dist.all_gather_object(places, (info.rank, info.world, str(info.device), info.is_first))
    total = torch.full((1 << 20,), float(info.rank))
    dist.all_reduce(total)
    return places, total


def rank_1_fails(info: RankInfo, pid_dir: Path, how: str) -> None:
    """Rank 1 fails as `how` says while rank 0 waits for it in an all_reduce."""
    note_pid(info, pid_dir)
    if info.rank == 1:
        if how == "npuport":
            raise NpuportError("shard 3 is missing\nre-run the conversion")
        if how == "other":
            raise ValueError("bad shape")
        if how == "exit":
            os._exit(3)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)  # "hang": never joins the collective
    dist.all_reduce(torch.ones(1))


def test_every_rank_gets_its_place_a_working_group_and_rank_0s_result_comes_back(tmp_path):
    places, total = run_on_ranks(place_and_sum, (tmp_path,), 2, "cpu")
    assert places == [(0, 2, "cpu", True), (1, 2, "cpu", False)]
    assert torch.equal(total, torch.full((1 << 20,), 0.0 + 1.0))  # a tensor that outlived rank 0's process
    assert not dist.is_initialized()  # the groups were the children's
    assert_ranks_gone(tmp_path)


def test_one_device_runs_fn_here_without_a_group():
    assert run_on_ranks(lambda info, x: (info, x, dist.is_initialized()), (5,), 1, "cpu") == (RankInfo(0, 1, CPU),
                                                                                              5, False)


@pytest.mark.parametrize("how, debug, message", [
    ("npuport", False, "rank 1: shard 3 is missing re-run the conversion"),
    ("other", True, "rank 1 failed: ValueError: bad shape"),
], ids=["NpuportError", "ValueError-debug"])
def test_an_exception_in_a_rank_is_one_line_naming_the_rank(tmp_path, monkeypatch, capfd, how, debug, message):
    monkeypatch.setenv(DEBUG_ENV, "1" if debug else "0")
    with pytest.raises(NpuportError) as caught:
        run_on_ranks(rank_1_fails, (tmp_path, how), 2, "cpu")
    assert str(caught.value) == message
    assert isinstance(caught.value.__cause__, RankTraceback) and "rank_1_fails" in str(caught.value.__cause__)
    err = capfd.readouterr().err
    assert ("rank 1: Traceback" in err and "ValueError: bad shape" in err) if debug else "Traceback" not in err
    assert_ranks_gone(tmp_path)


@pytest.mark.parametrize("how, message", [
    ("exit", "rank 1 exited with code 3; the other ranks were stopped"),
    ("kill", "rank 1 was killed by SIGKILL; the other ranks were stopped"),
], ids=["exit", "SIGKILL"])
def test_a_rank_that_dies_stops_the_run_at_once(tmp_path, capfd, how, message):
    start = time.monotonic()
    with pytest.raises(NpuportError) as caught:
        run_on_ranks(rank_1_fails, (tmp_path, how), 2, "cpu", timeout_s=120)
    assert str(caught.value) == message
    assert time.monotonic() - start < 30  # spawning included; nowhere near the 120 s a collective may wait
    assert_ranks_gone(tmp_path)
    assert_quiet(capfd.readouterr().err)


def test_a_hung_peer_makes_the_waiting_rank_give_up_after_the_timeout(tmp_path, capfd):
    start = time.monotonic()
    with pytest.raises(NpuportError) as caught:
        run_on_ranks(rank_1_fails, (tmp_path, "hang"), 2, "cpu", timeout_s=3)
    assert str(caught.value) == "rank 0: a peer did not answer within 3 s; the other ranks were stopped"
    assert 3 <= time.monotonic() - start < 30
    assert_ranks_gone(tmp_path)
    assert_quiet(capfd.readouterr().err)


def test_more_devices_than_present_or_none_fail_before_anything_starts(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(mp, "start_processes", never)
    with pytest.raises(NpuportError, match=r"^--devices 0: at least one device is needed$"):
        run_on_ranks(place_and_sum, (None,), 0, "cpu")
    monkeypatch.setattr(ranks, "resolve_device_kind", lambda kind: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(NpuportError, match=r"^--devices 4 asks for 4 cuda devices, this machine has 2$"):
        run_on_ranks(place_and_sum, (None,), 4, "cuda")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_from_torchrun_joins_the_group_torchrun_describes(monkeypatch):
    for name in ranks.TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    assert from_torchrun() is None
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port()}
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    info = from_torchrun("cpu", timeout_s=10)
    try:
        assert info == RankInfo(0, 1, CPU)
        assert dist.get_backend() == "gloo" and dist.get_world_size() == 1
        total = torch.tensor([2.0])
        dist.all_reduce(total)
        assert total.item() == 2.0
    finally:
        dist.destroy_process_group()


def sleep_on_every_rank(info: RankInfo, pid_dir: Path) -> None:
    note_pid(info, pid_dir)
    time.sleep(600)


PARENT = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from test_ranks import sleep_on_every_rank
from npuport.runtime.ranks import run_on_ranks
run_on_ranks(sleep_on_every_rank, (Path(sys.argv[2]),), 2, "cpu")
"""


# Ctrl-C: run_on_ranks' cleanup runs; SIGKILL: none does, the ranks go by the parent-death signal torch gives them
# (SIGINT) - also when the parent was started in the background, with SIGINT ignored, which its ranks inherit.
def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("signum, started", [(signal.SIGINT, None), (signal.SIGKILL, None),
                                             (signal.SIGKILL, ignore_sigint)],
                         ids=["SIGINT", "SIGKILL", "SIGKILL-started-in-the-background"])
def test_stopping_the_parent_stops_the_ranks(tmp_path, signum, started):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(Path(__file__).parent), str(tmp_path)],
                              stderr=subprocess.DEVNULL, preexec_fn=started)
    try:
        deadline = time.monotonic() + 120  # the deadlines bound a hang only: a loaded machine may be slow
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert time.monotonic() < deadline and parent.poll() is None, "the ranks did not start"
            time.sleep(0.1)
        parent.send_signal(signum)
        assert parent.wait(timeout=60) != 0
        deadline = time.monotonic() + 60  # after SIGKILL the children go by their parent-death signal
        while True:
            alive = [p for p in tmp_path.glob("*.pid") if running(int(p.read_text()))]
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not alive
    finally:
        parent.kill()
        parent.wait()
        for pid_file in tmp_path.glob("*.pid"):  # a failed test leaves nothing behind either
            if running(pid := int(pid_file.read_text())):
                os.kill(pid, signal.SIGKILL)
