"""One kernel check with its inputs made (Case), what it calls (kernel), and the seeded inputs it draws (Draw)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from npuport.devices import is_cpu
from npuport.runtime.selftest.sizes import (
    BF16,
)
from npuport.runtime.selftest.tolerance import Tolerance

Outputs = tuple[torch.Tensor, ...]


@dataclass
class Case:
    """One check, its inputs made: run() calls the kernel on the device (in-place arguments fresh each call),
    reference() the PyTorch reference on CPU copies; one tolerance per output."""

    op: str  # an implementations.OPERATORS name
    shape: str  # the inputs, as a person reads them
    run: Callable[[], Outputs]
    reference: Callable[[], Outputs]
    tolerances: tuple[Tolerance, ...]


def kernel(module: str, entry: str, device: torch.device, interpreted: Callable | None = None) -> Callable:
    """What a check calls: the entry point `entry` of npuport.kernels.`module` on an accelerator (whatever
    implementation(op, device) picks runs); on the CPU, in Triton's interpreter, `interpreted` or else the
    module's `entry`_triton. Names are looked up at each call."""
    if is_cpu(device) and interpreted is not None:
        return interpreted
    name = f"{entry}_triton" if is_cpu(device) else entry

    def call(*args, **kwargs):
        found: ModuleType = importlib.import_module(f"npuport.kernels.{module}")
        return getattr(found, name)(*args, **kwargs)

    return call


class Draw:
    """Random inputs made on the device (a seeded generator there: the MoE experts are GBs), and CPU copies of them
    for the references."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.gen = torch.Generator(device).manual_seed(seed)

    def normal(self, *shape: int, scale: float = 1.0, dtype: torch.dtype = BF16) -> torch.Tensor:
        return (scale * torch.randn(shape, generator=self.gen, device=self.device)).to(dtype)

    def uniform(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return scale * torch.rand(shape, generator=self.gen, device=self.device)

    def int8(self, *shape: int) -> torch.Tensor:
        return torch.randint(-128, 128, shape, generator=self.gen, device=self.device, dtype=torch.int8)

    def positions(self, requests: int, tokens: int, capacity: int) -> torch.Tensor:
        """start [requests] int64: the first at 0, the last at the cache's end, the rest anywhere between."""
        start = torch.randint(0, capacity - tokens + 1, (requests,), generator=self.gen, device=self.device)
        start[0] = 0
        start[-1] = capacity - tokens
        return start


def cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    """A CPU copy (never the same tensor: references write in place)."""
    if t is None:
        return None
    host = t.detach().cpu()
    return host.clone() if host.data_ptr() == t.data_ptr() else host


def _fmt(name: str, t: torch.Tensor) -> str:
    return f"{name} [{', '.join(map(str, t.shape))}] {str(t.dtype).removeprefix('torch.')}"


def shapes(**tensors: torch.Tensor) -> str:
    """'x [16, 2048] bfloat16, w [2048] bfloat16'."""
    return ", ".join(_fmt(name, t) for name, t in tensors.items())
