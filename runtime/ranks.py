"""One process per device for the runtime's several-device mode: spawn and supervise the ranks (or join torchrun's),
each with torch.distributed's default process group; a rank's failure becomes one NpuportError line naming it.

A failed rank's traceback is not printed: it is the NpuportError's `__cause__` (a RankTraceback), and with
NPUPORT_DEBUG=1 in the environment it is also written to stderr.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import signal
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from npuport.devices import DeviceGraph, device_count, distributed_backend, make_current, with_index
from npuport.devices import device_kind as resolve_device_kind
from npuport.errors import NpuportError

# A dead rank is noticed at once (by run_on_ranks, or by torchrun), so this only bounds a hang. It has to cover the
# longest wait a healthy peer causes: loading its share of a large checkpoint and compiling kernels before the first
# collective, minutes on a slow disk. Ten minutes, as torch's own NCCL default.
DEFAULT_TIMEOUT_S = 600.0
DEBUG_ENV = "NPUPORT_DEBUG"  # "1": also write a failed rank's traceback to stderr
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
POLL_S = 0.1  # how often the parent looks at its children
GRACE_S = 1.0  # after a rank fails, how long the others may take to fail on their own (and report) before SIGTERM

# How likely a rank's failure is the root cause, most likely first: something fn raised, a rank that died without
# a word, then a collective that lost its peer or timed out - usually the consequence of another rank's failure.
_RAISED, _DIED, _PEER, _UNKNOWN = 0, 1, 2, 3
_BACKEND_TEXT = re.compile(r"gloo|nccl|hccl|c10d", re.IGNORECASE)
_TIMEOUT_TEXT = re.compile(r"timed? ?out", re.IGNORECASE)
_SPAWN_LOG = logging.getLogger("torch.multiprocessing.spawn")  # where ProcessContext.join logs
_SOURCE_PREFIX = re.compile(r"^\[[^]]*\] ")  # gloo's messages start with [its source file:line]


@dataclass(frozen=True)
class RankInfo:
    """Where this process stands among the ranks, and the device it drives."""

    rank: int
    world: int
    device: torch.device  # the accelerator of index <local rank>, or the host

    @property
    def is_first(self) -> bool:
        """Rank 0: the only rank that reads prompts and writes reports."""
        return self.rank == 0


class RankTraceback(Exception):
    """The traceback text of a failed rank, kept as the cause of the NpuportError that reports it."""


def run_on_ranks(fn, args: tuple, devices: int, device_kind: str | None, timeout_s: float = DEFAULT_TIMEOUT_S):
    """Run fn(info: RankInfo, *args) in `devices` spawned processes, one per device, each with the default process
    group initialised (backend from distributed_backend, a TCP store on a free port of 127.0.0.1 held by this
    process, `timeout_s` for every collective) and destroyed after. fn must be importable (module level). Returns
    rank 0's return value, which must be picklable. With devices == 1, calls fn in this process, without a group.

    If a rank fails, the others are stopped (SIGTERM after GRACE_S) and NpuportError says which rank and why."""
    kind = _checked_kind(devices, device_kind)
    if devices == 1:
        return fn(RankInfo(0, 1, with_index(torch.device(kind))), *args)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    readers, writers = zip(*(mp.get_context("spawn").Pipe(duplex=False) for _ in range(devices)), strict=True)
    context = mp.start_processes(_rank_main, (fn, args, devices, kind, store.port, timeout_s, writers),
                                 nprocs=devices, join=False, start_method="spawn")
    for writer in writers:  # the children hold the only write ends: a dead child's pipe reads as closed
        writer.close()
    outcomes: dict[int, tuple | None] = {}
    first_failed = None
    _SPAWN_LOG.addFilter(_no_stop_notes)
    try:
        try:
            while not context.join(timeout=POLL_S, grace_period=GRACE_S):
                _collect(readers, outcomes)  # rank 0 may block sending a large result until it is read
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
            first_failed = e.error_index
        _collect(readers, outcomes)
        succeeded = [rank for rank, outcome in outcomes.items() if outcome is not None and outcome[0] == "ok"]
        if first_failed is None and len(succeeded) == devices:
            return outcomes[0][1]
        _, rank, message, trace = min(_failures(context.processes, outcomes, first_failed))
        if trace and os.environ.get(DEBUG_ENV) == "1":
            sys.stderr.write(f"rank {rank}: {trace}")
        raise NpuportError(message) from (RankTraceback(trace) if trace else None)
    finally:
        _stop(context.processes)
        _SPAWN_LOG.removeFilter(_no_stop_notes)
        for reader in readers:
            reader.close()


def from_torchrun(device_kind: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> RankInfo | None:
    """When torchrun started this process (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set): initialise
    the default group from the environment (env://, backend from distributed_backend, `timeout_s`) and return this
    rank's RankInfo; the caller ends with leave_group() (or dist.destroy_process_group() on failure). Else None."""
    if not all(name in os.environ for name in TORCHRUN_ENV):
        return None
    info = RankInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                    _rank_device(resolve_device_kind(device_kind), int(os.environ["LOCAL_RANK"])))
    dist.init_process_group(distributed_backend(info.device), init_method="env://", rank=info.rank,
                            world_size=info.world, timeout=timedelta(seconds=timeout_s))
    return info


def leave_group() -> None:
    """The end of a rank that succeeded: free its captured graphs (those holding collectives would block the
    teardown), wait for the others, then destroy the default group - no rank tears its connections down while a
    peer still reads from them."""
    DeviceGraph.release_all()
    dist.barrier()
    dist.destroy_process_group()


def _checked_kind(devices: int, device_kind: str | None) -> str:
    """The device kind to run on, after checking this machine has `devices` of them."""
    if devices < 1:
        raise NpuportError(f"--devices {devices}: at least one device is needed")
    kind = resolve_device_kind(device_kind)
    present = device_count(kind)
    if present is not None and devices > present:
        raise NpuportError(f"--devices {devices} asks for {devices} {kind} devices, this machine has {present}")
    return kind


def _rank_device(kind: str, local_rank: int) -> torch.device:
    """This rank's device, made current: collectives and kernels must not all land on device 0."""
    return make_current(kind, local_rank)


def _rank_main(rank: int, fn, args: tuple, world: int, kind: str, store_port: int, timeout_s: float,
               writers: tuple[Connection, ...]) -> None:
    """One spawned rank: join the group, run fn, send ("ok", rank 0's result) or ("error", priority, one-line
    message, traceback) to the parent. On failure it exits without tearing the group down: after a failed
    collective that can block (NCCL), and exiting frees it."""
    # torch's spawn makes the parent's death deliver SIGINT here; a rank of a command started in the background
    # (SIGINT ignored, as shells without job control start it) would ignore that too and outlive its parent.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for other, writer in enumerate(writers):
        if other != rank:
            writer.close()
    writer = writers[rank]
    try:
        resolve_device_kind(kind)  # in a fresh process: registers the accelerator's torch module (devices.py)
        info = RankInfo(rank, world, _rank_device(kind, rank))
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
        dist.init_process_group(distributed_backend(info.device), store=store, rank=rank, world_size=world,
                                timeout=timeout)
        result = fn(info, *args)
        leave_group()
        report = ("ok", result if info.is_first else None)
    except Exception as e:  # noqa: BLE001 - every failure goes to the parent, which reports it as one line
        report = ("error", *_describe(e, rank, timeout_s), traceback.format_exc())
    try:  # plain pickle: a tensor goes by value, not as shared memory that dies with this process
        payload = pickle.dumps(report)
    except Exception as e:  # noqa: BLE001 - a result pickle cannot take
        report = ("error", _RAISED, f"rank {rank} failed: its result cannot be sent: {e}", traceback.format_exc())
        payload = pickle.dumps(report)
    writer.send_bytes(payload)
    if report[0] != "ok":
        sys.exit(1)


def _describe(e: Exception, rank: int, timeout_s: float) -> tuple[int, str]:
    """(priority, one-line message) for what rank raised."""
    text = " ".join(str(e).split())
    if isinstance(e, NpuportError):
        return _RAISED, f"rank {rank}: {text}"
    if not (isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and _BACKEND_TEXT.search(text))):
        return _RAISED, f"rank {rank} failed: {type(e).__name__}" + (f": {text}" if text else "")
    if _TIMEOUT_TEXT.search(text):
        return _PEER, f"rank {rank}: a peer did not answer within {timeout_s:g} s; the other ranks were stopped"
    return _PEER, f"rank {rank} lost its connection to a peer: {_SOURCE_PREFIX.sub('', text)}"


def _collect(readers: tuple[Connection, ...], outcomes: dict[int, tuple | None]) -> None:
    """Read every report that has arrived; None for a rank whose pipe closed without one."""
    for rank, reader in enumerate(readers):
        if rank not in outcomes and reader.poll():
            try:
                report = reader.recv_bytes()
            except (EOFError, OSError):  # it died before (or while) sending
                outcomes[rank] = None
            else:
                outcomes[rank] = pickle.loads(report)


def _failures(processes, outcomes: dict[int, tuple | None], first_failed: int | None):
    """(priority, rank, message, traceback) of every rank that failed by itself: the SIGTERM / SIGKILL of the
    ranks stopped after another's failure do not count, the first rank seen failing always does."""
    stopped = (-signal.SIGTERM, -signal.SIGKILL)
    for rank, process in enumerate(processes):
        outcome = outcomes.get(rank)
        if outcome is not None and outcome[0] == "error":
            _, priority, message, trace = outcome
            yield priority, rank, message, trace
        elif rank == first_failed or (outcome is None and process.exitcode not in stopped):
            yield _DIED, rank, _exit_message(rank, process.exitcode), ""
    yield _UNKNOWN, 0, "the ranks stopped without saying why", ""


def _exit_message(rank: int, code: int | None) -> str:
    if code is not None and code < 0:
        return f"rank {rank} was killed by {signal.Signals(-code).name}; the other ranks were stopped"
    if code == 0:  # a SIGINT that torch's spawn wrapper swallowed
        return f"rank {rank} stopped before it finished (interrupted); the other ranks were stopped"
    return f"rank {rank} exited with code {code}; the other ranks were stopped"


def _no_stop_notes(record: logging.LogRecord) -> bool:
    """Drops torch's warning that it terminates a rank: the NpuportError says the other ranks were stopped."""
    return not record.getMessage().startswith("Terminating process")


def _stop(processes) -> None:
    """Terminate (then kill) every child still running, and reap them all."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(GRACE_S)
        if process.is_alive():
            process.kill()
            process.join()
