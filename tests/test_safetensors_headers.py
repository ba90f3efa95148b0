"""npuport's safetensors header reader is at least as strict as the `safetensors` library: on a corpus of mutated
headers, generated deterministically from valid files the library itself wrote, it refuses every file
`safetensors.safe_open` refuses, refuses the others only where the test names why, and reads the same tensors
as the library from every file both accept."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from npuport.convert.safetensors_io import MappedShards, read_header
from npuport.errors import CheckpointError

# Why npuport refuses a file the library accepts. Each reason must be needed by at least one case of the corpus.
DUPLICATE_TENSOR = "a tensor named twice: the library keeps the last entry silently; npuport calls the header corrupt"
DUPLICATE_METADATA_KEY = "a __metadata__ key twice: the library keeps the last value; npuport calls the header corrupt"
LIST_ENTRY = "a tensor entry written as a JSON list: only serde's leniency accepts it; the format says object"
UNREADABLE_DTYPE = "a dtype the library knows but npuport does not read (FP8, unsigned 16-64 bit)"
STRICTER = {DUPLICATE_TENSOR, DUPLICATE_METADATA_KEY, LIST_ENTRY, UNREADABLE_DTYPE}

# Dtypes of the library that npuport does not read, by item size: a same-size swap keeps the byte count valid.
LIBRARY_ONLY_DTYPES = {1: "F8_E4M3", 2: "U16", 4: "U32", 8: "U64"}
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}
SAME_SIZE_DTYPE = {"BF16": "F16", "F16": "BF16", "F32": "I32", "I32": "F32", "I8": "U8", "U8": "I8", "I64": "F64",
                   "F64": "I64", "I16": "BF16", "BOOL": "U8"}


class Obj(list):
    """A JSON object as (key, value) pairs, so that a mutation can repeat a key."""


class Raw(str):
    """JSON text written as it is (16.0, -0, NaN, 1e1 ...)."""


def dump(value: object) -> str:
    if isinstance(value, Obj):
        return "{" + ",".join(f"{json.dumps(k)}:{dump(v)}" for k, v in value) + "}"
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, list):
        return "[" + ",".join(dump(v) for v in value) + "]"
    return json.dumps(value)


@dataclass
class Base:
    """A valid file the library wrote, as its header (pairs, in file order) and its data section."""

    name: str
    header: Obj
    data: bytes

    def tensors(self) -> list[str]:
        return [k for k, _ in self.header if k != "__metadata__"]


@dataclass
class Case:
    name: str
    content: bytes
    stricter: str | None = None  # why npuport may refuse it when the library accepts it


def base_files(folder: Path) -> list[Base]:
    """Three valid files written by safetensors.torch.save_file: mixed dtypes with a scalar, an empty tensor and
    metadata; one tensor without metadata; wide 8-byte dtypes."""
    g = torch.Generator().manual_seed(14)
    contents = {
        "mixed": ({"w": torch.randn(3, 4, generator=g).to(torch.bfloat16), "b": torch.randn(5, generator=g),
                   "s": torch.tensor(7, dtype=torch.int64), "e": torch.zeros(0, 3, dtype=torch.float16),
                   "m": torch.rand(2, 2, generator=g) > 0.5, "q": torch.randint(-128, 127, (7,), generator=g,
                                                                                dtype=torch.int8)},
                  {"format": "pt", "note": "mixed"}),
        "single": ({"x": torch.randn(2, 2, generator=g)}, None),
        "wide": ({"d": torch.randn(3, generator=g, dtype=torch.float64),
                  "i": torch.randint(0, 1000, (2, 3), generator=g, dtype=torch.int64),
                  "h": torch.randint(0, 1000, (4,), generator=g, dtype=torch.int16)}, {"format": "pt"}),
    }
    bases = []
    for name, (tensors, metadata) in contents.items():
        path = folder / f"{name}.safetensors"
        save_file(tensors, str(path), metadata=metadata)
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n], object_pairs_hook=Obj)
        bases.append(Base(name, header, raw[8 + n :]))
    return bases


def assemble(header: object, data: bytes, length_delta: int = 0, pad: str = "") -> bytes:
    text = (dump(header) + pad).encode("utf-8") if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(text) + length_delta) + text + data


def with_entry(header: Obj, tensor: str, edit: Callable[[Obj], object]) -> Obj:
    """The header with tensor's entry replaced by edit(a copy of the entry)."""
    return Obj((k, edit(Obj(v)) if k == tensor else v) for k, v in header)


def set_field(field: str, value: object) -> Callable[[Obj], Obj]:
    return lambda entry: Obj((k, value if k == field else v) for k, v in entry)


def get(entry: Obj, field: str) -> object:
    return dict(entry)[field]


def tensor_cases(base: Base) -> Iterator[Case]:
    """Mutations of one tensor's entry, for each tensor of `base`."""
    entries = dict(base.header)
    for t in base.tensors():
        entry = entries[t]
        (b, e), dtype, shape = get(entry, "data_offsets"), get(entry, "dtype"), get(entry, "shape")
        h = base.header
        mutations: dict[str, tuple[object, str | None]] = {
            "shift+1": (with_entry(h, t, set_field("data_offsets", [b + 1, e + 1])), None),
            "shift-1": (with_entry(h, t, set_field("data_offsets", [b - 1, e - 1])), None) if b else (None, None),
            "end+1": (with_entry(h, t, set_field("data_offsets", [b, e + 1])), None),
            "end-1": (with_entry(h, t, set_field("data_offsets", [b, e - 1])), None) if e > b else (None, None),
            "begin-negative": (with_entry(h, t, set_field("data_offsets", [Raw("-8"), e])), None),
            "begin-minus-zero": (with_entry(h, t, set_field("data_offsets", [Raw("-0"), e])), None),
            "offsets-float": (with_entry(h, t, set_field("data_offsets", [Raw(f"{b}.0"), Raw(f"{e}.0")])), None),
            "offsets-exponent": (with_entry(h, t, set_field("data_offsets", [b, Raw(f"{e}e0")])), None),
            "offsets-string": (with_entry(h, t, set_field("data_offsets", [str(b), e])), None),
            "offsets-three": (with_entry(h, t, set_field("data_offsets", [b, e, e])), None),
            "offsets-one": (with_entry(h, t, set_field("data_offsets", [b])), None),
            "offsets-swapped": (with_entry(h, t, set_field("data_offsets", [e, b])), None),
            "offsets-from-zero": (with_entry(h, t, set_field("data_offsets", [0, e - b])), None),
            "offsets-nan": (with_entry(h, t, set_field("data_offsets", [b, Raw("NaN")])), None),
            "offsets-2^64": (with_entry(h, t, set_field("data_offsets", [b, 2**64 + e])), None),
            "shape-float": (with_entry(h, t, set_field("shape", [Raw(f"{d}.0") for d in shape])), None)
            if shape else (None, None),
            "shape-negative": (with_entry(h, t, set_field("shape", [-d for d in shape])), None)
            if any(shape) else (None, None),
            "shape-extra-1": (with_entry(h, t, set_field("shape", [*shape, 1])), None),
            "shape-leading-1": (with_entry(h, t, set_field("shape", [1, *shape])), None),
            "shape-drop-dim": (with_entry(h, t, set_field("shape", shape[1:])), None) if shape else (None, None),
            "shape-reversed": (with_entry(h, t, set_field("shape", shape[::-1])), None),
            "shape-doubled": (with_entry(h, t, set_field("shape", [2 * d for d in shape])), None),
            "shape-string": (with_entry(h, t, set_field("shape", str(shape))), None),
            "shape-bool": (with_entry(h, t, set_field("shape", [True] * len(shape))), None) if shape else (None, None),
            "shape-2^64": (with_entry(h, t, set_field("shape", [2**64, *shape])), None),
            "shape-overflow": (with_entry(h, t, set_field("shape", [2**40, 2**40, *shape])), None),
            "shape-zero-then-huge": (with_entry(h, t, set_field("shape", [0, 2**40, 2**40])), None),
            "dtype-lowercase": (with_entry(h, t, set_field("dtype", dtype.lower())), None),
            "dtype-unknown": (with_entry(h, t, set_field("dtype", "F31")), None),
            "dtype-number": (with_entry(h, t, set_field("dtype", 4)), None),
            "dtype-same-size": (with_entry(h, t, set_field("dtype", SAME_SIZE_DTYPE[dtype])), None),
            "dtype-library-only": (with_entry(h, t, set_field("dtype", LIBRARY_ONLY_DTYPES[ITEMSIZE[dtype]])),
                                   UNREADABLE_DTYPE),
            "entry-as-list": (Obj((k, [get(v, "dtype"), get(v, "shape"), get(v, "data_offsets")] if k == t else v)
                                  for k, v in h), LIST_ENTRY),
            "entry-number": (Obj((k, 5 if k == t else v) for k, v in h), None),
            "entry-extra-field": (with_entry(h, t, lambda en: Obj([*en, ("extra", [1, 2.5, "x"])])), None),
            "entry-duplicate-field": (with_entry(h, t, lambda en, d=dtype: Obj([*en, ("dtype", d)])), None),
            "entry-missing-dtype": (with_entry(h, t, lambda en: Obj(p for p in en if p[0] != "dtype")), None),
            "entry-missing-shape": (with_entry(h, t, lambda en: Obj(p for p in en if p[0] != "shape")), None),
            "entry-missing-offsets": (with_entry(h, t, lambda en: Obj(p for p in en if p[0] != "data_offsets")),
                                      None),
            "tensor-removed": (Obj(p for p in h if p[0] != t), None),
            "tensor-repeated": (Obj([*h, (t, entries[t])]), DUPLICATE_TENSOR),
            "tensor-repeated-other-offsets": (Obj([*h, (t, set_field("data_offsets", [e, e + (e - b)])(entry))]),
                                              DUPLICATE_TENSOR),
            "name-lone-surrogate": (Obj((Raw('"' + t + '\\ud800"') if k == t else k, v) for k, v in h), None),
            "name-non-ascii": (Obj((t + "é" if k == t else k, v) for k, v in h), None),
        }
        for label, (header, stricter) in mutations.items():
            if header is not None:
                yield Case(f"{base.name}/{t}/{label}", assemble(header, base.data), stricter)


def file_cases(base: Base) -> Iterator[Case]:
    """Mutations of the whole file: the length field, the bytes around the header, __metadata__, JSON oddities."""
    h, data = base.header, base.data
    end = len(data)
    no_meta = Obj(p for p in h if p[0] != "__metadata__")
    cases: dict[str, tuple[bytes, str | None]] = {
        "valid": (assemble(h, data), None),
        "length+1": (assemble(h, data, 1), None),
        "length-1": (assemble(h, data, -1), None),
        "length+8": (assemble(h, data, 8), None),
        "length-8": (assemble(h, data, -8), None),
        "length-zero": (assemble(h, data, -len(dump(h))), None),
        "length-huge": (assemble(h, data, 2**63), None),
        "length-over-limit": (assemble(h, data, 100_000_001), None),
        "trailing-byte": (assemble(h, data + b"\0"), None),
        "trailing-block": (assemble(h, data + bytes(64)), None),
        "truncated-1": (assemble(h, data[:-1]), None) if data else (None, None),
        "truncated-to-header": (assemble(h, b""), None),
        "truncated-in-header": (assemble(h, data)[: 8 + len(dump(h)) // 2], None),
        "short-file": (b"\x10\0\0\0", None),
        "pad-spaces": (assemble(h, data, pad="       "), None),
        "pad-newline-tab": (assemble(h, data, pad="\n\t\r "), None),
        "pad-nul": (assemble(h, data, pad="\0\0"), None),
        "pad-comment": (assemble(h, data, pad="//"), None),
        "leading-spaces": (assemble(("   " + dump(h)).encode(), data), None),
        "bom": (assemble(("\ufeff" + dump(h)).encode(), data), None),
        "not-utf8": (assemble(dump(h).replace('"', '"\xff', 1).encode("latin-1"), data), None),
        "header-list": (assemble([1, 2], data), None),
        "header-string": (assemble("x", data), None),
        "header-number": (assemble(Raw("7"), data), None),
        "header-empty-object": (assemble(Obj(), data), None),
        "metadata-null": (assemble(Obj([("__metadata__", None), *no_meta]), data), None),
        "metadata-empty": (assemble(Obj([("__metadata__", Obj()), *no_meta]), data), None),
        "metadata-last": (assemble(Obj([*no_meta, ("__metadata__", Obj([("k", "v")]))]), data), None),
        "metadata-list": (assemble(Obj([("__metadata__", []), *no_meta]), data), None),
        "metadata-string": (assemble(Obj([("__metadata__", "pt"), *no_meta]), data), None),
        "metadata-int-value": (assemble(Obj([("__metadata__", Obj([("k", 1)])), *no_meta]), data), None),
        "metadata-null-value": (assemble(Obj([("__metadata__", Obj([("k", None)])), *no_meta]), data), None),
        "metadata-nested": (assemble(Obj([("__metadata__", Obj([("k", Obj([("a", "b")]))])), *no_meta]), data),
                            None),
        "metadata-twice": (assemble(Obj([("__metadata__", Obj([("a", "1")])), ("__metadata__", Obj([("a", "2")])),
                                         *no_meta]), data), None),
        "metadata-key-twice": (assemble(Obj([("__metadata__", Obj([("a", "1"), ("a", "2")])), *no_meta]), data),
                               DUPLICATE_METADATA_KEY),
        "metadata-as-tensor": (assemble(Obj([("__metadata__", Obj([("dtype", "F32"), ("shape", [1]),
                                                                     ("data_offsets", [0, 4])])), *no_meta]), data),
                               None),
        "extra-infinity": (assemble(Obj([*no_meta[:-1], (no_meta[-1][0], Obj([*no_meta[-1][1], ("x", Raw("1e400"))]))]),
                                    data), None),
        "extra-5000-digit-integer": (assemble(Obj([*no_meta[:-1], (no_meta[-1][0], Obj([*no_meta[-1][1],
                                                                                       ("x", Raw("7" * 5000))]))]),
                                              data), None),  # Python's int() refuses over 4300 digits
        "nested-100000-deep": (assemble(Obj([("__metadata__", Raw("[" * 100_000 + "]" * 100_000)), *no_meta]), data),
                               None),  # Python's json recurses once per level
        "empty-tensor-appended": (assemble(Obj([*h, ("z", Obj([("dtype", "F32"), ("shape", [0, 5]),
                                                                ("data_offsets", [end, end])]))]), data), None),
        "empty-name-tensor": (assemble(Obj([*h, ("", Obj([("dtype", "U8"), ("shape", [3]),
                                                           ("data_offsets", [end, end + 3])]))]), data + b"abc"), None),
        "tensor-appended-overlapping": (assemble(Obj([*h, ("z", Obj([("dtype", "U8"), ("shape", [3]),
                                                                      ("data_offsets", [end - 3, end])]))]), data),
                                        None) if end >= 3 else (None, None),
        "no-tensors-with-data": (assemble(Obj([("__metadata__", Obj())]), data), None) if data else (None, None),
        "no-tensors-no-data": (assemble(Obj(), b""), None),
    }
    for label, (content, stricter) in cases.items():
        if content is not None:
            yield Case(f"{base.name}/{label}", content, stricter)


def library_reads(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """Every tensor and the metadata as safetensors.safe_open reads them, or None when it refuses the file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except Exception:  # the library's verdict: SafetensorError, or an OverflowError from its Python binding
        return None


def npuport_reads(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]] | CheckpointError:
    try:
        entries, metadata = read_header(path)
    except CheckpointError as e:
        return e
    reader = MappedShards()
    try:
        return {name: reader.view(entry).clone() for name, entry in entries.items()}, metadata
    finally:
        reader.close()


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Case]:
    folder = tmp_path_factory.mktemp("bases")
    cases = []
    for base in base_files(folder):
        cases += [*tensor_cases(base), *file_cases(base)]
    return cases


def test_reader_refuses_what_the_library_refuses_and_reads_the_same_tensors(corpus, tmp_path):
    disagreements, verdicts, needed = [], {"both accept": 0, "both refuse": 0, "npuport stricter": 0}, set()
    path = tmp_path / "case.safetensors"
    for case in corpus:
        path.write_bytes(case.content)
        library, ours = library_reads(path), npuport_reads(path)
        if library is None and not isinstance(ours, CheckpointError):
            disagreements.append(f"{case.name}: the library refuses it, npuport accepts it")
        elif library is None:
            verdicts["both refuse"] += 1
        elif isinstance(ours, CheckpointError):
            if case.stricter is None:
                disagreements.append(f"{case.name}: the library accepts it, npuport refuses it: {ours}")
            verdicts["npuport stricter"] += 1
            needed.add(case.stricter)
        else:
            verdicts["both accept"] += 1
            tensors, metadata = library
            mine, my_metadata = ours
            if sorted(mine) != sorted(tensors) or my_metadata != metadata:
                disagreements.append(f"{case.name}: different tensors or metadata")
            for name, t in tensors.items():
                if name in mine and (mine[name].dtype, mine[name].shape, as_bytes(mine[name])) != (
                        t.dtype, t.shape, as_bytes(t)):
                    disagreements.append(f"{case.name}: tensor {name!r} read differently")
        if isinstance(ours, CheckpointError):
            message = str(ours)
            if "\n" in message or not message.startswith(str(path)):
                disagreements.append(f"{case.name}: error is not one line naming the file: {message!r}")
    assert not disagreements, "\n".join(disagreements)
    assert len(corpus) >= 200
    assert verdicts["both accept"] >= 20 and verdicts["both refuse"] >= 150, verdicts
    assert needed == STRICTER, f"reasons no case needs: {STRICTER - needed}"


def refusal(path: Path, content: bytes) -> str:
    """read_header's one-line error for a file holding `content`, without the file name in front."""
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as refused:
        read_header(path)
    message = str(refused.value)
    assert message.startswith(str(path)) and "\n" not in message
    return message.removeprefix(str(path))


def test_a_file_that_is_not_safetensors_is_refused_without_printing_its_bytes(tmp_path):
    secret = b"hunter2:x:0:0:hunter2:/home/hunter2:/bin/sh\n"
    message = refusal(tmp_path / "passwd", secret)
    first8 = struct.unpack("<Q", secret[:8])[0]  # what an error quoting the header length would print
    for leaked in (str(first8), f"{first8:,}", hex(first8), "hunter2"):
        assert leaked not in message, message
    # a JSON-looking file that is not a valid header: the error gives a position, not the text
    assert "hunter2" not in refusal(tmp_path / "passwd", b"\x10\0\0\0\0\0\0\0{\"hunter2\": [1, 2]}")
    message = refusal(tmp_path / "passwd", b"\x02\0\0\0\0\0\0\0\xff\xfe")
    assert "0xff" not in message and "\\xff" not in message, message


def test_header_errors_name_file_and_tensor(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a.weight": torch.zeros(2, 2), "b.weight": torch.ones(3)}, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["b.weight"]["data_offsets"] = [0, 12]  # b's bytes now alias a's
    path.write_bytes(assemble(Obj(header.items()), raw[8 + n :]))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor [ab]\.weight: data_offsets overlap"):
        read_header(path)
