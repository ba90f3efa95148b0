"""Every Triton kernel through triton-ascend's compiler, without an NPU: the launches the launchers make, recorded as
they would make them on an Ascend NPU (launched_as_on_npu, recording_launches), then compiled for an Ascend 910B in a
Python whose Triton is triton-ascend (`python kernels/ascend_lowering.py ROOT LAUNCHES RESULTS`) - its TTIR passes and
triton-adapter-opt (TTIR -> linalg / HIVM) for real, up to the binary stage, which needs CANN - and each launch's
on-chip footprint against the 910B's buffers (npu_footprint).

Runs in both environments: only the standard library at import, npuport's modules (and torch) imported where used,
so that triton-ascend's Python can run this file from the source tree, where npuport is not installed."""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import json
import multiprocessing
import os
import pkgutil
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

# What triton.compile raises where the adapter's output goes to bishengir-compile, CANN's, which is absent: a
# launch that gets there has lowered.
BINARY_STAGE = "ConvertLinalgRToBinary"
CANN_ABSENT = "ASCEND_HOME_PATH is not set"

# On-chip buffers of one Atlas A2 (910B) AI core, in bytes: catlass include/catlass/arch/arch.hpp (struct AtlasA2:
# UB 192 KiB, L1 512 KiB, L0A / L0B 64 KiB, L0C 128 KiB) and triton-ascend's programming guide ("A2系列产品UB大小为
# 192KB(1572864bit)", docs/zh/programming_guide/index.md). The unified buffer is the vector core's, the rest the
# cube core's (tl.dot). With multibuffer on (triton-ascend's default) each buffer a loop fills is planned twice
# (triton-ascend issue 302: "requires 3072000 bits while 1572864 bits available" = 2 x 48000 fp32).
UB_BYTES = 192 * 1024
L1_BYTES = 512 * 1024
L0A_BYTES = L0B_BYTES = 64 * 1024
L0C_BYTES = 128 * 1024

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1, "int32": 4, "int64": 8, "bool": 1}


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the compiler specialises on it: the kernel (module and name); args, each runtime
    parameter's value - a tensor as {"dtype", "aligned" (its address a multiple of 16)}, numbers and flags as given,
    None; the constexprs; the backend options the launcher passed."""

    module: str
    kernel: str
    args: dict
    constexprs: dict
    options: dict

    def element_bytes(self, name: str) -> int:
        """Bytes per element of tensor argument `name` (0 when it was None)."""
        spec = self.args.get(name)
        return DTYPE_BYTES[spec["dtype"]] if isinstance(spec, dict) else 0

    @property
    def multibuffer(self) -> bool:
        return self.options.get("multibuffer", True)

    def describe(self) -> str:
        tensors = ", ".join(f"{name} {spec['dtype']}" for name, spec in self.args.items() if isinstance(spec, dict))
        constexprs = ", ".join(f"{name}={value}" for name, value in self.constexprs.items())
        options = "".join(f", {name}={value}" for name, value in self.options.items())
        return f"{self.kernel}[{constexprs}{options}] ({tensors})"


def _argument_spec(value: object) -> object:
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        return {"dtype": str(value.dtype).removeprefix("torch."), "aligned": value.data_ptr() % 16 == 0}
    if value is None or isinstance(value, bool | int | float):
        return value
    raise TypeError(f"cannot record a kernel argument of type {type(value).__name__}")


def describe_launch(kernel, args: tuple, kwargs: dict) -> Launch:
    """The Launch of kernel[grid](*args, **kwargs) (a Triton JITFunction)."""
    params = {p.name: p for p in kernel.params}
    bound = dict(zip(params, args, strict=False)) | {k: v for k, v in kwargs.items() if k in params}
    values = {name: bound[name] for name in params if name in bound}
    return Launch(module=kernel.fn.__module__, kernel=kernel.fn.__name__,
                  args={k: _argument_spec(v) for k, v in values.items() if not params[k].is_constexpr},
                  constexprs={k: v for k, v in values.items() if params[k].is_constexpr},
                  options={k: v for k, v in kwargs.items() if k not in params})


def kernel_modules() -> list[str]:
    """Every module of npuport.kernels, imported."""
    import npuport.kernels as package

    names = [m.name for m in pkgutil.walk_packages(package.__path__, "npuport.kernels.")]
    for name in names:
        importlib.import_module(name)
    return names


def launched_kernels() -> set[tuple[str, str]]:
    """(module, kernel) of every kernel that npuport.kernels launches: the first argument of each launch(...) call in
    its sources."""
    found = set()
    for name in kernel_modules():
        tree = ast.parse(Path(sys.modules[name].__file__).read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "launch"
                    and node.args and isinstance(node.args[0], ast.Name)):
                found.add((name, node.args[0].id))
    return found


@contextlib.contextmanager
def launched_as_on_npu() -> Iterator[None]:
    """Let the launchers of npuport.kernels take CPU tensors for an Ascend NPU's: is_npu true, is_gpu false, the
    Triton path taken - so that they pick the tiles, options and grids an NPU launch gets."""
    from npuport import devices
    from npuport.kernels.implementations import without_native  # CANN's operators step down to these kernels

    answers = {id(devices.is_npu): lambda device: True, id(devices.is_gpu): lambda device: False,
               id(devices.runs_triton): lambda device: True}
    replaced = []
    for name in kernel_modules():
        module = sys.modules[name]
        for attr, value in list(vars(module).items()):
            if id(value) in answers:
                replaced.append((module, attr, value))
                setattr(module, attr, answers[id(value)])
    try:
        with without_native():
            yield
    finally:
        for module, attr, value in replaced:
            setattr(module, attr, value)


@contextlib.contextmanager
def recording_launches(run: bool = False) -> Iterator[list[Launch]]:
    """Collect a Launch for every kernel launch while active; run=False: the kernels themselves do not run (the
    launchers still allocate their outputs), so that real widths can be recorded without interpreting them."""
    from npuport.kernels import launch as launch_module

    records: list[Launch] = []

    def observe(kernel, args, kwargs) -> bool:
        records.append(describe_launch(kernel, args, kwargs))
        return run

    launch_module.launch_observers.append(observe)
    try:
        yield records
    finally:
        launch_module.launch_observers.remove(observe)


# ---------------------------------------------------------------------------------------------------------------
# On-chip footprint per program, from a launch's tiles: what it loads from global memory (planned twice with
# multibuffer) and what it computes on chip (accumulators, fp32 products and intermediates), in the vector core's
# unified buffer; for tl.dot, the operand tiles (L0A, L0B, both staged in L1) and the accumulator (L0C) of the cube
# core. Estimates in the terms of the kernels' "NPU budget" comments: only CANN's bishengir-compile, the binary stage,
# knows the real figure (it prints "UB size = N bits" with ENABLE_PRINT_UB_BITS=1, triton-ascend's required_ub_bits).


@dataclass(frozen=True)
class Footprint:
    """What one program holds on chip at once, in bytes."""

    loaded: int  # bytes of tiles loaded from global memory, live at once
    working: int  # bytes of accumulators and intermediate tiles
    dot_a: int = 0  # the largest left operand of a tl.dot
    dot_b: int = 0  # the largest right operand
    dot_acc: int = 0  # its accumulator (or the sum of those live at once)

    def unified_buffer(self, multibuffer: bool) -> int:
        """The unified buffer it needs: with multibuffer, each loaded tile twice (the next one lands while this one
        is used)."""
        return self.loaded * (2 if multibuffer else 1) + self.working

    def overflows(self, multibuffer: bool) -> list[str]:
        """The buffers this footprint does not fit, as 'name needs / has' lines."""
        staged = (self.dot_a + self.dot_b) * (2 if multibuffer else 1)
        needs = {"UB": (self.unified_buffer(multibuffer), UB_BYTES), "L1": (staged, L1_BYTES),
                 "L0A": (self.dot_a, L0A_BYTES), "L0B": (self.dot_b, L0B_BYTES), "L0C": (self.dot_acc, L0C_BYTES)}
        return [f"{name} {need} > {have} bytes" for name, (need, have) in needs.items() if need > have]


def _rms_norm(launch: Launch, c: dict) -> Footprint:
    row = c["BN"]
    loaded = row * (launch.element_bytes("x") + launch.element_bytes("w") + launch.element_bytes("res"))
    return Footprint(loaded, 3 * row * 4)  # the scale, the fp32 row, its normalised value


def _gated_rms_norm(launch: Launch, c: dict) -> Footprint:
    block, x = c["BLOCK"], launch.element_bytes("x")
    loaded = block * (x + launch.element_bytes("w") + launch.element_bytes("gate")) + 32 * 4  # + a [4, 8] sum step
    return Footprint(loaded, 4 * block * 4 + 4 * 32 * 4)  # normed, product, gate, silu; the [4, 8] accumulators


def _gdn_gating(launch: Launch, c: dict) -> Footprint:
    tile = c["BLOCK_ROWS"] * c["BLOCK_HV"]
    loaded = tile * (launch.element_bytes("a") + launch.element_bytes("b")) + 2 * c["BLOCK_HV"] * 4
    return Footprint(loaded, 4 * tile * 4)  # the two fp32 inputs and the two outputs


def _rms_norm_rope(launch: Launch, c: dict) -> Footprint:
    d, x = c["BD"], launch.element_bytes("x")
    loaded = d * (2 * x + 2 * launch.element_bytes("w") + launch.element_bytes("cos") + launch.element_bytes("sin"))
    return Footprint(loaded + 32 * x, 8 * d * 4 + 4 * 32 * 4)  # scales, y, partner, cos, sin, rotated, roped


def _write_kv(launch: Launch, c: dict) -> Footprint:
    d = c["BD"]
    loaded = d * (launch.element_bytes("k") + launch.element_bytes("v"))
    return Footprint(loaded, 2 * d * launch.element_bytes("cache_k"))


def _conv_tap(launch: Launch, rows: int, d: int) -> int:
    """One tap's loads: its weights [d] and the window and x parts of the joined inputs [rows, d]."""
    return d * launch.element_bytes("weight") + rows * d * (launch.element_bytes("window") + launch.element_bytes("x"))


def _conv_prefill(launch: Launch, c: dict) -> Footprint:
    rows, d = c["BLOCK_T"], c["BLOCK_D"]
    return Footprint(_conv_tap(launch, rows, d), 2 * rows * d * 4)  # the joined tile and the accumulator


def _window_shift(launch: Launch, c: dict) -> Footprint:
    rows, d = c["BLOCK_L"], c["BLOCK_D"]
    return Footprint(rows * d * (launch.element_bytes("window") + launch.element_bytes("x")), rows * d * 4)


def _conv_update(launch: Launch, c: dict) -> Footprint:
    t, length, d = c["BLOCK_T"], c["BLOCK_L"], c["BLOCK_D"]
    kept = length * d * (launch.element_bytes("window") + launch.element_bytes("x"))
    return Footprint(_conv_tap(launch, t, d) + kept, (2 * t + length) * d * 4)


def _split(launch: Launch, c: dict) -> Footprint:
    rows, d, keys = c["BM"], c["BD"], c["BLOCK_N"]
    kv = launch.element_bytes("k")
    loaded = rows * d * launch.element_bytes("q") + 2 * keys * d * kv
    working = 2 * rows * keys * 4 + rows * d * 4  # scores, weights, the accumulator
    return Footprint(loaded, working, dot_a=max(rows * d * launch.element_bytes("q"), rows * keys * kv),
                     dot_b=keys * d * kv, dot_acc=rows * max(keys, d) * 4)


def _combine(launch: Launch, c: dict) -> Footprint:
    tile = c["BG"] * c["BD"]
    loaded = 2 * tile * 4 + tile * launch.element_bytes("gate") + 4 * c["BG"] * 4
    return Footprint(loaded, 2 * tile * 4)  # the running accumulator and the output


def _invariant_linear(launch: Launch, c: dict) -> Footprint:
    a, b = c["BM"] * c["BK"] * launch.element_bytes("x"), c["BN"] * c["BK"] * launch.element_bytes("w")
    acc = c["BM"] * c["BN"] * 4
    return Footprint(a + b, acc + c["BM"] * c["BN"] * launch.element_bytes("y"), dot_a=a, dot_b=b, dot_acc=acc)


def _route(launch: Launch, c: dict) -> Footprint:
    return Footprint(c["BE"] * launch.element_bytes("logits"), 3 * c["BE"] * 4)  # the row, its probabilities, masks


def _matvec(launch: Launch, rows: int, k: int, weights: int, token: str) -> Footprint:
    """The matvec kernels: `weights` weight tiles [rows, k] (the widest of the routed and shared experts' dtype) and
    their fp32 / int32 products, the token's row slice [k] (a float row into int8 experts is quantized in the kernel:
    its int32 values and the amax)."""
    w = max(launch.element_bytes("w"), launch.element_bytes("shared_w"))
    loaded = weights * rows * k * w + k * launch.element_bytes(token)
    quantize = launch.element_bytes("w") == 1 and launch.element_bytes(token) > 1
    return Footprint(loaded, weights * rows * k * 4 + (2 * k * 4 if quantize else 0) + 2 * weights * rows * 4)


def _matvec_gate_up(launch: Launch, c: dict) -> Footprint:
    return _matvec(launch, c["BN"], c["BK"], 2, "a")


def _matvec_down(launch: Launch, c: dict) -> Footprint:
    return _matvec(launch, c["BN"], c["BK"], 1, "h")


def _grouped_gemm(launch: Launch, c: dict) -> Footprint:
    halves = 2 if c["GATED"] else 1
    a = c["BLOCK"] * c["BK"] * launch.element_bytes("a")
    acc = halves * c["BLOCK"] * c["BN"] * 4
    if c.get("INT4"):  # a byte tile [BK, BN/2] a half, unpacked through int32 into two int8 tiles (the dot's)
        b = c["BK"] * c["BN"] // 2
        unpacking = 2 * b * 4 + 2 * b
        return Footprint(a + halves * b, 2 * acc + unpacking, dot_a=a, dot_b=b, dot_acc=acc)
    b = c["BK"] * c["BN"] * launch.element_bytes("w")
    return Footprint(a + halves * b, 2 * acc, dot_a=a, dot_b=b, dot_acc=acc)  # the epilogue's fp32 copies


def _chunk_prepare(launch: Launch, c: dict) -> Footprint:
    bt, bk, bv, kv = c["BT"], c["BK"], c["BV"], launch.element_bytes("k")
    loaded = 2 * bt * bk * kv + 4 * 16 * bk * kv + 16 * bv * launch.element_bytes("v")
    converted = 0 if kv == 4 else 2 * bt * bk * 4  # q, k in fp32
    working = converted + bt * bt * 4 + 10 * 16 * 16 * 4  # P, the inverse's blocks
    return Footprint(loaded, working, dot_a=bt * bk * kv, dot_b=bt * bk * kv, dot_acc=bt * bt * 4)


def _chunk_state(launch: Launch, c: dict) -> Footprint:
    bt, bk, bv, qk = c["BT"], c["BK"], c["BV"], launch.element_bytes("q")
    loaded = 3 * bt * bk * qk + bt * bv * launch.element_bytes("u") + bt * bt * launch.element_bytes("p")
    narrowed = 0 if qk == 4 else bk * bv * qk  # S in the inputs' dtype, for tl.dot
    working = bk * bv * 4 + narrowed + 2 * bt * bv * 4  # S, v_new and o
    return Footprint(loaded, working, dot_a=max(bt * bk, bt * bt) * qk, dot_b=bk * bv * qk, dot_acc=bk * bv * 4)


def _recurrent(launch: Launch, c: dict) -> Footprint:
    state = c["BK"] * c["BV"] * 4
    return Footprint(state + 2 * (2 * c["BK"] + c["BV"]) * 4, 2 * state)  # S, two products; q, k, v now and next


def _quantize(launch: Launch, c: dict) -> Footprint:
    return Footprint(c["BLOCK_K"] * launch.element_bytes("x"), 3 * c["BLOCK_K"] * 4)


def _w8a8_gemm(launch: Launch, c: dict) -> Footprint:
    a, b, acc = c["BM"] * c["BK"], c["BK"] * c["BN"], c["BM"] * c["BN"] * 4
    return Footprint(a + b, 2 * acc, dot_a=a, dot_b=b, dot_acc=acc)  # the int32 sums and their fp32 rescale


def _split_sum(launch: Launch, c: dict) -> Footprint:
    tile = c["BM"] * c["BN"] * 4
    return Footprint(tile, 2 * tile)


FOOTPRINTS = {
    "_rms_norm_kernel": _rms_norm, "_gated_rms_norm_kernel": _gated_rms_norm, "_gdn_gating_kernel": _gdn_gating,
    "_rms_norm_rope_kernel": _rms_norm_rope, "_write_kv_kernel": _write_kv, "_conv_prefill_kernel": _conv_prefill,
    "_window_shift_kernel": _window_shift, "_conv_update_kernel": _conv_update, "_split_kernel": _split,
    "_combine_kernel": _combine, "_invariant_linear_kernel": _invariant_linear, "_route_kernel": _route,
    "_matvec_gate_up_kernel": _matvec_gate_up, "_matvec_down_kernel": _matvec_down,
    "_grouped_gemm_kernel": _grouped_gemm,
    "_chunk_prepare_kernel": _chunk_prepare, "_chunk_state_kernel": _chunk_state, "_recurrent_kernel": _recurrent,
    "_quantize_kernel": _quantize, "_w8a8_gemm_kernel": _w8a8_gemm, "_w8a8_split_sum_kernel": _split_sum,
}


def npu_footprint(launch: Launch) -> Footprint:
    """The on-chip footprint of one program of `launch` (KeyError for a kernel FOOTPRINTS does not know)."""
    return FOOTPRINTS[launch.kernel](launch, launch.constexprs)


# ---------------------------------------------------------------------------------------------------------------
# The compile, in triton-ascend's environment.


# triton-adapter-opt 3.2.0 segfaults now and then on a kernel it lowers on the next try (one run in 50 of the same
# input, at random): a crash is retried this many times in all; a kernel it cannot lower crashes every time.
ATTEMPTS = 4


@dataclass(frozen=True)
class Lowering:
    """What triton-ascend's compiler made of one launch (the first of those it would compile alike): lowered (it
    reached the binary stage), else the stage that failed and the adapter's message; crashes: the adapter's
    crashes on the way (retried, ATTEMPTS in all)."""

    launch: Launch
    lowered: bool
    stage: str
    message: str
    crashes: int = 0


class _Tensor:
    """A launch's tensor argument as the JIT looks at one: its dtype and its address's alignment."""

    def __init__(self, dtype: str, aligned: bool) -> None:
        import torch

        self.dtype = getattr(torch, dtype)
        self._address = 0 if aligned else 8

    def data_ptr(self) -> int:
        return self._address


def _value(spec: object) -> object:
    return _Tensor(spec["dtype"], spec["aligned"]) if isinstance(spec, dict) else spec


CRASH_REPORT = "PLEASE submit a bug report"


def _compile_error_message(error: Exception) -> tuple[str, str]:
    """(stage, message) of a failed compile: what the stage said, without triton-ascend's frame around it, the
    cache location and a crash's stack dump."""
    stage = getattr(error, "stage_name", None) or type(error).__name__
    lines = [line.strip() for line in str(error).splitlines()]
    said = [line for line in lines
            if line and not line.startswith(("///", "[INFO]")) and "encounters error:" not in line]
    if CRASH_REPORT in str(error):
        said = said[: next(i for i, line in enumerate(said) if line.startswith(CRASH_REPORT))]
        said.append("triton-adapter-opt crashed (stack dump left out)")
    return stage, "\n".join(said[:8])


class _Specialised:
    """A launch as triton-ascend's JIT specialises it (JITFunction.run, up to the compile): its cache key, and what
    triton.compile takes."""

    def __init__(self, launch: Launch) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend

        from npuport.devices import ASCEND_910B_TRITON_TARGET

        self.launch, self.target = launch, GPUTarget(*ASCEND_910B_TRITON_TARGET)
        backend = make_backend(self.target)
        kernel = getattr(importlib.import_module(launch.module), launch.kernel)
        kwargs = {name: _value(spec) for name, spec in launch.args.items()} | launch.constexprs | launch.options
        kwargs["debug"] = False
        if kernel.binder is None:
            kernel.create_binder(backend)
        bound_args, sig_and_spec, constexpr_vals, _, excess_kwargs = kernel.binder(**kwargs)
        self.key = (launch.module, launch.kernel, "".join(sig_and_spec) + str((constexpr_vals, excess_kwargs)))
        self.options = backend.parse_options(kwargs)
        self.unknown_options = [k for k in excess_kwargs if k not in self.options.__dict__]
        values = tuple(bound_args.values())
        names = [kernel.params[i].name for i in kernel.non_constexpr_indices]
        signature = {k: "*i8" if v == "none" else v for k, v in zip(names, sig_and_spec[: len(names)], strict=True)}
        attrs = backend.get_attrs_descriptor(kernel.params, values)
        constant = attrs.get_constants()
        constants = {p.name: v for v, p in zip(values, kernel.params, strict=True)
                     if p.is_constexpr or p.num in constant or v is None}
        self.source = ASTSource(kernel, signature, constants, attrs)

    def lower(self) -> Lowering:
        """Compile for the 910B; the binary stage failing for want of CANN counts as lowered, a crash is retried."""
        import triton

        if self.unknown_options:
            unknown = ", ".join(self.unknown_options)
            return Lowering(self.launch, False, "options", f"options triton-ascend does not know: {unknown}")
        for attempt in range(1, ATTEMPTS + 1):
            try:
                triton.compile(self.source, target=self.target, options=self.options.__dict__)
                return Lowering(self.launch, False, "npubin", "compiled to a binary: CANN was expected to be absent")
            except Exception as error:  # noqa: BLE001 - every failure is reported, one line per launch
                stage, message = _compile_error_message(error)
                if stage == BINARY_STAGE and CANN_ABSENT in message:
                    return Lowering(self.launch, True, stage, message, attempt - 1)
                crashed = CRASH_REPORT in str(error)
                if not crashed or attempt == ATTEMPTS:
                    return Lowering(self.launch, False, stage, message, attempt if crashed else attempt - 1)
        raise AssertionError("unreachable")


def _lower(launch: Launch) -> Lowering:
    return _Specialised(launch).lower()


def lower_for_ascend(launches: list[Launch], workers: int = 1) -> list[Lowering]:
    """Compile each distinct launch (as triton-ascend's JIT tells them apart: its cache key) for the 910B, as
    JITFunction.run does before it launches, in `workers` processes."""
    distinct: dict[tuple, Launch] = {}
    for launch in launches:
        distinct.setdefault(_Specialised(launch).key, launch)
    if workers <= 1:
        return [_lower(launch) for launch in distinct.values()]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_lower, distinct.values()))


def _import_source_tree(root: Path) -> None:
    """Make `npuport` and `npuport.kernels` importable from the source tree at root (pyproject's package-dir)."""
    for name, init in (("npuport", root / "npuport"), ("npuport.kernels", root / "kernels")):
        spec = importlib.util.spec_from_file_location(name, init / "__init__.py",
                                                      submodule_search_locations=[str(init)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


def main(argv: list[str]) -> int:
    """ROOT LAUNCHES RESULTS: compile the launches of the JSON file LAUNCHES (a list of Launch fields) with the kernels
    of the source tree at ROOT, one process per CPU (up to 4); write the Lowering of each distinct one to RESULTS."""
    root, launches_path, results_path = (Path(a) for a in argv)
    _import_source_tree(root)
    launches = [Launch(**fields) for fields in json.loads(launches_path.read_text())]
    lowerings = lower_for_ascend(launches, workers=min(4, len(os.sched_getaffinity(0))))
    results_path.write_text(json.dumps([asdict(lowering) for lowering in lowerings]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
