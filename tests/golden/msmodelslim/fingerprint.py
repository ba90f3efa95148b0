"""sha256 fingerprint of the tensors of a safetensors checkpoint folder: every tensor of every `*.safetensors` file
in it, by name (sorted), with its dtype, shape and raw bytes, read with the safetensors library. File names, sharding,
header layout and the non-tensor files do not enter it.

    python fingerprint.py FOLDER      prints the fingerprint of FOLDER

make_golden.sh records each golden input's fingerprint with it; tests/test_msmodelslim_golden.py checks that
make-tiny still writes those inputs."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch
from safetensors import safe_open


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of `tensor` in memory order (little-endian, as safetensors stores them)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_fingerprint(folder: Path) -> str:
    tensors: dict[str, tuple[Path, str]] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name in tensors:
                    raise ValueError(f"tensor {name!r} is in {tensors[name][0].name} and {path.name}")
                tensors[name] = (path, name)
    h = hashlib.sha256()
    for name in sorted(tensors):
        with safe_open(tensors[name][0], framework="pt") as f:
            t = f.get_tensor(name)
        h.update(f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{list(t.shape)}\0".encode())
        h.update(raw_bytes(t))
    return h.hexdigest()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python fingerprint.py FOLDER")
    print(tensor_fingerprint(Path(sys.argv[1])))
