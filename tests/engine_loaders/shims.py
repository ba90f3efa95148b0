"""Inside an engine's subprocess, before the engine is imported: stand-ins for compiled kernels that cannot load on a
CPU without an NPU. Each is a kernel the engine calls at run time only; none takes part in naming, building or
loading a parameter, and calling one raises. This is the only code of the harness that is not the engine's own."""

from __future__ import annotations

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
