"""Inside an engine's subprocess, before the engine is imported: stand-ins for compiled kernels that cannot load on a
CPU without an NPU. Each is a kernel the engine calls at run time only; none takes part in naming, building or
loading a parameter, and calling one raises. This is the only code of the harness that is not the engine's own."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

import torch


def _kernel(*args, **kwargs):
    raise RuntimeError("a kernel stand-in of the loader harness was called: the harness never runs a forward pass")


class _Kernels(types.ModuleType):
    """A module whose every attribute is a kernel stand-in."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _kernel


class _StandIn:
    """Any attribute of a stand-in package: another stand-in; calling one raises. `A | None` in an annotation
    evaluated at import time works on it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandIn(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: a stand-in of the loader harness was called (it never runs a kernel)")

    def __or__(self, other):
        return self

    __ror__ = __or__


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandIn(f"{self.__name__}.{name}")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of these packages (and any module under them) give stand-in modules."""

    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = set(roots)

    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def install_npu_stand_ins() -> None:
    """For vllm-ascend, whose modules import torch_npu (the Ascend build of torch: needs CANN and an NPU) and use
    `torch.npu` (which torch_npu adds to torch) at import time:
    - torch_npu and every module under it: stand-in modules; any attribute is a stand-in and calling one raises
      (vllm-ascend calls them in kernels and stream handling only).
    - torch.npu: the same, except is_available() -> False and device_count() -> 0: there is no NPU here (vLLM's
      platform is still vllm-ascend's NPUPlatform, chosen by its plugin); current_device() -> the CPU, where the
      harness builds every parameter (vLLM builds a few layers on `current_platform.current_device()`).
    - the device name "npu" for torch's PrivateUse1 backend, as torch_npu names it, so that torch.device("npu:0")
      parses (vLLM names its process groups' device so); no tensor is ever put there."""
    torch.utils.rename_privateuse1_backend("npu")
    sys.meta_path.insert(0, _StandInFinder(("torch_npu",)))
    npu = _StandInModule("torch.npu")
    npu.__path__ = []
    npu.is_available = lambda: False
    npu.device_count = lambda: 0
    npu.current_device = lambda: torch.device("cpu")
    torch.npu = npu
    sys.modules["torch.npu"] = npu


class _OpNamespace:
    def __getattr__(self, name: str):
        return _kernel


def install(kernel_modules: tuple[str, ...] = ()) -> None:
    """- torch.ops.npu.*: the Ascend operators torch_npu registers (its import needs CANN); the engines' NPU
      quantization classes look one up when they are built.
    - torchvision::nms / qnms: the wheels on the index link CUDA torch, so their compiled ops do not load beside the
      CPU torch; torchvision then fails to import because it registers fake kernels for these two operators. Only
      the operator names are declared, so that torchvision imports (the engines use its image transforms).
    - kernel_modules: modules of compiled kernels absent here (e.g. vllm._custom_ops, which sglang imports for its
      rotary embedding on a platform that is neither CUDA nor NPU nor CPU)."""
    torch.ops.npu = _OpNamespace()
    library = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    sys.modules["_engine_loaders_torchvision_ops"] = library  # keep the library alive
    for name in kernel_modules:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            module_name = ".".join(parts[:i])
            if module_name not in sys.modules:
                module = _Kernels(module_name)
                module.__path__ = []
                sys.modules[module_name] = module
