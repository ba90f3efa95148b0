"""Timing for `npuport selftest`: wall-clock milliseconds of device work, the device waited for on both sides."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from npuport.devices import is_cpu


def wait_for(device: torch.device) -> None:
    """Return once the work queued on `device` has run (torch.accelerator: CUDA, NPU and the rest alike); the CPU
    runs synchronously."""
    if not is_cpu(device):
        torch.accelerator.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, calls: int) -> float:
    """The median of `calls` timed calls of fn(), in milliseconds (the caller has warmed fn up: compiled, tuned)."""
    times = []
    for _ in range(calls):
        wait_for(device)
        start = time.perf_counter()
        fn()
        wait_for(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3
