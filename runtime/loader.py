"""Load a Qwen3.5 model from a BF16 source folder or an npuport / msModelSlim ascendV1 W8A8 artifact:
both name layouts, experts fused or per expert, every linear layer built by its label. A tensor that is
missing, misshapen, of the wrong dtype or wrongly labelled fails the load with its name."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
from safetensors import safe_open

from npuport.convert.ascend_writer import DESCRIPTION_NAME
from npuport.convert.ascend_writer import INDEX_NAME as ARTIFACT_INDEX_NAME
from npuport.convert.qwen35_names import MTP_PREFIX, PER_EXPERT, text_prefix
from npuport.convert.recipe import FLOAT, W8A8_DYNAMIC
from npuport.convert.source import INDEX_NAME as SOURCE_INDEX_NAME
from npuport.devices import pick_device
from npuport.errors import ArtifactError, CheckpointError, NpuportError
from npuport.jsonfile import read_json_object
from npuport.runtime.config import ModelConfig, load_config
from npuport.runtime.linear import Linear, W8A8Linear
from npuport.runtime.model import Qwen35

LABELS = (FLOAT, W8A8_DYNAMIC)
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


class Checkpoint:
    """The tensors of a model folder, read one at a time through safetensors.safe_open, and (for an
    artifact) the label of each from quant_model_description.json."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a folder")
        descriptions = sorted(p for p in self.path.iterdir() if p.name.endswith(DESCRIPTION_NAME))
        if len(descriptions) > 1:
            names = ", ".join(p.name for p in descriptions)
            raise ArtifactError(f"{self.path}: more than one {DESCRIPTION_NAME}: {names}")
        self.labels: dict[str, object] | None = (
            read_json_object(descriptions[0], ArtifactError) if descriptions else None
        )
        self.files = self._tensor_files()
        self._handles: dict[Path, object] = {}

    @property
    def is_artifact(self) -> bool:
        return self.labels is not None

    def error(self, message: str) -> NpuportError:
        return (ArtifactError if self.is_artifact else CheckpointError)(f"{self.path}: {message}")

    def _tensor_files(self) -> dict[str, Path]:
        index = self.path / (ARTIFACT_INDEX_NAME if self.is_artifact else SOURCE_INDEX_NAME)
        if index.exists():
            weight_map = read_json_object(index, ArtifactError).get("weight_map")
            if not isinstance(weight_map, dict):
                raise self.error(f"{index.name} has no weight_map")
            return {name: self.path / shard for name, shard in weight_map.items()}
        files: dict[str, Path] = {}
        for shard in sorted(self.path.glob("*.safetensors")):
            with safe_open(shard, framework="pt") as f:
                files.update((name, shard) for name in f.keys())
        if not files:
            raise self.error("no safetensors weights found")
        return files

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _handle(self, name: str):
        file = self.files[name]
        if file not in self._handles:
            if not file.exists():
                raise self.error(f"shard {file.name} (holding tensor {name}) is missing")
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file]

    def label(self, name: str) -> str:
        """FLOAT for every tensor of a BF16 source; the description's label in an artifact."""
        if self.labels is None:
            return FLOAT
        if name not in self.labels:
            raise self.error(f"tensor {name} has no label in {DESCRIPTION_NAME}")
        label = self.labels[name]
        if label not in LABELS:
            known = ", ".join(LABELS)
            raise self.error(f"tensor {name} has label {label!r}, which this runtime cannot load (known: {known})")
        return label

    def read(self, name: str, shape: tuple[int, ...], kind: str, index: int | None = None) -> torch.Tensor:
        """Tensor `name`, checked to have `shape` and dtype kind 'float' or 'int8'; with `index`, only
        tensor[index] is read (one expert of a fused expert tensor)."""
        if name not in self.files:
            raise self.error(f"tensor {name} is missing")
        handle = self._handle(name)
        try:
            piece = handle.get_slice(name)
        except Exception as e:  # safetensors raises its own error type for a name absent from the shard
            raise self.error(f"tensor {name} is not in {self.files[name].name}: {e}") from None
        if tuple(piece.get_shape()) != tuple(shape):
            raise self.error(f"tensor {name} has shape {list(piece.get_shape())}, expected {list(shape)}")
        tensor = handle.get_tensor(name) if index is None else piece[index]
        if (kind == "int8") != (tensor.dtype == torch.int8) or (kind == "float" and not tensor.is_floating_point()):
            expected = "int8" if kind == "int8" else "a float dtype"
            raise self.error(f"tensor {name} is {tensor.dtype}, expected {expected}")
        return tensor


def _checkpoint_name(name: str, prefix: str) -> str:
    """Runtime name -> checkpoint name: `mtp.*` and `lm_head` at the root, the rest under the layout's prefix."""
    return name if name.startswith(MTP_PREFIX) or name.startswith("lm_head.") else prefix + name


class _Loader:
    def __init__(self, ckpt: Checkpoint, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.ckpt, self.n_experts, self.dtype, self.device = ckpt, config.num_experts, dtype, device
        self.prefix = text_prefix(ckpt.files)

    def put(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype if t.is_floating_point() else t.dtype)

    def float_tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A FLOAT tensor of the runtime's `name` (experts read from a fused tensor when stored fused)."""
        ck = _checkpoint_name(name, self.prefix)
        if ck not in self.ckpt and (fused := self._fused_expert(ck, shape)) is not None:
            return fused
        if self.ckpt.label(ck) != FLOAT:
            raise self.ckpt.error(f"tensor {ck} is labelled {self.ckpt.label(ck)}, expected {FLOAT}")
        return self.put(self.ckpt.read(ck, shape, "float"))

    def _fused_expert(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Expert e's gate/up/down weight from `<experts>.gate_up_proj [E, 2I, H]` / `<experts>.down_proj [E, H, I]`."""
        m = PER_EXPERT.match(name.removesuffix(".weight"))
        if m is None or not name.endswith(".weight"):
            return None
        e, proj = int(m["expert"]), m["proj"]
        fused = f"{m['experts']}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        if fused not in self.ckpt:
            return None
        if self.ckpt.label(fused) != FLOAT:
            raise self.ckpt.error(f"tensor {fused} is labelled {self.ckpt.label(fused)}; fused experts must be {FLOAT}")
        if proj == "down_proj":
            return self.put(self.ckpt.read(fused, (self.n_experts, *shape), "float", index=e))
        both = self.ckpt.read(fused, (self.n_experts, 2 * shape[0], shape[1]), "float", index=e)
        return self.put(both[: shape[0]] if proj == "gate_proj" else both[shape[0] :])

    def linear(self, name: str, module: Linear) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        """The module for linear layer `name` by its label, and its tensors."""
        ck = _checkpoint_name(name, self.prefix)
        shape = (module.out_features, module.in_features)
        if ck + ".weight" not in self.ckpt or self.ckpt.label(ck + ".weight") == FLOAT:
            return module, {"weight": self.float_tensor(name + ".weight", shape)}
        if name == "lm_head":
            raise self.ckpt.error(f"tensor {ck}.weight is labelled {W8A8_DYNAMIC}; lm_head must be {FLOAT}")
        weight = self.ckpt.read(ck + ".weight", shape, "int8")
        scale = self.ckpt.read(ck + ".weight_scale", (shape[0], 1), "float")
        offset = self.ckpt.read(ck + ".weight_offset", (shape[0], 1), "float")
        if bool(offset.ne(0).any()):
            raise self.ckpt.error(f"tensor {ck}.weight_offset is not all zeros (the scheme is symmetric)")
        with torch.device("meta"):
            quantized = W8A8Linear(module.in_features, module.out_features, self.dtype)
        return quantized, {"weight": weight.to(self.device), "weight_scale": scale.float().to(self.device)}


def load_model(path: Path | str, device: torch.device | str | None = None,
               dtype: torch.dtype = torch.bfloat16) -> Qwen35:
    """The model in folder `path` (BF16 source or W8A8 artifact), with its MTP head when it has one, on
    `device` (default: pick_device()) with float tensors in `dtype`."""
    ckpt = Checkpoint(Path(path))
    config = load_config(ckpt.path)
    mtp_layers = {int(m.group(1)) for name in ckpt.files if (m := _MTP_LAYER.match(name))}
    if "mtp.fc.weight" in ckpt and not config.mtp_num_hidden_layers:
        config = dataclasses.replace(config, mtp_num_hidden_layers=len(mtp_layers))
    with_mtp = "mtp.fc.weight" in ckpt and config.mtp_num_hidden_layers > 0
    device = torch.device(device) if device is not None else pick_device()
    loader = _Loader(ckpt, config, dtype, device)
    with torch.device("meta"):
        model = Qwen35(config, with_mtp)
    tensors: dict[str, torch.Tensor] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, Linear):
            built, params = loader.linear(name, module)
            if built is not module:
                model.set_submodule(name, built)
            tensors.update({f"{name}.{k}": v for k, v in params.items()})
    for name, param in model.named_parameters():
        if name not in tensors:
            tensors[name] = loader.float_tensor(name, tuple(param.shape))
    model.load_state_dict(tensors, strict=True, assign=True)
    return model.eval().requires_grad_(False)

