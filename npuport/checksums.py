"""SHA-256 for a release: copy a file and hash it in the same pass, hash what is written to a stream, and
read and write `SHA256SUMS` in the format of coreutils' `sha256sum` (so `sha256sum -c` checks it too)."""

from __future__ import annotations

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


def _write_fully(out: BinaryIO, data: memoryview) -> None:
    while data:
        data = data[out.write(data):]


def _hash_and_write(view: memoryview, digest: Any, out: BinaryIO, chunk: int, depth: int) -> None:
    pieces: queue.Queue[memoryview | None] = queue.Queue(maxsize=depth)
    failure: list[BaseException] = []

    def write_all() -> None:
        while (piece := pieces.get()) is not None:
            with piece:  # released here, so the mapping can be closed
                if not failure:
                    try:
                        _write_fully(out, piece)
                    except BaseException as e:  # reported by the hashing thread; keep draining so it never blocks
                        failure.append(e)

    writer = threading.Thread(target=write_all, name="copy-writer", daemon=True)
    writer.start()
    try:
        for offset in range(0, len(view), chunk):
            if failure:
                break
            piece = view[offset:offset + chunk]
            try:
                digest.update(piece)
                pieces.put(piece)
            except BaseException:
                piece.release()
                raise
    finally:
        pieces.put(None)
        writer.join()
    if failure:
        raise failure[0]


class HashingWriter:
    """A write-only binary stream that hashes every byte it passes on to `raw` (for tarfile)."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.digest = hashlib.sha256()
        self.bytes_written = 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.bytes_written += len(data)
        return self.raw.write(data)

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
