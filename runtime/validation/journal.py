"""A validation run's record in its output folder, kept as the run goes, so that a run stopped in any way (Ctrl-C,
SIGTERM, SIGKILL, a crash, a lost server) loses nothing it finished and can be continued (`validate --resume`).

Unlike convert and package (npuport/output_folder.py: built hidden, moved into place whole), a validation folder
is written in place, and while it is unfinished it says so:

- `PARTIAL`: present from the start of a run until its report is written; a folder holding it has no report.md
  (or a report.md of nothing: it is removed when a fresh run starts);
- `state.json`: what the run was told (the options that decide its results, the models' checksums) and the phase
  it is in, or "complete";
- one JSON line per result as it is made, flushed at once and synced to disk every FSYNC_INTERVAL_S: each model's
  answers (answers*.jsonl), each fidelity sequence's sums (fidelity.jsonl), each timed throughput run
  (throughput.jsonl).

A run into a folder with an unfinished run of the same options continues it; with other options it is refused,
naming the first option that differs. One run at a time: `.npuport-lock` in the folder is flock(2)ed while a run
writes there."""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from npuport.errors import NpuportError

STATE_NAME = "state.json"
PARTIAL_NAME = "PARTIAL"
LOCK_NAME = ".npuport-lock"
STATE_TOOL = "npuport validate"
STATE_VERSION = 1
FSYNC_INTERVAL_S = 5.0  # an appended line is flushed at once (a killed process loses nothing), synced this often
PARTIAL_TEXT = ("This validation is unfinished: it is running, or it was stopped before its report was written.\n"
                "state.json says what it was told and where it is. Run the same `npuport validate` command with "
                "--resume\n(or again with the same options and --out) to continue it: what is done is kept.\n")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of `path` (none if it is missing). A last line cut short by a kill (no newline, or not JSON)
    is dropped, and cut from the file too, so that lines appended later start on a line of their own."""
    if not path.exists():
        return []
    data = path.read_bytes()
    rows: list[dict[str, Any]] = []
    good = 0  # bytes of complete lines
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            row = json.loads(line)
        except ValueError:
            break
        if not isinstance(row, dict):
            break
        rows.append(row)
        good += len(line)
    if good < len(data):
        with open(path, "r+b") as f:
            f.truncate(good)
    return rows


class Appender:
    """Appends JSON lines to a file: each flushed as written (a kill loses none), the file synced to disk at most
    every FSYNC_INTERVAL_S and when closed (a power loss loses seconds at most)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "a", encoding="utf-8")
        self.synced = time.monotonic()

    def __enter__(self) -> Appender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write(self, row: Mapping[str, Any]) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if time.monotonic() - self.synced >= FSYNC_INTERVAL_S:
            os.fsync(self.file.fileno())
            self.synced = time.monotonic()

    def close(self) -> None:
        if not self.file.closed:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


class Journal:
    """The record of one validation run in `out` (see the module's docstring). `start` takes the folder's lock and
    begins or continues a run; `rows` and `appender` read and extend its files; `phase` says where it is;
    `finish` marks it complete once its report is written; `close` lets go of the lock."""

    def __init__(self, out: Path, log: Callable[[str], None] = print) -> None:
        self.out = Path(out)
        self.log = log
        self.state: dict[str, Any] = {}
        self.resumed = False
        self._lock_fd: int | None = None

    # -- beginning ------------------------------------------------------------------------------------------

    def start(self, options: Mapping[str, Any], resume: bool, owned: Iterable[str]) -> bool:
        """Begin a run told `options` ({option as the command line names it: value}), or continue the one the folder
        holds: an unfinished one with the same options always, a complete one with --resume (only its report is
        then written again). Refused, in one line: --resume where there is nothing to continue, and another run's
        unfinished folder with an option that differs. A fresh run first removes the files named in `owned` (an
        earlier run's results and report). True when it continues a run."""
        if self.out.exists() and not self.out.is_dir():
            raise NpuportError(f"{self.out} is not a folder; give --out a folder for the report")
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise NpuportError(f"cannot create {self.out}: {e.strerror or e}") from None
        self._lock()
        try:
            state = self._read_state()
            options = json.loads(json.dumps(dict(options)))  # as state.json will hold them
            if state is None and resume:
                raise NpuportError(f"{self.out} holds no validation to resume (no {STATE_NAME}); run without "
                                   "--resume to start one")
            self.resumed = state is not None and (state.get("status") != "complete" or resume)
            if self.resumed:
                assert state is not None
                self._same_options(state.get("options", {}), options)
                self.state = state
                self.state["resumed"] = int(self.state.get("resumed", 0)) + 1
                if state.get("status") == "complete":
                    self.log(f"{self.out} holds a finished validation: its report is written again from its results")
                else:
                    self.log(f"resuming the validation in {self.out} (stopped in phase {state.get('phase')}); what "
                             "it finished is kept")
            else:
                for name in owned:
                    (self.out / name).unlink(missing_ok=True)
                self.state = {"tool": STATE_TOOL, "version": STATE_VERSION, "options": options, "resumed": 0}
            self.state.update(status="partial", phase=self.state.get("phase") if self.resumed else "start")
            (self.out / PARTIAL_NAME).write_text(PARTIAL_TEXT, encoding="utf-8")
            self._write_state()
        except BaseException:
            self.close()
            raise
        return self.resumed

    def _lock(self) -> None:
        path = self.out / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise NpuportError(f"{path}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise NpuportError(f"{self.out} is being written by another npuport validate run; wait for it to end, "
                               "or stop it (it can be resumed)") from None
        except OSError:
            pass  # a file system without locks: go on unlocked
        self._lock_fd = fd

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _read_state(self) -> dict[str, Any] | None:
        path = self.out / STATE_NAME
        if not path.exists():
            return None
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            state = None
        if not isinstance(state, dict) or state.get("tool") != STATE_TOOL:
            raise NpuportError(f"{path} is not the state of a validation npuport wrote; give another --out")
        if state.get("version") != STATE_VERSION:
            raise NpuportError(f"{path} is from another version of npuport validate; give another --out")
        return state

    def _same_options(self, before: Mapping[str, Any], now: Mapping[str, Any]) -> None:
        for option in dict.fromkeys([*now, *before]):
            if before.get(option) != now.get(option):
                raise NpuportError(
                    f"{self.out} holds a validation run with {option} {_shown(before.get(option))}, and this run "
                    f"has {option} {_shown(now.get(option))}: resume it with the same options, or give another "
                    "--out (or remove the folder) to start over")

    # -- going on -------------------------------------------------------------------------------------------

    def phase(self, name: str) -> None:
        """Record that the run is now in phase `name`."""
        self.state["phase"] = name
        self._write_state()

    def rows(self, name: str) -> list[dict[str, Any]]:
        return read_rows(self.out / name)

    def appender(self, name: str) -> Appender:
        return Appender(self.out / name)

    def finish(self) -> None:
        """The report is written: the run is complete."""
        self.state.update(status="complete", phase="complete")
        self._write_state()
        (self.out / PARTIAL_NAME).unlink(missing_ok=True)

    def _write_state(self) -> None:
        """Written whole or not at all: a new file, synced, renamed over the old one."""
        self.state["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        path, tmp = self.out / STATE_NAME, self.out / f".{STATE_NAME}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(self.state, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
