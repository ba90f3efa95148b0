"""Streaming safetensors I/O: read one tensor (or one row block) at a time from a memory-mapped shard,
and write a shard whose header is known before its data, so no shard is ever held in memory whole.

The format (8-byte little-endian header length, JSON header, raw little-endian data) is small enough
to parse here, which lets every error name the file and the tensor.
"""

from __future__ import annotations

import json
import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from npuport.errors import CheckpointError

DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024
_ALIGN = 8


def itemsize(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: `file`, its dtype name, shape and absolute byte range in the file."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def read_header(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Parse a shard's header. Returns ({name: entry}, metadata); raises CheckpointError naming the
    file (and the tensor) for a missing, truncated or corrupt shard."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: shard is missing")
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"{path}: corrupt safetensors header (declares {n} header bytes, file has {size})")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + n
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            dtype, shape, (b, e) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for tensor {name!r}") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        entry = TensorEntry(name, path, dtype, shape, data_start + int(b), data_start + int(e))
        if entry.nbytes != entry.numel * itemsize(dtype) or entry.nbytes < 0:
            raise CheckpointError(
                f"{path}: tensor {name!r}: header says {entry.nbytes} bytes for shape {list(shape)} {dtype}"
            )
        if entry.end > size:
            raise CheckpointError(
                f"{path}: truncated shard: tensor {name!r} needs bytes up to {entry.end}, file has {size}"
            )
        entries[name] = entry
    return entries, metadata


class MappedShards:
    """Memory-maps source shards on demand. `view` returns a zero-copy tensor over part of a tensor's
    bytes; `release` drops those pages from this process's resident set once they are used, so the
    resident set stays bounded by what is being worked on, not by what has been read."""

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}
        self._files: dict[Path, object] = {}

    def _map(self, path: Path) -> mmap.mmap:
        m = self._maps.get(path)
        if m is None:
            f = open(path, "rb")
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._files[path], self._maps[path] = f, m
        return m

    def view(self, entry: TensorEntry, first_row: int = 0, rows: int | None = None) -> torch.Tensor:
        """Rows [first_row, first_row + rows) of `entry` along dim 0 (all rows by default), as a
        zero-copy read-only tensor over the mapped file."""
        dtype = DTYPES[entry.dtype]
        if not entry.shape:
            return self.frombuffer(self.raw(entry, 0, entry.nbytes), dtype).reshape(())
        rows = entry.shape[0] - first_row if rows is None else rows
        row_bytes = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
        buf = self.raw(entry, first_row * row_bytes, (first_row + rows) * row_bytes)
        return self.frombuffer(buf, dtype).reshape(rows, *entry.shape[1:])

    @staticmethod
    def frombuffer(buf: memoryview, dtype: torch.dtype) -> torch.Tensor:
        if len(buf) == 0:
            return torch.empty(0, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the buffer is read-only; nothing writes to these views
            return torch.frombuffer(buf, dtype=dtype)

    def raw(self, entry: TensorEntry, begin: int, end: int) -> memoryview:
        """Bytes [begin, end) of `entry`'s data."""
        return memoryview(self._map(entry.file))[entry.begin + begin : entry.begin + end]

    def release(self, entry: TensorEntry, begin: int = 0, end: int | None = None) -> None:
        """Tell the kernel the pages of bytes [begin, end) of `entry` are no longer needed here."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        m = self._map(entry.file)
        lo = (entry.begin + begin) // mmap.PAGESIZE * mmap.PAGESIZE
        hi = entry.begin + (entry.nbytes if end is None else end)
        if hi > lo:
            m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere; the map closes when it goes
                pass
        for f in self._files.values():
            f.close()
        self._maps.clear()
        self._files.clear()


@dataclass(frozen=True)
class OutSpec:
    """A tensor to be written: name, dtype name, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = itemsize(self.dtype)
        for d in self.shape:
            n *= d
        return n


def encode_header(specs: list[OutSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length plus JSON header for `specs` laid out contiguously in the given order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % _ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def shard_file_size(specs: list[OutSpec], metadata: dict[str, str] | None = None) -> int:
    return len(encode_header(specs, metadata)) + sum(s.nbytes for s in specs)


class ShardWriter:
    """Writes one shard: the header first, then each tensor's bytes in header order, checking that
    every tensor gets exactly the bytes its header promised."""

    def __init__(self, path: Path, specs: list[OutSpec], metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self.specs = specs
        self._f = open(self.path, "wb", buffering=0)
        self._f.write(encode_header(specs, metadata))
        self._i = 0
        self._written = 0

    def write(self, name: str, data: torch.Tensor | memoryview | bytes) -> None:
        """Append (part of) tensor `name`'s data. Consecutive calls for the same name concatenate."""
        spec = self.specs[self._i]
        if spec.name != name:
            if self._written != spec.nbytes:
                raise AssertionError(f"{self.path}: {spec.name} got {self._written} of {spec.nbytes} bytes")
            self._i += 1
            self._written = 0
            spec = self.specs[self._i]
            if spec.name != name:
                raise AssertionError(f"{self.path}: expected tensor {spec.name}, got {name}")
        if isinstance(data, torch.Tensor):
            if DTYPE_NAMES[data.dtype] != spec.dtype:
                raise AssertionError(f"{self.path}: {name} is {data.dtype}, header says {spec.dtype}")
            data = memoryview(data.contiguous().view(torch.uint8).numpy()).cast("B")
        self._written += len(data)
        if self._written > spec.nbytes:
            raise AssertionError(f"{self.path}: {name} got more than its {spec.nbytes} bytes")
        self._f.write(data)

    def abort(self) -> None:
        """Close the file after a failure; the caller removes the partial output."""
        self._f.close()

    def close(self) -> None:
        done = self._i == len(self.specs) - 1 and self._written == self.specs[-1].nbytes if self.specs else True
        self._f.close()
        if not done:
            raise AssertionError(f"{self.path}: closed before every tensor was written")
