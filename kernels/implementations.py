"""Which implementation of each operator runs for a device: the one place that decides it.

Three implementations exist for an operator:
- "native": torch-npu's own (CANN) operator - on an Ascend NPU only, where torch-npu has one (NATIVE_ON_NPU);
- "triton": npuport's Triton kernel - on CUDA, and on an NPU through triton-ascend where CANN has no operator;
- "reference": the PyTorch implementation beside the kernel - everywhere, and the ground truth.

A kernel's entry point asks `implementation(op, device)` and runs that, stepping down (native -> triton ->
reference) only where the chosen one cannot take the call (a shape or dtype outside its constraints): `runnable`.
`fall_back(op, reason)` switches an operator to its reference for the rest of the process (the self-test
does this for a kernel that fails to compile or disagrees), with one warning line. `standing_in_for_npu()`
lets CPU tensors take an NPU's choices, with torch-npu's operators replaced by PyTorch implementations of
what their documentation says they compute (kernels/npu/): the NPU path's wiring, checked without an NPU.
Inside `batch_invariant_calls()` only the native operators whose documented results follow no summation order
are taken (ORDER_FREE): a batch-invariant step keeps its guarantee.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import warnings
from collections.abc import Callable, Iterator

import torch

from npuport.devices import is_cpu, is_npu, runs_triton

NATIVE, TRITON, REFERENCE = "native", "triton", "reference"

# Every operator the runtime dispatches, by the name its entry point asks with.
OPERATORS = (
    "rms_norm", "add_rms_norm", "gated_rms_norm", "rms_norm_rope", "rope", "kv_write", "decode_attention",
    "w8a8_quantize", "w8a8_matmul", "invariant_linear", "moe_routing", "moe_experts", "gdn_gating",
    "causal_conv1d", "gdn_recurrent", "gdn_chunk",
)
# The operators CANN has a torch-npu operator for (torch-npu 2.14.0, kernels/npu/); the rest run through
# triton-ascend on an NPU.
NATIVE_ON_NPU = frozenset({
    "rms_norm", "add_rms_norm", "rms_norm_rope", "rope", "decode_attention", "w8a8_quantize", "w8a8_matmul",
    "moe_routing", "moe_experts", "causal_conv1d", "gdn_recurrent", "gdn_chunk",
})
# Operators with no Triton kernel of their own (RoPE alone: on a GPU the fused norm + RoPE kernel covers the model's
# calls): a torch-npu operator on an NPU, else the PyTorch reference.
WITHOUT_TRITON = frozenset({"rope"})
# Native operators whose documented results depend on no order of summation - a row's maximum, exact int32 sums of
# int8 products, elementwise rescales - so that a row's bits cannot depend on the other rows of the call however
# the operator tiles it. The others reduce in floats in an order their tiling may choose by the call's shape, which
# their documentation does not promise to keep per row: batch-invariant calls do not take them.
ORDER_FREE = frozenset({"w8a8_quantize", "w8a8_matmul"})

_fallen_back: dict[str, str] = {}  # op -> why it was switched to its reference, for the rest of the process
_fallen_back_lock = threading.Lock()
_standing_in: contextvars.ContextVar[bool] = contextvars.ContextVar("npuport_standing_in_for_npu", default=False)
_invariant: contextvars.ContextVar[bool] = contextvars.ContextVar("npuport_batch_invariant_calls", default=False)
_native_off: contextvars.ContextVar[bool] = contextvars.ContextVar("npuport_without_native", default=False)


class UnknownOperator(KeyError):
    pass


_KNOWN = frozenset(OPERATORS)


def _known(op: str) -> str:
    if op not in _KNOWN:
        raise UnknownOperator(f"unknown operator {op!r}; the runtime dispatches {', '.join(OPERATORS)}")
    return op


def standing_in() -> bool:
    """Whether CPU tensors take an NPU's choices now (inside standing_in_for_npu)."""
    return _standing_in.get()


def implementation(op: str, device: torch.device) -> str:
    """The implementation of `op` for tensors on `device`: native on an NPU where CANN has the operator,
    triton on a GPU or an NPU, reference on the CPU and for an operator switched by fall_back. Inside
    standing_in_for_npu, CPU tensors get native where an NPU would, else reference (Triton on the CPU is the
    interpreter, tested on its own). Inside batch_invariant_calls, native only for ORDER_FREE operators."""
    if _known(op) in _fallen_back:
        return REFERENCE
    if (op in NATIVE_ON_NPU and (is_npu(device) or (is_cpu(device) and standing_in())) and not _native_off.get()
            and (op in ORDER_FREE or not _invariant.get())):
        return NATIVE
    if runs_triton(device) and op not in WITHOUT_TRITON:
        return TRITON
    return REFERENCE


def runnable(op: str, device: torch.device, native: Callable[[], str | None] | None, triton: bool) -> str:
    """The implementation that runs one call of `op` on `device`: implementation(op, device), stepping down native
    -> triton -> reference past one that cannot take the call. native() names the documented constraint of the
    native operator that the call breaks, or None when the operator takes it (native None: the call has no native
    form, e.g. a batch-invariant step, see the entry point); `triton`: whether the Triton kernel takes it (its own
    conditions, use_triton among them)."""
    chosen = implementation(op, device)
    if chosen == NATIVE and native is not None and native() is None:
        return NATIVE
    if chosen != REFERENCE and triton:
        return TRITON
    return REFERENCE


def fall_back(op: str, reason: str) -> None:
    """Run `op`'s reference from now on in this process; warns once, naming the operator and why."""
    with _fallen_back_lock:
        if _known(op) in _fallen_back:
            return
        _fallen_back[op] = reason
    warnings.warn(f"npuport: {op} switched to its PyTorch reference for this run: {reason}", RuntimeWarning,
                  stacklevel=2)


def fallen_back() -> dict[str, str]:
    """The operators switched to their reference in this process, with why."""
    return dict(_fallen_back)


def choices(device: torch.device) -> dict[str, str]:
    """op -> the implementation it takes on `device` now (what a validation report records)."""
    return {op: implementation(op, device) for op in OPERATORS}


@contextlib.contextmanager
def reset_fall_backs() -> Iterator[None]:
    """Forget the fall-backs made inside the block (tests)."""
    saved = dict(_fallen_back)
    try:
        yield
    finally:
        with _fallen_back_lock:
            _fallen_back.clear()
            _fallen_back.update(saved)


@contextlib.contextmanager
def set_within(var: contextvars.ContextVar, value) -> Iterator[None]:
    """`var` set to `value` inside the block (this thread / task), restored on exit, exceptions included."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def batch_invariant_calls(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """Inside the block (this thread / task; on=False: suspended), calls must keep each row's bits independent of
    the other rows (batch-invariant decoding, runtime/invariance.py): operators outside ORDER_FREE take Triton, not
    their native operator."""
    return set_within(_invariant, on)


def without_native() -> contextlib.AbstractContextManager[None]:
    """Inside the block (this thread / task), no operator takes its native implementation: on an NPU every call runs
    the Triton kernel it steps down to (the triton-ascend lowering check records those launches)."""
    return set_within(_native_off, True)


def standing_in_for_npu() -> contextlib.AbstractContextManager[None]:
    """Inside the block (this thread / task), CPU tensors take the NPU's implementations, torch-npu's operators
    played by their documented stand-ins (kernels/npu/standins.py)."""
    return set_within(_standing_in, True)
