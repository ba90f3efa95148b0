"""The one place that knows device names: Ascend NPU (if torch_npu imports), CUDA, or CPU."""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import threading
import weakref
from dataclasses import dataclass, field
from types import ModuleType

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


def default_dtype(kind: str | None = None) -> str:
    """The float dtype the runtime runs in when none is asked for (serve, validate, generate): float32 on a CPU,
    where bfloat16 arithmetic is emulated and about 10x slower; bfloat16 on an NPU or a GPU."""
    return "float32" if device_kind(kind) == "cpu" else "bfloat16"


# What the kernels and the generation loop ask of a device. Everything that names a device kind is here.

# Ascend AI cores when the driver cannot say (Atlas A2: 24 cube cores, 48 vector cores).
NPU_CORES_FALLBACK = {"cube": 24, "vector": 48}
H200_MULTIPROCESSORS = 132


def is_cpu(device: torch.device) -> bool:
    return device.type == "cpu"


def is_npu(device: torch.device) -> bool:
    return device.type == "npu"


def is_gpu(device: torch.device) -> bool:
    """An NVIDIA GPU (CUDA)."""
    return device.type == "cuda"


def with_index(device: torch.device) -> torch.device:
    """`device` with its index filled in where its name leaves it to the current device: "cuda" names the
    same GPU as "cuda:0" when that one is current; a CPU has no index."""
    if device.index is not None or is_cpu(device):
        return device
    current = torch.cuda.current_device() if is_gpu(device) else torch.npu.current_device()
    return torch.device(device.type, current)


def runs_triton(device: torch.device) -> bool:
    """Whether the runtime takes the Triton kernels on this device (CUDA, or an NPU through triton-ascend);
    the pure-PyTorch references run everywhere else."""
    return device.type in ("cuda", "npu")


@functools.cache
def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a GPU; where there is none (the interpreter), an H200's, so that kernels
    tile as on the GPU they were tuned for."""
    if is_gpu(device) and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H200_MULTIPROCESSORS


# The Triton target an Ascend 910B compiles for, as triton-ascend's GPUTarget(backend, arch, warp size) names it (an
# Atlas A2 training part): what the lowering check compiles every kernel for where no NPU is there to ask.
ASCEND_910B_TRITON_TARGET = ("npu", "Ascend910B3", 0)

# Shared memory one block of an H100 / H200 may opt into: the budget where no GPU is there to ask (tests that
# compile kernels for Hopper without one).
HOPPER_SHARED_MEMORY_PER_BLOCK = 232448


@functools.cache
def shared_memory_per_block(device: torch.device) -> int:
    """Bytes of shared memory one block can use on `device` (its opt-in maximum); an H100's where no GPU answers."""
    if is_gpu(device) and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    return HOPPER_SHARED_MEMORY_PER_BLOCK


@functools.cache
def supports_dependent_launch(device: torch.device) -> bool:
    """Whether a kernel on `device` can be launched while the kernel before it still runs and wait for its
    results inside (CUDA's programmatic dependent launch): NVIDIA GPUs from Hopper (compute capability 9) on."""
    return is_gpu(device) and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def npu_core_count(device: torch.device, kind: str) -> int:
    """AI cores of `kind` ("cube" for tl.dot work, "vector" for the rest) on an Ascend device."""
    try:
        import triton

        props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
        return int(props["num_aicore" if kind == "cube" else "num_vectorcore"])
    except Exception:  # noqa: BLE001 - any driver without that query
        return NPU_CORES_FALLBACK[kind]


def device_count(kind: str) -> int | None:
    """How many devices of `kind` this machine has; None for the host, which any number of processes share."""
    if kind == "cpu":
        return None
    return getattr(torch, kind).device_count()  # torch.cuda / torch.npu


def make_current(kind: str, index: int) -> torch.device:
    """Device `index` of `kind`, made this process's current one (the host has no index)."""
    if kind == "cpu":
        return torch.device("cpu")
    device = torch.device(kind, index)
    getattr(torch, kind).set_device(device)
    return device


def distributed_backend(device: torch.device) -> str:
    """The torch.distributed backend for processes on `device`: NCCL on CUDA, HCCL on Ascend (torch_npu), gloo on
    CPU."""
    return {"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")


def _graph_runtime(device: torch.device):
    """The torch module that captures `device`'s graphs and owns its streams and events: torch.cuda, or torch.npu
    (registered by torch-npu, whose NPUGraph / graph / graph_pool_handle mirror CUDA's)."""
    return torch.npu if is_npu(device) else torch.cuda


# The distribution that brings Ascend NPUs to torch (its import name is torch_npu).
NATIVE_PACKAGE = "torch-npu"


def cann_version() -> str | None:
    """The CANN toolkit's version as torch-npu reports it, where it can (None where it does not import)."""
    try:
        module = native_operators()
    except Exception:  # noqa: BLE001 - a torch-npu that does not import (no CANN) has no version to give
        return None
    for ask in (lambda: module.utils.get_cann_version(), lambda: module.version.cann):
        with contextlib.suppress(Exception):
            if version := ask():
                return str(version)
    return None


def native_operators() -> ModuleType:
    """torch-npu's module, whose npu_* functions are CANN's own operators: what kernels/npu/ calls on an Ascend NPU."""
    return importlib.import_module("torch_npu")


def capturing_graph(device: torch.device) -> bool:
    """Whether work queued now on `device` is being captured into a graph rather than run."""
    return graphs_supported(device) and _graph_runtime(device).is_current_stream_capturing()


def graphs_supported(device: torch.device) -> bool:
    """Whether decode / verify steps can be captured and replayed as graphs here: CUDA graphs on an NVIDIA GPU,
    torch-npu's NPU graphs (aclmdlRI capture) on an Ascend NPU."""
    return is_gpu(device) or is_npu(device)


class DeviceGraph:
    """A step of device work captured once and replayed as one launch (a CUDA graph, or an NPU graph). Capture runs
    `fn` without executing it; the caller warms `fn` up first (kernel compilation, workspaces), on scratch state."""

    _live: weakref.WeakSet[DeviceGraph] = weakref.WeakSet()  # every graph of this process not yet collected

    def __init__(self, device: torch.device, pool=None) -> None:
        """pool: a memory pool (new_pool) shared with other graphs that are never replayed at the same time and
        whose outputs are copied out before another of them replays; None: the graph's own."""
        if not graphs_supported(device):
            raise NpuportError(f"graph capture is not available on {device}")
        self.device, self.pool = device, pool
        self.runtime = _graph_runtime(device)
        self.graph = self.runtime.NPUGraph() if is_npu(device) else self.runtime.CUDAGraph()
        DeviceGraph._live.add(self)

    @classmethod
    def release_all(cls) -> None:
        """Free every graph of this process (none can be replayed after). A process group whose collectives a
        graph captured cannot be destroyed while the graph lives: NCCL's communicator teardown waits for it."""
        for graph in list(cls._live):
            graph.graph.reset()
        cls._live.clear()

    def warm_up(self, fn):
        """Run fn() eagerly on a side stream, as capture wants; returns its result."""
        runtime = self.runtime
        stream = runtime.Stream(self.device)
        stream.wait_stream(runtime.current_stream(self.device))
        with runtime.stream(stream):
            out = fn()
        runtime.current_stream(self.device).wait_stream(stream)
        return out

    def capture(self, fn):
        """Record fn(); returns its outputs, which every replay overwrites in place. With a process group up, the
        capture only forbids this thread's unsafe calls: the NCCL (HCCL) watchdog thread queries its events
        meanwhile. Python's cyclic garbage collector is held off meanwhile: graphs of dropped steps (a closed or
        grown slot pool) live in reference cycles, and one destroyed by a collection during a capture invalidates
        it (seen on an H100: a serve pool made again, its first capture failed)."""
        grouped = torch.distributed.is_available() and torch.distributed.is_initialized()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with self.runtime.graph(self.graph, pool=self.pool,
                                    capture_error_mode="thread_local" if grouped else "global"):
                return fn()
        finally:
            if collecting:
                gc.enable()

    @staticmethod
    def new_pool(device: torch.device):
        """A memory pool that several graphs on `device` can share (see __init__)."""
        runtime = _graph_runtime(device)
        with runtime.device(device):
            return runtime.graph_pool_handle()

    def replay(self) -> None:
        self.graph.replay()


def timed_graph(fn, device: torch.device, calls: int):
    """fn() as a captured step runs it: a graph of `calls` calls (captured after one warm-up call). Returns a
    function that replays the graph once and returns the device milliseconds per call: no CPU launch cost."""
    graph = DeviceGraph(device)
    graph.warm_up(fn)

    def many():
        for _ in range(calls):
            fn()

    graph.capture(many)
    graph.replay()

    def replay_ms() -> float:
        start, end = graph.runtime.Event(enable_timing=True), graph.runtime.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls

    return replay_ms


@dataclass
class PauseCount:
    """One kind of one-off device work this process has done - graphs captured, GEMM tiles tuned - and the host
    seconds it took: done while clients wait, it is time they lose, so `serve` shows both in /metrics."""

    count: int = 0
    seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, seconds: float) -> None:
        with self.lock:
            self.count += 1
            self.seconds += seconds
