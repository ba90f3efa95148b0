"""Where convert and package put their output: built in a hidden `.OUT.npuport-partial` beside OUT and swapped
into place when complete, so that OUT is always absent, the previous one or the new one - after an error, a
signal or a kill (the next run puts right what a kill left). One run at a time writes any path: a run locks every
output it writes (OUT, and with --archive OUT.tar and OUT.tar.sha256; each one's partial and set-aside names derive
from it), so a second run writing any of them is refused while the first runs. And the rule for --force: only an
output npuport wrote, or an empty folder, is ever replaced. Imports only the shared helpers.

Locks. Each output F has its lock file `.F.npuport-lock`, flock(2)ed by the run writing F (the kernel releases it
when the process ends, however it ends). A lock file is only a name, which anyone may delete: a second run then
takes a fresh lock on a new file. So a run also holds a flock on everything it has created beside OUT while it
writes - each partial output (a folder or a file) and the swap journal - and a run never removes or rolls back
what another process holds that way: it refuses instead, naming the file. A third party's `rm` of a lock file
therefore lets no second run touch the first one's work."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import shutil
import signal
import stat
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path

from npuport.checksums import SUMS_NAME, parse_sums
from npuport.errors import NpuportError
from npuport.jsonfile import parse_json, read_json_object

GB = 1024**3
MANIFEST_NAME = "npuport_manifest.json"
MANIFEST_TOOL = "npuport"  # the manifest's "tool": what marks a folder as one npuport wrote
PARTIAL = ".npuport-partial"  # being written
OLD = ".npuport-old"  # the output being replaced, set aside until the new one is in place
SWAPPING = ".npuport-swapping"  # the names a swap is moving into place; present until the last rename is done
SWAPPED = ".npuport-swapped"  # every rename done; only what was set aside remains to be deleted
LOCK = ".npuport-lock"  # flock(2)ed by the run writing OUT; records its pid and command
MAX_LOCK_BYTES = 64 * 1024  # what is read of a lock file to name its holder
HELD_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)
MAX_SUMS_BYTES = 1 << 20  # a SHA256SUMS larger than this is not one npuport wrote (and is not read whole)
FREE_MARGIN = 0.98  # leave 2% of the free space: file systems reserve some, and the small files are not counted
HIDDEN_SUFFIXES = (PARTIAL, OLD, SWAPPING, SWAPPED, LOCK)  # an output named so would be taken for npuport's own


def hidden(path: Path, suffix: str) -> Path:
    """`.NAME<suffix>` beside `path`: where npuport writes, or sets aside, what becomes or was `path`."""
    return path.parent / f".{path.name}{suffix}"


def archive_paths(out: Path) -> tuple[Path, Path]:
    """`<OUT>.tar` and its `<OUT>.tar.sha256`, beside OUT (npuport package --archive)."""
    tar = out.parent / f"{out.name}.tar"
    return tar, tar.parent / f"{tar.name}.sha256"


@contextmanager
def signals_held(arrived: list[int] | None = None) -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP while renames or a cleanup run that must not be cut in half; a signal that
    arrives meanwhile is delivered, to the handler in place before, once they are done - or, given `arrived`,
    only recorded there, for the caller to say what it did. Python runs signal handlers in the main thread only,
    so elsewhere this holds nothing (and needs not)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = [] if arrived is None else arrived
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in HELD_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        if caught and arrived is None:
            signal.raise_signal(caught[0])


def why_not_replaceable(folder: Path) -> str | None:
    """None when --force may replace `folder`: an empty folder, an artifact npuport wrote (its npuport_manifest.json
    says so; an artifact holds regular files only), or a release npuport packaged (its SHA256SUMS lists every file
    in it, npuport's manifest among them). Otherwise why not, in a few words."""
    if folder.is_symlink():
        return "it is a symbolic link"
    if not folder.is_dir():
        return "it is not a folder"
    if not any(folder.iterdir()):
        return None
    if os.path.lexists(folder / SUMS_NAME):
        return _why_not_release(folder)
    return _why_not_artifact(folder)


def _why_not_npuport_manifest(folder: Path) -> str | None:
    path = folder / MANIFEST_NAME
    if path.is_symlink() or not path.is_file():
        return f"it holds no {MANIFEST_NAME}"
    try:
        manifest = read_json_object(path)
    except NpuportError:
        return f"its {MANIFEST_NAME} is not a JSON object"
    if manifest.get("tool") != MANIFEST_TOOL:
        return f"its {MANIFEST_NAME} was not written by npuport"
    return None


def _why_not_artifact(folder: Path) -> str | None:
    why = _why_not_npuport_manifest(folder)
    if why:
        return why
    for p in sorted(folder.iterdir()):
        if p.is_symlink() or not p.is_file():
            return f"it holds {p.name}, and an artifact holds regular files only"
    return None


def _read_sums(path: Path) -> dict[str, str] | None:
    """The digests of a SHA256SUMS npuport could have written, or None."""
    if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_SUMS_BYTES:
        return None
    digests, problems = parse_sums(path.read_text(encoding="utf-8", errors="replace"))
    return None if problems else digests


def _why_not_release(folder: Path) -> str | None:
    digests = _read_sums(folder / SUMS_NAME)
    if digests is None:
        return f"its {SUMS_NAME} is not one npuport wrote"
    why = _why_not_npuport_manifest(folder)
    if why or MANIFEST_NAME not in digests:
        return why or f"its {SUMS_NAME} does not list {MANIFEST_NAME}"
    for root, dirs, files in os.walk(folder):
        for name in sorted(dirs + files):
            path = Path(root, name)
            relative = path.relative_to(folder).as_posix()
            if path.is_symlink():
                return f"it holds {relative}, a symbolic link"
            if name in files and relative != SUMS_NAME and relative not in digests:
                return f"it holds {relative}, which its {SUMS_NAME} does not list (added after packaging)"
    return None


def why_not_archive(tar: Path, sums: Path) -> str | None:
    """None when `tar` and `sums` (either may be missing) are an archive and checksum file npuport package wrote:
    `sums` lists `tar` alone. Otherwise why not."""
    for p in (tar, sums):
        if p.is_symlink() or (p.exists() and not p.is_file()):
            return f"{p.name} is not a regular file"
    if not sums.exists():
        return f"{tar.name} has no {sums.name} beside it"
    digests = _read_sums(sums)
    if digests is None or list(digests) != [tar.name]:
        return f"{sums.name} does not list {tar.name} alone"
    return None


def _relation(out: Path, other: Path) -> str | None:
    """How `out` and `other` overlap once resolved (symlinks followed): "is", "is inside", "contains", or None."""
    a, b = out.resolve(), other.resolve()
    if a == b:
        return "is"
    if a.is_relative_to(b):
        return "is inside"
    if b.is_relative_to(a):
        return "contains"
    return None


def size_of(path: Path) -> int:
    """Bytes of a file, or of every file under a folder (symlinks not followed)."""
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size if os.path.lexists(path) else 0
    return sum(os.lstat(os.path.join(root, f)).st_size for root, _, files in os.walk(path) for f in files)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _this_command() -> str:
    """This process's command line, as a lock file records it for a run it refuses."""
    return shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else "python"


def _kind(mode: int) -> str:
    """What a file that is not a regular one is, in a few words."""
    for test, words in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                        (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                        (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return words
    return "not a regular file"


def held_elsewhere(path: Path) -> bool:
    """Whether another open file holds a flock on `path` (a regular file or a folder, never followed through a
    symbolic link): a run writing it is alive. False for anything else, or where flock is not available."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # releases the flock taken, if any
    return False


def _holder(fd: int) -> str:
    """` (pid N: COMMAND)` from the lock file `fd`, or "" where it records neither (being written, or not
    npuport's)."""
    try:
        holder = parse_json(os.pread(fd, MAX_LOCK_BYTES, 0).decode("utf-8", errors="replace"))
        pid, command = holder["pid"], holder["command"]
    except (OSError, ValueError, TypeError, KeyError):
        return ""
    return f" (pid {pid}: {' '.join(str(command).split())})"


class OutputFolder:
    """The output folder OUT of a command, written through `.OUT.npuport-partial` beside it. With `archive`, OUT.tar
    and OUT.tar.sha256 belong to it: placed just before OUT, replaced and removed with it.

    Use: `prepare` (put right what a killed run left, refuse what may not be replaced), then `with building(...)
    as tmp:` write into tmp and call `commit` last. Errors are `error`, one line naming OUT or the file.

    While it changes anything beside OUT - puts leftovers right, writes, swaps - a run holds the lock of every
    output it writes, `.F.npuport-lock` for each F of OUT, OUT.tar and OUT.tar.sha256 (flock: the kernel releases
    it when the process ends, however it ends), and a second run writing any of them is refused at once, naming the
    first and the lock file. `prepare` holds them only while it puts right and looks; `building` takes them again,
    looks again (the first look may be out of date) and holds them to the end. So a run that fails between the two
    never keeps OUT locked, whatever it does with the error. While it writes, a run also holds a flock on each
    partial output and on its swap journal (`anchor`): what it puts right is never what a live run holds, even
    when someone has deleted that run's lock file (the module's docstring says why)."""

    def __init__(self, out: Path, error: type[NpuportError] = NpuportError, log: Callable[[str], None] = print, *,
                 archive: bool = False) -> None:
        self.out = Path(out)
        if self.out.name in ("", ".", ".."):  # "." or "..": the hidden names beside OUT need OUT's own name
            self.out = Path(os.path.abspath(self.out))
        self.error, self.log = error, log
        self.finals = [*archive_paths(self.out), self.out] if archive else [self.out]  # OUT last: moved in last
        for final in self.finals:
            if final.name.endswith(HIDDEN_SUFFIXES):
                raise error(f"{final}: a name ending in {next(x for x in HIDDEN_SUFFIXES if final.name.endswith(x))} "
                            "is npuport's own name for its work in progress; choose another name")
        self.replacing: list[Path] = []
        self.force = False
        self.unlocked = False  # OUT's folder does not take locks (warned once)
        self._anchors: list[int] = []  # fds holding a flock on what this run is writing beside OUT

    def partial(self, final: Path | None = None) -> Path:
        """Where `final` (OUT by default) is written until it is moved into place."""
        return hidden(self.out if final is None else final, PARTIAL)

    def create_partial(self, final: Path) -> Path:
        """Create the partial file of `final` (OUT.tar...), empty, held by this run (`anchor`) until `building`
        ends; returns its path, for the caller to write (without truncating or recreating it)."""
        path = self.partial(final)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
        self.anchor(path)
        return path

    def anchor(self, path: Path) -> None:
        """Hold a flock on `path`, a file or folder this run created beside OUT, until `building` ends: a run that
        finds it held leaves it alone (held_elsewhere). Where flock is not available, nothing is held."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return
        self._anchors.append(fd)

    def _release_anchors(self) -> None:
        while self._anchors:
            os.close(self._anchors.pop())

    def prepare(self, inputs: Mapping[str, Path | None], force: bool) -> None:
        """Refuse an OUT that is, contains or lies inside one of `inputs` ({what: path}); then, holding OUT's lock,
        put right what an interrupted run left beside OUT and refuse an OUT that exists and is not npuport's to
        replace, or exists without `force`."""
        for what, path in inputs.items():
            relation = None if path is None else _relation(self.out, Path(path))
            if relation:
                raise self.error(f"{self.out} {relation} the {what} {path}; write the output to a separate folder")
        if _relation(self.out, Path.cwd()) in ("is", "contains"):  # the swap would pull the folder from under us
            raise self.error(f"{self.out} is or contains the current folder; run the command from outside it")
        self.force = force
        if self.out.parent.is_dir():  # else nothing is there yet: building creates the folder
            with self._locked():
                self.recover()
                self._look()

    def _look(self) -> None:
        """Set `replacing` to the outputs that exist and that this run replaces; refuse what it may not."""
        existing = [f for f in self.finals if os.path.lexists(f)]
        for final in existing:
            why = self._why_not_ours(final)
            if why:
                raise self.error(f"{final} already exists, and --force would not replace it: {why} (npuport "
                                 "replaces only an output it wrote, or an empty folder)")
        if existing and not self.force:
            raise self.error(f"{existing[0]} already exists; pass --force to replace it")
        if existing and existing != self.replacing:
            self.log(f"replacing {', '.join(str(f) for f in existing)} once the new output is complete")
        self.replacing = existing

    def _why_not_ours(self, final: Path) -> str | None:
        if final == self.out:
            return why_not_replaceable(final)
        return why_not_archive(*archive_paths(self.out))

    @contextmanager
    def building(self, needed: int, what: str) -> Iterator[Path]:
        """The new, empty partial folder to write the output into, once the disk has room for `needed` bytes
        (`what`: "artifact", "release", for messages). Whatever stops the writing - an error, Ctrl-C, SIGTERM -
        everything partial is removed and the previous output kept; an OSError (a full disk...) becomes one line
        naming the file. Call after `prepare`. Holds OUT's lock until it ends, and first does again under it what
        `prepare` did: put leftovers right (so that stale partials are not counted) and look at what exists."""
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self.error(self._cannot_write(e)) from None
        with self._locked():
            self.recover()
            self._look()
            self._check_space(needed, what)
            tmp = self.partial()
            try:
                tmp.mkdir()
            except OSError as e:
                raise self.error(self._cannot_write(e)) from None
            self.anchor(tmp)
            try:
                yield tmp
            except OSError as e:
                self.discard()
                raise self.error(self._write_failure(e)) from None
            except BaseException:
                self.discard()
                raise
            finally:
                self._release_anchors()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the lock of every output this run writes (taken in one order, so that two runs never hold one
        each), or refuse at once, naming the run that holds one and its lock file."""
        with ExitStack() as held:
            for path, final in sorted((hidden(f, LOCK), f) for f in self.finals):
                held.enter_context(self._lock(path, final))
            yield

    def _open_lock(self, path: Path) -> int:
        """The lock file at `path`, opened (created if missing): a regular file, never followed through a symbolic
        link (truncating what it points to would destroy that file); anything else is refused, naming it."""
        not_ours = "which npuport's lock file never is; remove it"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise self.error(f"{path} is a symbolic link, {not_ours}") from None
            if e.errno in (errno.EISDIR, errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP):
                mode = os.lstat(path).st_mode if os.path.lexists(path) else 0
                raise self.error(f"{path} is {_kind(mode)}, {not_ours}") from None
            raise self.error(self._cannot_write(e)) from None
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise self.error(f"{path} is {_kind(mode)}, {not_ours}")
        return fd

    @contextmanager
    def _lock(self, path: Path, final: Path) -> Iterator[None]:
        """Hold the lock file `path` of the output `final`, or refuse at once, naming the run that holds it."""
        with signals_held():  # taken and released whole: a lock left open would block every later run
            while True:
                fd = self._open_lock(path)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = _holder(fd)
                    os.close(fd)
                    raise self.error(f"{final} is being written by another npuport run{holder}; wait for it to "
                                     f"end, or stop it (its lock file: {path})") from None
                except OSError as e:  # a file system without flock (some network and FUSE ones): go on unlocked
                    if not self.unlocked:
                        self.log(f"warning: {path.parent} does not take locks ({e.strerror or e}); another run "
                                 f"writing {self.out} at the same time would not be refused")
                    self.unlocked = True
                    break
                try:
                    same = os.path.samestat(os.stat(path), os.fstat(fd))
                except FileNotFoundError:
                    same = False
                if same:
                    break
                os.close(fd)  # the file its last holder removed when it was done: lock the one now at `path`
            try:
                os.ftruncate(fd, 0)
                os.write(fd, json.dumps({"pid": os.getpid(), "command": _this_command()}).encode("utf-8"))
            except OSError as e:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise self.error(f"{path}: cannot write npuport's lock file: {e.strerror or e}; {final} "
                                 + ("is unchanged" if os.path.lexists(final) else "was not written")) from None
        try:
            yield
        finally:
            with signals_held():
                path.unlink(missing_ok=True)  # while held: a run that opened it meanwhile sees it gone, retries
                os.close(fd)

    def commit(self) -> None:
        """Move the finished output into place: set aside what it replaces, move each partial in (OUT last), then
        delete what was set aside. Until the last rename a kill is rolled back by the next run (the previous output
        comes back), after it the swap is finished. Signals wait until all this is done; then the new output is in
        place and complete, so a signal that came meanwhile has nothing left to stop: it is told in a log line, and
        the run goes on to its end as a run that succeeded."""
        placing = [f for f in self.finals if os.path.lexists(self.partial(f))]
        appeared = [f for f in self.finals if os.path.lexists(f) and f not in self.replacing]
        if appeared:
            raise self.error(f"{appeared[0]} appeared while the output was written; it was left as it is")
        swapping, swapped = hidden(self.out, SWAPPING), hidden(self.out, SWAPPED)
        arrived: list[int] = []
        with signals_held(arrived):
            swapping.write_text(json.dumps([f.name for f in placing]), encoding="utf-8")
            self.anchor(swapping)
            for final in self.replacing:
                final.rename(hidden(final, OLD))
            for final in placing:
                self.partial(final).rename(final)
            swapping.rename(swapped)
            for final in self.replacing:
                _remove(hidden(final, OLD))
            swapped.unlink()
        self.replacing = []
        if arrived:
            self.log(f"{signal.Signals(arrived[0]).name} arrived while {self.out} was moved into place; the new "
                     "output is complete, so the run ends as done")

    def discard(self) -> None:
        """After a failure: remove everything partial and put back what was set aside (the previous output)."""
        self._settle(report_partials=False)

    def recover(self) -> None:
        """Put right what a run killed here left behind, each with a log line: a swap cut short is rolled back, or
        finished when its last rename was done; a set-aside output is restored where nothing took its place (else
        deleted); partial outputs are removed. Refuses, changing nothing, when another process holds any of them
        (its run is alive: someone deleted its lock file)."""
        for path in [hidden(self.out, SWAPPING), hidden(self.out, SWAPPED), *map(self.partial, self.finals)]:
            if held_elsewhere(path):
                raise self.error(f"{path} is being written by another npuport run, whose lock file someone "
                                 f"deleted; wait for that run to end, or stop it (nothing was changed)")
        self._settle(report_partials=True)

    def _settle(self, report_partials: bool) -> None:
        swapping, swapped = hidden(self.out, SWAPPING), hidden(self.out, SWAPPED)
        with signals_held():
            if swapped.exists():
                for final in self.finals:
                    _remove(hidden(final, OLD))
                swapped.unlink()
            elif swapping.exists():
                for final in self._placed_by(swapping):
                    _remove(final)
                    self.log(f"removed {final}: moved into place by a run stopped before the rest of its output")
                swapping.unlink()
            for final in self.finals:
                self._settle_one(final, report_partials)

    def _placed_by(self, swapping: Path) -> list[Path]:
        """The outputs an interrupted swap had already moved into place: those it names whose partial is gone. The
        journal is written whole before anything moves; one that cannot be read means nothing moved."""
        try:
            names = parse_json(swapping.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return []
        known = {f.name: f for f in self.finals}  # never a name from the file itself
        return [known[n] for n in names if isinstance(n, str) and n in known
                and os.path.lexists(known[n]) and not os.path.lexists(self.partial(known[n]))]

    def _settle_one(self, final: Path, report_partials: bool) -> None:
        aside, partial = hidden(final, OLD), self.partial(final)
        if os.path.lexists(aside):
            if os.path.lexists(final):
                _remove(aside)
                self.log(f"removed {aside.name}: {final} had already replaced it")
            else:
                aside.rename(final)
                self.log(f"restored {final} from {aside.name}: a run replacing it was stopped between its renames")
        if os.path.lexists(partial):
            size = size_of(partial)
            _remove(partial)
            if report_partials:
                self.log(f"removed {partial.name} ({size / GB:.2f} GB), left by a run that was stopped")

    def _check_space(self, needed: int, what: str) -> None:
        parent = self.out.parent
        free = shutil.disk_usage(parent).free
        if needed <= free * FREE_MARGIN:
            return
        held = [f"{f} ({size_of(f) / GB:.2f} GB, kept until the new {what} is complete)" for f in self.replacing]
        held += [f"{p.name} ({size_of(p) / GB:.2f} GB, another npuport output, unfinished)"
                 for p in sorted([*parent.glob(f".*{PARTIAL}"), *parent.glob(f".*{OLD}")])]
        raise self.error(f"not enough disk space in {parent}: the {what} needs {needed / GB:.2f} GB, "
                         f"{free / GB:.2f} GB free" + ("; space is held by " + ", ".join(held) if held else ""))

    def _cannot_write(self, error: OSError) -> str:
        """One line for a folder that refuses what npuport writes beside OUT (read-only, not permitted...)."""
        folder = Path(os.fsdecode(error.filename)).parent if error.filename is not None else self.out.parent
        state = "is unchanged" if os.path.lexists(self.out) else "was not written"
        return f"cannot write in {folder}: {error.strerror or error}; {self.out} {state}"

    def _write_failure(self, error: OSError) -> str:
        """One line for an OSError met while writing: the file (as it would be named in OUT), the reason, and that
        OUT was left as it was."""
        names = [Path(os.fsdecode(n)) for n in (error.filename2, error.filename) if n is not None]
        shown = next((self._final_name(n) for n in names if self._final_name(n)), names[-1] if names else self.out)
        state = "is unchanged" if self.replacing else "was not written"
        return f"{shown}: {error.strerror or error}; {self.out} {state}"

    def _final_name(self, path: Path) -> Path | None:
        """What `path`, inside a partial, will be called once in place (a copy names its source first, then the
        file it writes); None outside the partials."""
        for final in self.finals:
            partial = self.partial(final)
            if path == partial:
                return final
            if path.is_relative_to(partial):
                return final / path.relative_to(partial)
        return None
