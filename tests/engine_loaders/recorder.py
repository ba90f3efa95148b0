"""Inside an engine's subprocess: feed an artifact's tensors to the engine's own `load_weights` and record, for every
tensor, the parameter its weight loader wrote and that parameter's layer quantization method. Imports torch only; the
engine-specific runners (sglang_load.py, vllm_ascend_load.py) build the model and hand it here."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

# what a verdict's status may be, best first (a tensor loaded by one model and dropped by another is loaded)
LOADED, DROPPED, UNKNOWN, DTYPE_MISMATCH, GARBAGE, REFUSED = (
    "loaded", "dropped", "unknown", "dtype-mismatch", "garbage", "refused")
PROBLEMS = (UNKNOWN, DTYPE_MISMATCH, GARBAGE)


def artifact_tensors(art: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the artifact's shards, in the index's order."""
    index = json.loads((art / "quant_model_weights.safetensors.index.json").read_text())
    by_shard: dict[str, list[str]] = {}
    for name, shard in index["weight_map"].items():
        by_shard.setdefault(shard, []).append(name)
    for shard, names in by_shard.items():
        with safe_open(str(art / shard), framework="pt") as f:
            for name in names:
                yield name, f.get_tensor(name)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _quant_method(model: torch.nn.Module, param_name: str) -> str:
    """The quantization method (and scheme) the engine built for the layer owning this parameter."""
    module = model.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else model
    method = getattr(module, "quant_method", None)
    parts = [type(method).__name__ if method is not None else "none"]
    for attr in ("scheme", "w13_scheme"):
        scheme = getattr(module, attr, None)
        if scheme is not None:
            parts.append(type(scheme).__name__)
    scheme = getattr(method, "quant_method", None)  # vllm-ascend's method adapters hold their scheme there
    if scheme is not None and not isinstance(scheme, (str, type(None))):
        parts.append(type(scheme).__name__)
    return "/".join(parts)


def _rows_inside(chunk: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether `chunk` (cast to the parameter's dtype) sits in `param` as a contiguous block of rows: the loader put
    the tensor's values somewhere in the parameter, not a transformed or truncated copy of them."""
    if chunk.numel() == 0:
        return True
    width = chunk.shape[-1] if chunk.dim() else 1
    target = param.detach().reshape(-1)
    if target.numel() % width:
        return False
    target = target.reshape(-1, width)
    rows = chunk.detach().to(param.dtype).reshape(-1, width)
    if rows.shape[0] > target.shape[0]:
        return False
    starts = (target == rows[0]).all(dim=1).nonzero().flatten().tolist()
    return any(torch.equal(target[s:s + rows.shape[0]], rows) for s in starts if s + rows.shape[0] <= target.shape[0])


class LoadRecorder:
    """Wraps every parameter's weight loader of `model` so that each call is attributed to the checkpoint tensor
    being loaded; `feed` yields the tensors to the engine's load_weights."""

    def __init__(self, model: torch.nn.Module, default_loader) -> None:
        self.model, self.default_loader = model, default_loader
        self.current: str | None = None
        self.calls: dict[str, list[dict]] = {}
        self.loaded_tensors: dict[str, torch.Tensor] = {}
        self.by_storage: dict[int, str] = {}
        self.warnings: dict[str, list[str]] = {}
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.written: set[str] = set()
        for name, param in self.params.items():
            self._wrap(name, param)

    def _wrap(self, name: str, param: torch.nn.Parameter) -> None:
        own = "_weight_loader" if "_weight_loader" in param.__dict__ else "weight_loader"
        original = getattr(param, own, None)
        if original is None:  # the engine calls getattr(param, "weight_loader", its default loader)
            original = self.default_loader

        def loader(p, loaded_weight, *args, **kwargs):
            self.written.add(name)
            source = self._source(loaded_weight)
            if source is not None:
                self.calls.setdefault(source, []).append(
                    {"param": name, "shard": [repr(a) for a in args[:1]] + [repr(kwargs.get("shard_id", ""))],
                     "chunk": loaded_weight})
            return original(p, loaded_weight, *args, **kwargs)

        setattr(param, own, loader)

    def _source(self, loaded_weight) -> str | None:
        """The checkpoint tensor a loader call writes: the one whose storage the loaded tensor views (an engine may
        read the whole iterator before it loads, or hand a slice), else the one being fed now."""
        if isinstance(loaded_weight, torch.Tensor):
            source = self.by_storage.get(loaded_weight.untyped_storage().data_ptr())
            if source is not None:
                return source
        return self.current

    def feed(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        handler = _Warnings()
        logging.getLogger().addHandler(handler)
        try:
            for name, tensor in tensors:
                self._close(handler)
                self.current = name
                self.loaded_tensors[name] = tensor  # kept alive: storage addresses stay unique
                self.by_storage[tensor.untyped_storage().data_ptr()] = name
                yield name, tensor
            self._close(handler)
        finally:
            self.current = None
            logging.getLogger().removeHandler(handler)

    def _close(self, handler: _Warnings) -> None:
        if self.current is not None and handler.lines:
            self.warnings[self.current] = list(handler.lines)
        handler.lines.clear()

    def verdicts(self) -> dict[str, dict]:
        """tensor name -> {status, param, method, message} for every tensor fed."""
        out = {}
        for name, tensor in self.loaded_tensors.items():
            calls = self.calls.get(name, [])
            warned = self.warnings.get(name, [])
            if not calls:
                status = UNKNOWN if any("not found" in w or "nsupported" in w for w in warned) else DROPPED
                out[name] = {"status": status, "param": None, "method": None, "message": "; ".join(warned)}
                continue
            params = sorted({c["param"] for c in calls})
            methods = sorted({_quant_method(self.model, p) for p in params})
            status, message = LOADED, "; ".join(warned)
            for call in calls:
                param = self.params[call["param"]]
                int8_in, int8_param = tensor.dtype == torch.int8, param.dtype == torch.int8
                if int8_in != int8_param:
                    status = DTYPE_MISMATCH
                    message = f"{tensor.dtype} tensor written into {param.dtype} parameter {call['param']}"
                    break
                if not _rows_inside(call["chunk"], param):
                    status = GARBAGE
                    message = f"the values loaded are not found in parameter {call['param']} after loading"
                    break
            if status == LOADED and any("nsupported" in w for w in warned):
                status = UNKNOWN
            out[name] = {"status": status, "param": ",".join(params), "method": ",".join(methods),
                         "message": message}
        return out

    def unloaded_params(self) -> list[str]:
        """Parameters no checkpoint tensor was written into (besides rotary caches)."""
        return sorted(n for n in self.params if n not in self.written)


def refused(art: Path, message: str, names: list[str] | None = None) -> dict[str, dict]:
    """Every tensor (or those named) refused with the engine's message: the model could not be built or loaded."""
    names = names if names is not None else [n for n, _ in _names(art)]
    return {n: {"status": REFUSED, "param": None, "method": None, "message": message} for n in names}


def _names(art: Path) -> list[tuple[str, None]]:
    index = json.loads((art / "quant_model_weights.safetensors.index.json").read_text())
    return [(n, None) for n in index["weight_map"]]
