"""Which module's npu_* operators the native wrappers call (and a recorder of the calls), and the dtype rule they
hold calls to."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import torch

from npuport.devices import native_operators
from npuport.kernels.implementations import set_within, standing_in
from npuport.kernels.npu import standins

BF16_FP16 = frozenset({torch.bfloat16, torch.float16})
FLOATS = frozenset({torch.bfloat16, torch.float16, torch.float32})
BF16 = frozenset({torch.bfloat16})


@dataclass(frozen=True)
class OperatorCall:
    """One call of an npu_* operator, as a wrapper made it."""

    name: str
    args: tuple
    kwargs: dict


class _Recorder:
    """`module`'s npu_* operators, each call appended to `calls` before it runs."""

    def __init__(self, module: ModuleType, calls: list[OperatorCall]) -> None:
        self._module, self._calls = module, calls

    def __getattr__(self, name: str):
        operator = getattr(self._module, name)

        def record(*args, **kwargs):
            self._calls.append(OperatorCall(name, args, kwargs))
            return operator(*args, **kwargs)

        return record


_recording: contextvars.ContextVar[list[OperatorCall] | None] = contextvars.ContextVar("npuport_operator_calls",
                                                                                      default=None)


def npu_operators() -> ModuleType:
    """torch-npu's module on an Ascend NPU; inside standing_in_for_npu() the stand-ins of kernels/npu/standins.py,
    which compute what its documentation says its operators compute (inside recording_calls(), through a recorder)."""
    module = standins if standing_in() else native_operators()
    calls = _recording.get()
    return module if calls is None else _Recorder(module, calls)


@contextlib.contextmanager
def recording_calls() -> Iterator[list[OperatorCall]]:
    """Inside the block (this thread / task), every operator call the wrappers make is appended to the yielded list
    (the prototype test binds each to torch-npu's documented signature)."""
    calls: list[OperatorCall] = []
    with set_within(_recording, calls):
        yield calls


# What the stand-ins take beyond the documentation: float32 and float64 models check the NPU path's wiring at their
# own precision (float64 where int8 roundings would turn float32's last-bit differences into different tokens).
STANDING_IN_EXTRA = frozenset({torch.float32, torch.float64})


def documented_dtype(dtype: torch.dtype, documented: frozenset[torch.dtype]) -> bool:
    """Whether an operator takes `dtype` where its documentation lists `documented`. Standing in for an NPU,
    float32 and float64 are taken too (the stand-ins compute at their precision); an NPU steps down from a dtype its
    documentation does not list."""
    return dtype in documented or (standing_in() and dtype in STANDING_IN_EXTRA)


def first_refusal(*checks: tuple[bool, str]) -> str | None:
    """The reason of the first (holds, reason) check that does not hold, or None when all hold."""
    return next((reason for holds, reason in checks if not holds), None)
