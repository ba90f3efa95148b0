"""SHA-256 for a release: copy a file and hash it in the same pass, hash what is written to a stream, and
read and write `SHA256SUMS` in the format of coreutils' `sha256sum` (so `sha256sum -c` checks it too). Also
`write_fully`, the write loop every writer of npuport goes through. Nothing here memory-maps a file: a file
truncated by someone else while it is read must end a read short, not fault."""

from __future__ import annotations

import errno
import hashlib
import os
import queue
import re
import threading
from pathlib import Path
from typing import Any, BinaryIO

from npuport.errors import NpuportError

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
    """Copy `src` to a new file `dst` and return the SHA-256 of the bytes written, in one pass over `src`.

    `src` is read with positioned reads (pread) into `depth` buffers of `chunk` bytes, never memory-mapped: a
    source truncated while it is copied ends the copy short - its digest then differs from the one the caller
    checked it against - where a mapping would fault ("Bad address", or SIGBUS). This thread reads and hashes each
    buffer and hands it to a writer thread, up to `depth` buffers ahead of it (hashlib and file I/O release the
    GIL); the digest is of exactly the bytes handed to the writer, so it is the digest of what was written. At
    most the size `src` had when opened is copied: a source that grows meanwhile is cut there."""
    digest = hashlib.sha256()
    with open(src, "rb", buffering=0) as fin, open(dst, "xb", buffering=0) as fout:
        size = os.fstat(fin.fileno()).st_size
        if size:
            _hash_and_write(fin.fileno(), size, digest, fout, min(chunk, size), depth)
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


def _hash_and_write(fd: int, size: int, digest: Any, out: BinaryIO, chunk: int, depth: int) -> None:
    """Read up to `size` bytes of the file `fd` into a ring of `depth` buffers, hash each and pass it to a writer
    thread. Only buffer numbers and lengths cross between the threads; a buffer is read into again only once the
    writer has released it (the semaphore), so a Ctrl-C raised here at any point never changes bytes the writer is
    still writing."""
    buffers = [bytearray(chunk) for _ in range(depth)]
    pieces: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
    free = threading.Semaphore(depth)  # buffers not handed to the writer, or written already
    stop = threading.Event()  # a failure or an interrupt: the writer drains the queue without writing
    ended = threading.Event()  # the writer holds no buffer any more
    failure: list[BaseException] = []

    def write_all() -> None:
        try:
            while (piece := pieces.get()) is not None:
                if not stop.is_set():
                    number, length = piece
                    try:
                        with memoryview(buffers[number]) as view, view[:length] as data:
                            write_fully(out, data)
                    except BaseException as e:  # reported by the reading thread
                        failure.append(e)
                        stop.set()
                free.release()
        finally:
            ended.set()

    writer = threading.Thread(target=write_all, name="copy-writer", daemon=True)
    writer.start()
    try:
        offset, number = 0, 0
        while offset < size:
            free.acquire()
            if stop.is_set():
                break
            with memoryview(buffers[number]) as view, view[:min(chunk, size - offset)] as room:
                length = os.preadv(fd, [room], offset)
                if length == 0:  # the source shrank since it was opened: the digest tells the caller
                    break
                with room[:length] as data:
                    digest.update(data)
            pieces.put((number, length))
            offset += length
            number = (number + 1) % depth
    except BaseException:
        stop.set()
        raise
    finally:
        _wait_for_writer(pieces, stop, ended)
    if failure:
        raise failure[0]


def _wait_for_writer(pieces: queue.SimpleQueue, stop: threading.Event, ended: threading.Event) -> None:
    """Give the writer its end mark and wait until it has ended, however often Ctrl-C or SIGTERM interrupts the
    wait; the first such interrupt is raised then (the writer may still be writing a buffer, and the file it
    writes must not be closed under it). Waits on `ended`, not on a join: a join cut short by an interrupt takes
    the thread for ended (Python 3.11)."""
    interrupted: BaseException | None = None
    while True:
        try:
            pieces.put(None)
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
        if "\n" in path or "\r" in path or "\\" in path:
            raise NpuportError(f"{path!r}: sha256sum would escape this name; rename it")
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
