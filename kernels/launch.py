"""Where the Triton kernels meet devices: whether a tensor takes the Triton path, the grid of a persistent
kernel, the per-backend launch options, the GPU-only intrinsics (dependent launch, L2 prefetch), and Triton's
interpreter for kernels launched on CPU tensors.

The runtime calls the references on CPU and the Triton kernels on CUDA and Ascend NPUs (triton-ascend).
Tests launch the Triton kernels on CPU tensors, which run them through Triton's interpreter - the same as
`TRITON_INTERPRET=1` - whatever the order in which test modules imported triton.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator

import torch

from npuport.devices import is_cpu, is_gpu, is_npu, npu_core_count, runs_triton, supports_dependent_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references cover everything
    triton = None
    tl = None
try:  # CUDA's grid dependency control; absent from Triton builds without it (kernels then never ask for it)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

# CUDA caps the first grid dimension far higher, triton-ascend at 65535: one limit for both.
MAX_GRID = 65535


def jit(fn):
    """triton.jit, or the plain function where triton is not installed (it is then never launched)."""
    return triton.jit(fn) if triton is not None else fn


def use_triton(*tensors: torch.Tensor) -> bool:
    """True where the Triton kernels run for these tensors: a GPU or an NPU, not float64 (the references are
    the float64 ground truth, and Ascend has no fp64), and not while autograd records through them (training:
    the kernels have no backward, the references do)."""
    if triton is None or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return False
    return all(runs_triton(t.device) and t.dtype != torch.float64 for t in tensors)


def persistent_grid(device: torch.device, n_tasks: int, kind: str = "vector") -> tuple[int]:
    """Grid of a kernel that loops `for task in range(pid, n_tasks, num_programs)`: on an NPU one program
    per core of `kind` ("cube" for tl.dot work, "vector" otherwise); on a GPU and in the interpreter one
    program per task (they are cheap to schedule), capped at MAX_GRID."""
    n_tasks = max(1, n_tasks)
    if is_npu(device):
        return (min(n_tasks, npu_core_count(device, kind)),)
    return (min(n_tasks, MAX_GRID),)


def launch_options(device: torch.device, num_warps: int, num_stages: int = 2, npu: dict | None = None,
                   dependent: bool = False, contract: bool = True) -> dict:
    """Backend-specific launch options, the only place they are chosen: num_warps / num_stages on a GPU (and
    with `dependent`, a programmatic dependent launch: see dependent_launch; with contract=False, no multiply and
    add fused into an fma by the compiler - each rounds on its own, tl.fma still fuses - for kernels whose bits
    must not follow how the compiler treats each specialisation; stated either way, since Triton 3.10 turns
    its default off), the given triton-ascend options (e.g.
    multibuffer) on an NPU, none for the interpreter."""
    if is_gpu(device):
        return ({"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": contract}
                | ({"launch_pdl": True} if dependent else {}))
    if is_npu(device):
        return dict(npu or {})
    return {}


def stages_within(budget_bytes: int, num_stages: int, stage_bytes: int) -> int:
    """num_stages, or fewer, so that the tiles Triton's software pipelining keeps in shared memory fit
    budget_bytes: (stages - 1) x stage_bytes on NVIDIA GPUs, the figure its compiler reports. At least 1."""
    return max(1, min(num_stages, budget_bytes // stage_bytes + 1))


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on `device` can overlap the kernel before them in the stream: launched with
    launch_options(..., dependent=True), a kernel starts while its predecessor still runs (once every program
    of the predecessor called start_dependent_kernel, or ended), does work that needs none of its results, and
    then calls wait_for_previous_kernel, which returns once the predecessor has finished and its writes are
    visible. A Hopper or newer NVIDIA GPU and a Triton that exposes it; never on an NPU or in the interpreter."""
    return gdc_wait is not None and supports_dependent_launch(device)


@jit
def start_dependent_kernel():
    """GPU only: let the next kernel, if launched as dependent, start now (see dependent_launch)."""
    gdc_launch_dependents()


@jit
def wait_for_previous_kernel():
    """GPU only: wait until the kernel before this one has finished and its writes are visible (a no-op when
    this kernel was not launched as dependent)."""
    gdc_wait()


# Bytes of one L2 line on NVIDIA GPUs: what one prefetch_to_l2 address brings in (a constexpr, for kernels).
L2_LINE_BYTES = tl.constexpr(128) if tl is not None else 128


@jit
def prefetch_to_l2(ptrs):
    """GPU only (PTX): ask the L2 cache to fetch the lines holding the addresses ptrs (any shape); nothing is
    loaded into registers and nothing waits for it."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@functools.cache
def _interpreted(fn):
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


@contextlib.contextmanager
def _interpreter_fixes() -> Iterator[None]:
    """While a kernel runs in Triton's interpreter, make it behave as on a GPU: let it call @triton.jit
    functions (its own helpers and triton.language's, such as tl.cdiv) that were compiled for a GPU at import
    time; give tl.dot on bf16 tiles real bf16 values (the interpreter keeps bf16 as raw uint16 bits and
    would multiply those); round fp32 -> bf16 to nearest even, as GPUs do (the interpreter truncates)."""
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
    from triton.runtime.jit import JITFunction

    call, dot, cast = JITFunction.__call__, InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl

    def create_dot(self, a, b, d, *rest):
        if a.dtype.scalar == tl.bfloat16:
            a, b = self.cast_impl(a, tl.float32), self.cast_impl(b, tl.float32)
        return dot(self, a, b, d, *rest)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(src.data.copy()).to(torch.bfloat16).view(torch.int16).numpy()
            return TensorHandle(rounded.view("uint16"), dst_type.scalar)
        return cast(self, src, dst_type)

    JITFunction.__call__ = lambda self, *args, **kwargs: _interpreted(self.fn)(*args, **kwargs)
    InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl = create_dot, cast_impl
    language = _language_snapshot()
    try:
        yield
    finally:
        JITFunction.__call__, InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl = call, dot, cast
        _restore_language(language)


def _language_namespaces() -> list[object]:
    """The modules and classes of triton.language that the interpreter rebinds to its own semantics while a
    kernel runs."""
    return [ns for ns in (tl, tl.core, tl.math, tl.core.tensor, getattr(tl.core, "tensor_descriptor_base", None))
            if ns is not None]


def _language_snapshot() -> list[tuple[object, dict]]:
    return [(ns, dict(vars(ns))) for ns in _language_namespaces()]


def _restore_language(snapshot: list[tuple[object, dict]]) -> None:
    """Put triton.language back as it was before an interpreted launch. The interpreter restores what it rebinds
    for the kernel itself, but Triton 3.9 also rebinds it for each @jit helper the kernel calls and never
    restores that: afterwards triton.compile in the same process generates code through the interpreter's
    semantics and fails ("'block_argument' object has no attribute 'dtype'")."""
    for ns, saved in snapshot:
        now = vars(ns)
        for name in [name for name in now if name not in saved and not inspect.ismodule(now[name])]:
            delattr(ns, name)
        for name, value in saved.items():
            if now.get(name) is not value:
                setattr(ns, name, value)


# Called as observer(kernel, args, kwargs) before every launch, as the launcher made it; a launch that one answers
# False for is not run (kernels/ascend_lowering.py records launches this way, at widths too large to interpret).
launch_observers: list = []


def launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), through Triton's interpreter when the tensors are on the CPU."""
    if launch_observers and not all([observe(kernel, args, kwargs) for observe in launch_observers]):
        return
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    if not is_cpu(device):
        kernel[grid](*args, **kwargs)
        return
    from triton.runtime.interpreter import InterpretedFunction

    # Already interpreted when TRITON_INTERPRET=1 was set before triton was imported.
    runner = kernel if isinstance(kernel, InterpretedFunction) else _interpreted(kernel.fn)
    with _interpreter_fixes():
        runner[grid](*args, **kwargs)


def unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dim is contiguous (the only stride the kernels need to be 1), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
