"""SHA-256 for a release: copy a file and hash it in the same pass, hash what is written to a stream, and
read and write `SHA256SUMS` in the format of coreutils' `sha256sum` (so `sha256sum -c` checks it too). Also
`write_fully`, the write loop every writer of npuport goes through."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import queue
import re
import threading
from pathlib import Path
from typing import Any, BinaryIO

SUMS_NAME = "SHA256SUMS"
COPY_CHUNK = 4 * 1024 * 1024
COPY_DEPTH = 8  # chunks the hashing thread may run ahead of the writing thread
_SUM_LINE = re.compile(r"^(?P<digest>[0-9a-f]{64}) (?P<mode>[ *])(?P<path>.+)$")


def sha256_file(path: Path) -> str:
    """SHA-256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(COPY_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def copy_with_sha256(src: Path, dst: Path, chunk: int = COPY_CHUNK, depth: int = COPY_DEPTH) -> str:
    """Copy `src` to a new file `dst` and return the SHA-256 of the bytes copied, in one pass over `src`.

    `src` is memory-mapped: this thread hashes each chunk of the mapping and hands the same memory to a writer
    thread, up to `depth` chunks ahead of it (hashlib and file writes release the GIL). No byte is copied
    into a Python buffer, and hashing runs on while the kernel throttles a write. `src` must not shrink
    while it is copied."""
    digest = hashlib.sha256()
    with open(src, "rb") as fin, open(dst, "xb", buffering=0) as fout:
        if os.fstat(fin.fileno()).st_size == 0:
            return digest.hexdigest()
        with mmap.mmap(fin.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            _hash_and_write(view, digest, fout, chunk, depth)
    return digest.hexdigest()


def write_fully(out: BinaryIO, data: bytes | memoryview) -> None:
    """Write every byte of `data` to the file `out`. A raw (unbuffered) file may write fewer bytes than asked -
    Linux writes at most 2 GiB - 4 KiB per call - and returns how many; this writes the rest. An error names the
    file. Every view taken of `data` is released before this returns or raises, so that a memory map behind
    `data` can be closed as soon as the caller is done with it (a view kept alive by the traceback of a failed
    write made closing the map raise BufferError, which hid the error, e.g. a full disk)."""
    with memoryview(data) as view, view.cast("B") as octets:
        done = 0
        while done < len(octets):
            with octets[done:] as rest:
                try:
                    count = out.write(rest)
                except OSError as e:
                    raise _naming(e, out) from None
            if not count:
                raise OSError(errno.EIO, "the write made no progress", getattr(out, "name", None))
            done += count


def _naming(error: OSError, out: BinaryIO) -> OSError:
    """`error` with the file's name, which a failed write() does not carry (open() does)."""
    name = getattr(out, "name", None)
    if error.filename is not None or not isinstance(name, str):
        return error
    return OSError(error.errno, error.strerror, name)


def _hash_and_write(view: memoryview, digest: Any, out: BinaryIO, chunk: int, depth: int) -> None:
    """Each thread takes its own views of `view` and releases them itself: only offsets cross between them, so
    a Ctrl-C raised in this thread at any point never leaves a view that the other thread may still use."""
    offsets: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    ahead = threading.Semaphore(depth)  # chunks hashed and not yet written
    stop = threading.Event()  # a failure or an interrupt: the writer drains the offsets without writing
    ended = threading.Event()  # the writer holds no view any more
    failure: list[BaseException] = []

    def write_all() -> None:
        try:
            while (offset := offsets.get()) is not None:
                if not stop.is_set():
                    try:
                        with view[offset:offset + chunk] as piece:  # released here, so the mapping can be closed
                            write_fully(out, piece)
                    except BaseException as e:  # reported by the hashing thread
                        failure.append(e)
                        stop.set()
                ahead.release()
        finally:
            ended.set()

    writer = threading.Thread(target=write_all, name="copy-writer", daemon=True)
    writer.start()
    try:
        for offset in range(0, len(view), chunk):
            with view[offset:offset + chunk] as piece:
                digest.update(piece)
            ahead.acquire()
            if stop.is_set():
                break
            offsets.put(offset)
    except BaseException:
        stop.set()
        raise
    finally:
        _wait_for_writer(offsets, stop, ended)
    if failure:
        raise failure[0]


def _wait_for_writer(offsets: queue.SimpleQueue, stop: threading.Event, ended: threading.Event) -> None:
    """Give the writer its end mark and wait until it has ended, however often Ctrl-C or SIGTERM interrupts the
    wait; the first such interrupt is raised then. The writer holds a view of the memory map: a wait cut short
    closed the map under it, and the signal ended in a BufferError traceback instead of its own line. Waits on
    `ended`, not on a join: a join cut short by an interrupt takes the thread for ended (Python 3.11)."""
    interrupted: BaseException | None = None
    while True:
        try:
            offsets.put(None)
            ended.wait()
            break
        except BaseException as e:
            stop.set()
            interrupted = interrupted or e
    if interrupted is not None:
        raise interrupted


class HashingWriter:
    """A write-only binary stream that hashes every byte it passes on to the file `raw` (for tarfile), written
    in full whatever count `raw.write` returns."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.digest = hashlib.sha256()
        self.bytes_written = 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        write_fully(self.raw, data)
        self.bytes_written += len(data)
        return len(data)

    def tell(self) -> int:
        return self.bytes_written

    def hexdigest(self) -> str:
        return self.digest.hexdigest()


def format_sums(digests: dict[str, str]) -> str:
    """`SHA256SUMS` text: one `<hex>  <path>` line per file (text mode, as sha256sum writes it), sorted."""
    for path in digests:
        if "\n" in path or "\\" in path:
            raise ValueError(f"{path!r}: sha256sum would escape this name; rename it")
    return "".join(f"{digests[path]}  {path}\n" for path in sorted(digests))


def parse_sums(text: str) -> tuple[dict[str, str], list[str]]:
    """The digests of a `SHA256SUMS` text by relative path, and a problem for each line that is malformed."""
    digests: dict[str, str] = {}
    problems: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        m = _SUM_LINE.match(line)
        if m is None:
            problems.append(f"{SUMS_NAME}:{number}: not a `<sha256>  <file>` line: {line[:80]!r}")
        elif m["path"] in digests:
            problems.append(f"{SUMS_NAME}:{number}: {m['path']} is listed twice")
        else:
            digests[m["path"]] = m["digest"]
    return digests, problems


def listing_checksum(digests: dict[str, str]) -> str:
    """sha256 of the SHA256SUMS listing (format_sums) of these digests by relative path: the checksum that binds
    a validation report to the artifact's files (validate records it, package and verify-release compare it)."""
    return hashlib.sha256(format_sums(digests).encode("utf-8")).hexdigest()
