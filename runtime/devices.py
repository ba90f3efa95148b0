"""The one place that knows device names: Ascend NPU (if torch_npu imports), CUDA, or CPU."""

from __future__ import annotations

import importlib

import torch

from npuport.errors import NpuportError

DEVICE_KINDS = ("npu", "cuda", "cpu")


def npu_available() -> bool:
    try:
        importlib.import_module("torch_npu")  # registers torch.npu
    except ImportError:
        return False
    return bool(torch.npu.is_available())


def _available(kind: str) -> bool:
    if kind == "npu":
        return npu_available()
    if kind == "cuda":
        return torch.cuda.is_available()
    return True


def device_kind(kind: str | None = None) -> str:
    """`kind` if given (and present), else the first present of npu, cuda, cpu."""
    if kind is None:
        return next(k for k in DEVICE_KINDS if _available(k))
    if kind not in DEVICE_KINDS:
        raise NpuportError(f"unknown device {kind!r}; choose one of {', '.join(DEVICE_KINDS)}")
    if not _available(kind):
        raise NpuportError(f"device {kind!r} was asked for but is not available on this machine")
    return kind


def pick_device(kind: str | None = None) -> torch.device:
    """The torch device of device_kind(kind)."""
    return torch.device(device_kind(kind))
