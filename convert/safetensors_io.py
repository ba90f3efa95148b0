"""Streaming safetensors I/O: read one tensor (or one row block) at a time from a shard with positioned reads,
and write a shard whose header is known before its data, so no shard is ever held in memory whole.

The format (8-byte little-endian header length, JSON header, raw little-endian data) is small enough
to parse here, which lets every error name the file and the tensor.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from npuport.checksums import write_fully
from npuport.errors import CheckpointError
from npuport.jsonfile import JSONBoundError, parse_json

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
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's limit
_USIZE = 2**64  # the library reads offsets and dimensions as 64-bit unsigned integers
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
    """Parse a shard's header, refusing everything the `safetensors` library refuses (and a few things it lets
    through: duplicate keys, tensor entries written as JSON lists, dtypes npuport cannot read). Returns
    ({name: entry}, metadata); raises CheckpointError naming the file (and the tensor) for a missing, truncated
    or corrupt shard. Messages never quote the file's bytes, only names and numbers taken from a parsed header."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: shard is missing")
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        # The length field itself is not printed: in a file that is not a safetensors file it is its first 8 bytes.
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: corrupt safetensors header (its length field exceeds the 100 MB limit)")
        if 8 + n > size:
            raise CheckpointError(
                f"{path}: truncated or not a safetensors file (its header length field points past its {size} bytes)"
            )
        raw = f.read(n)
    header = _parse_header_json(raw, path)
    metadata = _metadata(header.pop("__metadata__", None), path)
    entries = {name: _entry(path, name, info, 8 + n) for name, info in header.items()}
    _check_layout(path, entries, 8 + n, size)
    return entries, metadata


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """json object_pairs_hook: a key that appears twice makes the header corrupt (json.loads would keep the last)."""
    obj: dict[str, object] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


def _json_int(literal: str) -> int | float:
    # The library reads `-0` as a float, so no negative literal can be an offset or a dimension: keep it a float.
    return float(literal) if literal.startswith("-") else int(literal)


def _json_float(literal: str) -> float:
    value = float(literal)
    if value in (float("inf"), float("-inf")):
        raise ValueError("number out of range")
    return value


def _json_constant(literal: str) -> None:
    raise ValueError(f"{literal} is not JSON")


def _parse_header_json(raw: bytes, path: Path) -> dict:
    """The header as a JSON object: UTF-8, standard JSON only (no NaN/Infinity), every key once."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: corrupt safetensors header: not UTF-8 text") from None
    try:
        header = parse_json(text, object_pairs_hook=_unique_keys, parse_int=_json_int, parse_float=_json_float,
                            parse_constant=_json_constant)
        json.dumps(header, ensure_ascii=False).encode("utf-8")  # a lone surrogate escape: the library refuses it
    except _DuplicateKey as e:
        key = shown_name(e.args[0])
        raise CheckpointError(f"{path}: corrupt safetensors header: key {key} appears twice") from None
    except JSONBoundError as e:  # nested deeper, or a number longer, than any header's
        raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
    except json.JSONDecodeError as e:  # its message gives a position, never the text
        raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
    except (ValueError, UnicodeEncodeError):
        raise CheckpointError(f"{path}: corrupt safetensors header: not standard JSON") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: not a JSON object")
    return header


def shown_name(name: str) -> str:
    """A name taken from a file (a tensor, a shard), for a one-line message: as it is when short and printable,
    else quoted and cut short."""
    if 0 < len(name) <= 200 and name.isprintable():
        return name
    return repr(name[:200]) + ("..." if len(name) > 200 else "")


def _metadata(value: object, path: Path) -> dict[str, str]:
    """`__metadata__`: absent, null or an object of strings, as the library accepts."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise CheckpointError(f"{path}: corrupt safetensors header: __metadata__ must map strings to strings")
    return value


def _usize(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _USIZE


def _entry(path: Path, name: str, info: object, data_start: int) -> TensorEntry:
    """One tensor's entry: an object with a known dtype, a shape of non-negative integers and two integer offsets."""
    where = f"{path}: tensor {shown_name(name)}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise CheckpointError(f"{where}: corrupt header entry (needs an object with dtype, shape and data_offsets)")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        shown = shown_name(dtype) if isinstance(dtype, str) else type(dtype).__name__
        raise CheckpointError(f"{where}: unsupported dtype {shown} (npuport reads {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_usize(d) for d in shape):
        raise CheckpointError(f"{where}: corrupt header entry (shape must be a list of non-negative integers)")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_usize(o) for o in offsets):
        raise CheckpointError(f"{where}: corrupt header entry (data_offsets must be two non-negative integers)")
    return TensorEntry(name, path, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _declared_bytes(entry: TensorEntry) -> int | None:
    """prod(shape) * itemsize, or None where the library's 64-bit arithmetic overflows on the way."""
    n = 1
    for d in entry.shape:
        n *= d
        if n >= _USIZE:
            return None
    n *= itemsize(entry.dtype)
    return n if n < _USIZE else None


def _check_layout(path: Path, entries: dict[str, TensorEntry], data_start: int, file_size: int) -> None:
    """Tensors' data contiguous from the start of the data section (`data_start`, just after the header), without
    overlap, each exactly as long as its shape and dtype say, the last ending exactly at the end of the file."""
    expected = data_start
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.end < entry.begin:
            raise CheckpointError(f"{path}: tensor {shown_name(entry.name)}: data_offsets end before they begin")
        if entry.begin != expected:
            how = "overlap the previous tensor's" if entry.begin < expected else "leave a gap after the previous"
            raise CheckpointError(
                f"{path}: tensor {shown_name(entry.name)}: data_offsets {how} data (tensors must be contiguous from 0)"
            )
        declared = _declared_bytes(entry)
        if declared is None:
            raise CheckpointError(f"{path}: tensor {shown_name(entry.name)}: shape {list(entry.shape)} is too large")
        if entry.nbytes != declared:
            raise CheckpointError(
                f"{path}: tensor {shown_name(entry.name)}: header says {entry.nbytes} bytes for shape "
                f"{list(entry.shape)} {entry.dtype}, which needs {declared}"
            )
        expected = entry.end
    if expected > file_size:
        last = shown_name(max(entries.values(), key=lambda e: e.end).name)
        raise CheckpointError(f"{path}: truncated shard: tensor {last} needs bytes up to {expected}, file has "
                              f"{file_size}")
    if expected < file_size:
        raise CheckpointError(
            f"{path}: corrupt safetensors file: {file_size - expected} bytes after the last tensor's data"
        )


class ShardReader:
    """Reads byte ranges of source shards with positioned reads (`os.preadv`) into a buffer, each shard opened once
    and shared by every thread. A file that shrinks while it is read is a short read, so a CheckpointError naming
    the shard and the tensor; a memory map would touch pages past the file's new end and die of SIGBUS."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    try:
                        fd = self._fds[path] = os.open(path, os.O_RDONLY)
                    except OSError as e:
                        raise CheckpointError(f"{path}: cannot open shard: {e.strerror or e}") from None
        return fd

    def read(self, entry: TensorEntry, begin: int, end: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Bytes [begin, end) of `entry`'s data as a uint8 tensor: the first bytes of `into` (uint8 [n]) where they
        fit, which a stream of blocks reuses (a fresh 64 MB buffer per block costs its page faults every time),
        else a new tensor."""
        n = end - begin
        out = into[:n] if into is not None and into.numel() >= n else torch.empty(n, dtype=torch.uint8)
        buf = memoryview(out.numpy())
        fd, at, got = self._fd(entry.file), entry.begin + begin, 0
        while got < len(buf):
            try:
                n = os.preadv(fd, [buf[got:]], at + got)
            except OSError as e:
                raise CheckpointError(f"{entry.file}: tensor {shown_name(entry.name)}: cannot read shard: "
                                      f"{e.strerror or e}") from None
            if n == 0:
                raise CheckpointError(
                    f"{entry.file}: tensor {shown_name(entry.name)}: the shard is now {os.fstat(fd).st_size} bytes, "
                    f"short of the tensor's data (bytes {entry.begin} to {entry.end}): truncated while being read?"
                )
            got += n
        return out

    def raw(self, entry: TensorEntry, begin: int, end: int, into: torch.Tensor | None = None) -> memoryview:
        """Bytes [begin, end) of `entry`'s data, read as `read` does."""
        return memoryview(self.read(entry, begin, end, into).numpy())

    def view(self, entry: TensorEntry, first_row: int = 0, rows: int | None = None) -> torch.Tensor:
        """Rows [first_row, first_row + rows) of `entry` along dim 0 (all rows by default), read into a new tensor."""
        dtype = DTYPES[entry.dtype]
        if not entry.shape:
            return self.read(entry, 0, entry.nbytes).view(dtype).reshape(())
        rows = entry.shape[0] - first_row if rows is None else rows
        row_bytes = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
        data = self.read(entry, first_row * row_bytes, (first_row + rows) * row_bytes)
        return data.view(dtype).reshape(rows, *entry.shape[1:])

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


MappedShards = ShardReader  # its former name, which check.py still imports (shards are no longer memory-mapped)


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
    every tensor gets exactly the bytes its header promised. Every write goes through `write_fully`: the file
    is unbuffered, and one write of a tensor over 2 GiB is cut short by the kernel."""

    def __init__(self, path: Path, specs: list[OutSpec], metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self.specs = specs
        self._f = open(self.path, "wb", buffering=0)
        try:
            write_fully(self._f, encode_header(specs, metadata))
        except BaseException:
            self._f.close()
            raise
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
            data = memoryview(data.contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")  # 0-dim too
        self._written += len(data)
        if self._written > spec.nbytes:
            raise AssertionError(f"{self.path}: {name} got more than its {spec.nbytes} bytes")
        write_fully(self._f, data)

    def abort(self) -> None:
        """Close the file after a failure; the caller removes the partial output."""
        self._f.close()

    def close(self) -> None:
        done = self._i == len(self.specs) - 1 and self._written == self.specs[-1].nbytes if self.specs else True
        self._f.close()
        if not done:
            raise AssertionError(f"{self.path}: closed before every tensor was written")
