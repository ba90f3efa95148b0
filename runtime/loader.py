"""Load a Qwen3.5 model from a BF16 source folder or an npuport / msModelSlim ascendV1 artifact (W8A8, or W4A8 with
W4A8_DYNAMIC routed experts): both name layouts, experts fused or per expert, every linear layer built by its
label. A tensor that is missing, misshapen, of the wrong dtype or wrongly labelled fails the load with its name."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import torch
from safetensors import safe_open

from npuport.convert.ascend_writer import DESCRIPTION_NAME
from npuport.convert.ascend_writer import INDEX_NAME as ARTIFACT_INDEX_NAME
from npuport.convert.check import logical_shapes
from npuport.convert.qwen35_names import MTP_PREFIX, text_prefix
from npuport.convert.recipe import FLOAT, W4A8_DYNAMIC, W8A8_DYNAMIC
from npuport.convert.safetensors_io import TensorEntry
from npuport.convert.source import INDEX_NAME as SOURCE_INDEX_NAME
from npuport.convert.source import check_against_config, read_tensors, read_weight_map
from npuport.convert.w4a8 import scale_bias, scale_bias_groups, unpack_int4
from npuport.devices import is_gpu, pick_device
from npuport.errors import ArtifactError, CheckpointError, NpuportError
from npuport.jsonfile import read_json_object
from npuport.paths import file_inside, hub_cache_blobs
from npuport.runtime.config import ModelConfig, load_config
from npuport.runtime.expert_parallel import ExpertShard
from npuport.runtime.linear import Linear, W8A8Linear
from npuport.runtime.lockstep import mirrored_load
from npuport.runtime.model import Experts, Qwen35
from npuport.runtime.parallel import Parallel, Part, weight_part

LABELS = (FLOAT, W8A8_DYNAMIC, W4A8_DYNAMIC)
# scale_bias is checked against its definition (convert/w4a8.py) computed in float64: a stored value may differ by
# float32 summation error, at most this fraction of the sum of the terms' magnitudes (K * 2**-24 stays below it for
# any K an engine takes); a wrong packing, scale or K slicing moves it by whole terms.
SCALE_BIAS_RTOL = 1e-3
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


def keeps_int4_packed(device: torch.device) -> bool:
    """Whether W4A8 experts stay int4 pairs in int8 bytes (StackedExperts.int4) on `device`: on a GPU, where the
    Triton kernels (matvec and grouped GEMM) read them as int4 (half the bytes of int8) - one GPU, or each of
    several under expert parallelism, whose rank holds its own experts packed (a byte pairs rows of one expert) and
    runs them as one device would. Elsewhere they are unpacked to int8 at load, on one device or on each rank: the
    CPU runs the references (which would unpack them on every call), and on an NPU torch-npu's grouped matmul runs
    the experts, with no int4 operator documented for it here."""
    return is_gpu(device)


class Checkpoint:
    """The tensors of a model folder, read one at a time through safetensors.safe_open, and (for an
    artifact) the label of each from quant_model_description.json."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a folder")
        # A Hugging Face cache snapshot's files are symlinks into its repo's blobs: those, and only those, may be
        # read from outside the folder (npuport.paths rule).
        self.blobs = hub_cache_blobs(self.path)
        descriptions = sorted(p.name for p in self.path.iterdir() if p.name.endswith(DESCRIPTION_NAME))
        if len(descriptions) > 1:
            raise ArtifactError(f"{self.path}: more than one {DESCRIPTION_NAME}: {', '.join(descriptions)}")
        self.labels: dict[str, object] | None = (
            read_json_object(file_inside(self.path, descriptions[0], "the folder", ArtifactError,
                                         also_inside=self.blobs), ArtifactError) if descriptions else None
        )
        self.entries = self._tensor_entries()
        self.files = {name: entry.file for name, entry in self.entries.items()}
        self._handles: dict[Path, object] = {}

    @property
    def is_artifact(self) -> bool:
        return self.labels is not None

    def error(self, message: str) -> NpuportError:
        return (ArtifactError if self.is_artifact else CheckpointError)(f"{self.path}: {message}")

    def _tensor_entries(self) -> dict[str, TensorEntry]:
        """Every tensor of the folder, from the shards its index names (or every *.safetensors when it has none),
        each shard inside the folder with a header as strict as the safetensors library's (convert.source)."""
        error = ArtifactError if self.is_artifact else CheckpointError
        index_name = ARTIFACT_INDEX_NAME if self.is_artifact else SOURCE_INDEX_NAME
        if (self.path / index_name).exists():
            weight_map = read_weight_map(self.path, index_name, error, self.blobs)
            return read_tensors(self.path, sorted(set(weight_map.values())), index_name, error, weight_map,
                                self.blobs)
        shards = sorted(p.name for p in self.path.glob("*.safetensors"))
        entries = read_tensors(self.path, shards, "the folder", error, also_inside=self.blobs)
        if not entries:
            raise self.error("no safetensors weights found")
        return entries

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _handle(self, name: str):
        file = self.files[name]
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(file, framework="pt")
            except Exception as e:  # the shard changed since its header was read; safetensors has its own errors
                raise self.error(f"shard {file.name} (holding tensor {name}) cannot be opened: {e}") from None
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

    def read(self, name: str, shape: tuple[int, ...], kind: str, index: int | None = None,
             part: Part | None = None) -> torch.Tensor:
        """Tensor `name`, checked to have `shape` and dtype kind 'float' or 'int8'; with `index`, only
        tensor[index] is read (one expert of a fused expert tensor); with `part`, only those rows or columns
        (one rank's share)."""
        if name not in self.files:
            raise self.error(f"tensor {name} is missing")
        handle = self._handle(name)
        try:
            piece = handle.get_slice(name)
        except Exception as e:  # safetensors raises its own error type for a name absent from the shard
            raise self.error(f"tensor {name} is not in {self.files[name].name}: {e}") from None
        if tuple(piece.get_shape()) != tuple(shape):
            raise self.error(f"tensor {name} has shape {list(piece.get_shape())}, expected {list(shape)}")
        if part is not None:
            at = (slice(None),) * part.dim
            tensor = torch.cat([piece[(*at, slice(a, b))] for a, b in part.ranges], dim=part.dim)
        else:
            tensor = handle.get_tensor(name) if index is None else piece[index]
        if (kind == "int8") != (tensor.dtype == torch.int8) or (kind == "float" and not tensor.is_floating_point()):
            expected = "int8" if kind == "int8" else "a float dtype"
            raise self.error(f"tensor {name} is {tensor.dtype}, expected {expected}")
        return tensor


def _checkpoint_name(name: str, prefix: str) -> str:
    """Runtime name -> checkpoint name: `mtp.*` and `lm_head` at the root, the rest under the layout's prefix."""
    return name if name.startswith(MTP_PREFIX) or name.startswith("lm_head.") else prefix + name


class _Loader:
    """Reads each tensor into its place, only this rank's part of it (parallel.weight_part, ExpertShard)."""

    def __init__(self, ckpt: Checkpoint, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 parallel: Parallel) -> None:
        self.ckpt, self.config, self.dtype, self.device, self.parallel = ckpt, config, dtype, device, parallel
        self.n_experts = config.num_experts
        self.prefix = text_prefix(ckpt.files)

    def part(self, name: str) -> Part | None:
        return weight_part(name, self.config, self.parallel)

    def shape_of(self, name: str, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint's shape of tensor `name` (the runtime's name) of which this rank holds local_shape."""
        part = self.part(name)
        return local_shape if part is None else part.full_shape(local_shape)

    def put(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype if t.is_floating_point() else t.dtype)

    def float_tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A FLOAT tensor of the runtime's `name`, this rank's `shape` of it."""
        ck = _checkpoint_name(name, self.prefix)
        if self.ckpt.label(ck) != FLOAT:
            raise self.ckpt.error(f"tensor {ck} is labelled {self.ckpt.label(ck)}, expected {FLOAT}")
        return self.put(self.ckpt.read(ck, self.shape_of(name, shape), "float", part=self.part(name)))

    def linear(self, name: str, module: Linear) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        """The module for linear layer `name` by its label, and its tensors."""
        ck = _checkpoint_name(name, self.prefix)
        shape = (module.out_features, module.in_features)
        if ck + ".weight" not in self.ckpt or self.ckpt.label(ck + ".weight") == FLOAT:
            return module, {"weight": self.float_tensor(name + ".weight", shape)}
        if name == "lm_head":
            raise self.ckpt.error(f"tensor {ck}.weight is labelled {W8A8_DYNAMIC}; lm_head must be {FLOAT}")
        if self.ckpt.label(ck + ".weight") == W4A8_DYNAMIC:
            raise self.ckpt.error(f"tensor {ck}.weight is labelled {W4A8_DYNAMIC}, which is for routed experts only")
        weight, scale = self.w8a8(ck, self.shape_of(name + ".weight", shape), self.part(name + ".weight"),
                                  self.part(name + ".weight_scale"))
        with torch.device("meta"):
            quantized = W8A8Linear(module.in_features, module.out_features, self.dtype)
        return quantized, {"weight": weight.to(self.device), "weight_scale": scale.float().to(self.device)}

    def w8a8(self, ck: str, shape: tuple[int, int], part: Part | None = None, scale_part: Part | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 weight [N, K] and its scales [N, 1] of W8A8 layer `ck` (checkpoint name, no `.weight`); of
        the weight only `part`, of the scales only `scale_part` (one rank's)."""
        weight = self.ckpt.read(ck + ".weight", shape, "int8", part=part)
        scale = self.ckpt.read(ck + ".weight_scale", (shape[0], 1), "float", part=scale_part)
        offset = self.ckpt.read(ck + ".weight_offset", (shape[0], 1), "float")
        if bool(offset.ne(0).any()):
            raise self.ckpt.error(f"tensor {ck}.weight_offset is not all zeros (the scheme is symmetric)")
        return weight, scale

    def w4a8(self, ck: str, shape: tuple[int, int], packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The int4 values as int8 [N, K] - or with `packed` as stored, int8 [N/2, K] of row pairs, for the int4
        matvec kernels (keeps_int4_packed) - and the scales [N, 1] of W4A8_DYNAMIC expert projection `ck`
        (checkpoint name, no `.weight`; `shape` its logical [N, K]), unpacked from int8 [N/2, K] by convert/w4a8.py's
        unpack_int4, so that the int8 expert path runs them: x_q int8 per token times the int4 values as signed
        integers, accumulated exactly, rescaled by s_x * s_w - what the engines' int4 kernels amount to
        (kernels/fused_moe/naive.py says how). scale_bias is read and checked against its definition, 8 x the sum
        of q * s_w over each K slice (convert/w4a8.py's scale_bias), and then not used: it is the term the engines'
        kernels add back for the way they split the int8 activations into int4 halves, which an exact int8 x int8
        product does not need; a value that disagrees would make them compute something else than this runtime,
        so it fails the load."""
        n, k = shape
        if n % 2:
            raise self.ckpt.error(f"tensor {ck}.weight: a W4A8_DYNAMIC layer needs an even row count, not {n}")
        stored_weight = self.ckpt.read(ck + ".weight", (n // 2, k), "int8")
        q = unpack_int4(stored_weight)
        scale = self.ckpt.read(ck + ".weight_scale", (n, 1), "float").float()
        offset = self.ckpt.read(ck + ".weight_offset", (n, 1), "float")
        if bool(offset.ne(0).any()):
            raise self.ckpt.error(f"tensor {ck}.weight_offset is not all zeros (the scheme is symmetric)")
        groups = scale_bias_groups(ck)
        stored = self.ckpt.read(ck + ".scale_bias", (n, groups), "float").double()
        expected = scale_bias(q, scale.double(), groups)
        magnitude = scale_bias(q.abs(), scale.double().abs(), groups)
        if not bool(((stored - expected).abs() <= SCALE_BIAS_RTOL * magnitude).all()):
            worst = int((stored - expected).abs().flatten().argmax())
            raise self.ckpt.error(
                f"tensor {ck}.scale_bias disagrees with 8 x the sum of the unpacked int4 weight x weight_scale over "
                f"each of its {groups} K slice(s): row {worst // groups} column {worst % groups} holds "
                f"{stored.flatten()[worst].item():.6g}, expected {expected.flatten()[worst].item():.6g}")
        return (stored_weight if packed else q), scale

    def experts(self, name: str, module: Experts) -> tuple[Experts, dict[str, torch.Tensor]]:
        """The stacked experts of MoE layer `name` (`...mlp.experts`), filled one expert at a time straight into
        their place on the device (never a second copy of the layer): from fused `gate_up_proj [E, 2I, H]` /
        `down_proj [E, H, I]` (BF16 sources) or per-expert `E.{gate,up,down}_proj` tensors, BF16, W8A8 or W4A8 (its
        int4 values unpacked to int8 here: the int8 experts run them, see w4a8; kept packed where keeps_int4_packed).
        On several ranks, only this rank's experts (module holds their count; ExpertShard says which)."""
        ck = _checkpoint_name(name, self.prefix)
        e_count, two_i, hidden = module.gate_up_proj.shape
        global_ids = ExpertShard(self.n_experts, self.parallel.world).ids(self.parallel.rank)
        i = two_i // 2
        per_expert = {"gate_proj": (i, hidden), "up_proj": (i, hidden), "down_proj": (hidden, i)}
        labels = {self.ckpt.label(f"{ck}.{e}.{p}.weight") for e in global_ids for p in per_expert
                  if f"{ck}.{e}.{p}.weight" in self.ckpt}
        if len(labels) > 1:
            raise self.ckpt.error(f"the experts of {ck} carry different labels {sorted(labels)}; one layer, one label")
        quantized = labels in ({W8A8_DYNAMIC}, {W4A8_DYNAMIC})
        int4 = labels == {W4A8_DYNAMIC} and keeps_int4_packed(self.device)
        read_quantized = functools.partial(self.w4a8, packed=int4) if labels == {W4A8_DYNAMIC} else self.w8a8
        with torch.device("meta"):
            built = Experts(e_count, hidden, i, quantized, int4=int4)
        out = {n: torch.empty(b.shape, dtype=b.dtype if quantized else self.dtype, device=self.device)
               for n, b in built.state_dict().items()}
        rows = {"gate_proj": slice(0, i), "up_proj": slice(i, two_i), "down_proj": slice(None)}
        # packed int4: gate's row pairs are byte rows [0, I/2), up's [I/2, I); the scales keep one row per value
        weight_rows = {"gate_proj": slice(0, i // 2), "up_proj": slice(i // 2, i), "down_proj": slice(None)} if int4 \
            else rows
        for e, g in enumerate(global_ids):
            if not quantized:
                self.copy_float_expert(ck, g, "gate_up_proj", {p: rows[p] for p in ("gate_proj", "up_proj")},
                                       out["gate_up_proj"][e])
                self.copy_float_expert(ck, g, "down_proj", {"down_proj": rows["down_proj"]}, out["down_proj"][e])
                continue
            for proj, shape in per_expert.items():
                target = "down_proj" if proj == "down_proj" else "gate_up_proj"
                weight, scale = read_quantized(f"{ck}.{g}.{proj}", shape)
                out[target][e, weight_rows[proj]].copy_(weight)
                out[f"{target}_scale"][e, rows[proj]].copy_(scale.float().reshape(-1))
        return built, out

    def copy_float_expert(self, ck: str, e: int, fused_name: str, parts: dict[str, slice], dst: torch.Tensor) -> None:
        """Expert e's FLOAT weight rows into dst: from its per-expert tensors (`parts`: projection -> its rows of
        dst), or, where the layer is stored fused, from expert e's slice of `{ck}.{fused_name}`, read once."""
        names = {proj: f"{ck}.{e}.{proj}.weight" for proj in parts}
        if all(name in self.ckpt for name in names.values()):
            for proj, name in names.items():
                if self.ckpt.label(name) != FLOAT:
                    raise self.ckpt.error(f"tensor {name} is labelled {self.ckpt.label(name)}, expected {FLOAT}")
                dst[parts[proj]].copy_(self.ckpt.read(name, tuple(dst[parts[proj]].shape), "float"))
            return
        fused = f"{ck}.{fused_name}"
        if fused not in self.ckpt:
            missing = next(name for name in names.values() if name not in self.ckpt)
            raise self.ckpt.error(f"tensor {missing} is missing (nor is there a fused {fused})")
        if self.ckpt.label(fused) != FLOAT:
            raise self.ckpt.error(f"tensor {fused} is labelled {self.ckpt.label(fused)}; fused experts must be {FLOAT}")
        dst.copy_(self.ckpt.read(fused, (self.n_experts, *dst.shape), "float", index=e))


@mirrored_load
def load_model(path: Path | str, device: torch.device | str | None = None,
               dtype: torch.dtype = torch.bfloat16, parallel: Parallel | None = None) -> Qwen35:
    """The model in folder `path` (BF16 source, W8A8 or W4A8 artifact), with its MTP head when it has one, on
    `device` (default: pick_device()) with float tensors in `dtype`; with `parallel`, this rank's part of it
    (runtime/parallel.py), no other part ever read."""
    ckpt = Checkpoint(Path(path))
    config = load_config(ckpt.path, ckpt.blobs)
    check_against_config(ckpt.path, config, logical_shapes(ckpt.entries, ckpt.labels or {}),
                         ArtifactError if ckpt.is_artifact else CheckpointError)
    mtp_layers = {int(m.group(1)) for name in ckpt.files if (m := _MTP_LAYER.match(name))}
    if "mtp.fc.weight" in ckpt and not config.mtp_num_hidden_layers:
        config = dataclasses.replace(config, mtp_num_hidden_layers=len(mtp_layers))
    with_mtp = "mtp.fc.weight" in ckpt and config.mtp_num_hidden_layers > 0
    device = torch.device(device) if device is not None else pick_device()
    parallel = parallel or Parallel()
    loader = _Loader(ckpt, config, dtype, device, parallel)
    with torch.device("meta"):
        model = Qwen35(config, with_mtp, parallel)
    tensors: dict[str, torch.Tensor] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, Linear | Experts):
            built, params = loader.linear(name, module) if isinstance(module, Linear) else loader.experts(name, module)
            if built is not module:
                model.set_submodule(name, built)
            tensors.update({f"{name}.{k}": v for k, v in params.items()})
    for name, param in model.named_parameters():
        if name not in tensors:
            tensors[name] = loader.float_tensor(name, tuple(param.shape))
    model.load_state_dict(tensors, strict=True, assign=True)
    model.stack_projections()
    return model.eval().requires_grad_(False)

