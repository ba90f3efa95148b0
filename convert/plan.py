"""The conversion plan: every output tensor with its dtype, shape, label and how to produce it from the
source, in model order, grouped into shards, before a byte is written. Output sizes are known from the
source headers alone, so shard headers are written first and data streamed after them. A quantized layer's tensors
are its scheme's: W8A8_DYNAMIC (convert/quantize.py) or W4A8_DYNAMIC (convert/w4a8.py, routed experts only).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from npuport.convert.engine_facts import EngineTarget
from npuport.convert.labels import LinearLabel, label_linears
from npuport.convert.quantize import per_channel_scale, quantize_rows
from npuport.convert.qwen35_names import (
    FUSED_EXPERTS,
    PER_EXPERT,
    is_linear_weight,
    is_mtp,
    model_order_key,
    per_expert_module,
    split_param,
)
from npuport.convert.recipe import FLOAT, QUANTIZED, W4A8_DYNAMIC, W8A8_DYNAMIC, Recipe
from npuport.convert.safetensors_io import DTYPES, OutSpec, ShardReader, TensorEntry, itemsize, shown_name
from npuport.convert.source import SourceCheckpoint
from npuport.convert.w4a8 import scale_bias_groups, w4a8_dynamic
from npuport.errors import CheckpointError, RecipeError

BLOCK_BYTES = 64 * 1024 * 1024  # source bytes processed at once: bounds the working set


@dataclass(frozen=True)
class Region:
    """A contiguous [rows, cols] matrix inside a source tensor, starting at element `offset`."""

    entry: TensorEntry
    offset: int
    rows: int
    cols: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * itemsize(self.entry.dtype)

    def read_rows(self, reader: ShardReader, first: int, count: int, block: torch.Tensor) -> torch.Tensor:
        """Rows [first, first + count) as a [count, cols] tensor of the source dtype, read into `block` where they
        fit (see ShardReader.read)."""
        size = itemsize(self.entry.dtype)
        begin = (self.offset + first * self.cols) * size
        data = reader.read(self.entry, begin, begin + count * self.cols * size, block)
        return data.view(DTYPES[self.entry.dtype]).view(count, self.cols)

    def row_blocks(self) -> Iterator[tuple[int, int]]:
        step = max(1, BLOCK_BYTES // max(1, self.cols * itemsize(self.entry.dtype)))
        for r in range(0, self.rows, step):
            yield r, min(step, self.rows - r)


@dataclass
class Unit:
    """Output tensors produced together (a quantized weight with its scale and offset, or one copy)."""

    specs: list[OutSpec]
    labels: list[str]
    region: Region
    kind: str  # "copy" | "quantize" (W8A8_DYNAMIC) | "quantize_w4a8" | "to_float32"

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @property
    def source_bytes(self) -> int:
        return self.region.nbytes

    def produce(self, reader: ShardReader, block: torch.Tensor) -> Iterator[tuple[str, torch.Tensor | memoryview]]:
        """Yield (tensor name, next piece of its bytes) in spec order. Source bytes are read into `block` (uint8
        [BLOCK_BYTES], reused): a piece yielded may lie in it, so it must be consumed before the next is asked for."""
        if self.kind == "copy":
            size = itemsize(self.region.entry.dtype)
            start, total = self.region.offset * size, self.region.nbytes
            for b in range(0, total, BLOCK_BYTES):
                e = min(total, b + BLOCK_BYTES)
                yield self.specs[0].name, reader.raw(self.region.entry, start + b, start + e, block)
        elif self.kind == "to_float32":
            yield self.specs[0].name, self.region.read_rows(reader, 0, self.region.rows, block).float().reshape(-1)
        elif self.kind == "quantize_w4a8":
            yield from self._quantize_w4a8(reader, block)
        else:
            yield from self._quantize(reader, block)

    def _quantize_w4a8(self, reader: ShardReader, block: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole projection at once: ssz's search stops when every row of the projection has converged (one
        expert projection: tens of MB at the largest models' widths)."""
        r = self.region
        w = r.read_rows(reader, 0, r.rows, block)
        if w.dtype != torch.bfloat16:
            raise CheckpointError(f"{r.entry.file}: tensor {r.entry.name!r}: W4A8_DYNAMIC is computed on BF16 "
                                  f"weights, this one is {r.entry.dtype} ({self.specs[0].name})")
        if not torch.isfinite(w).all():
            raise CheckpointError(f"{r.entry.file}: tensor {r.entry.name!r}: NaN or Inf in a weight to quantize "
                                  f"({self.specs[0].name})")
        packed, scale, offset, bias = w4a8_dynamic(w, self.specs[3].shape[1])
        for spec, tensor in zip(self.specs, (packed, scale, offset, bias), strict=True):
            yield spec.name, tensor.reshape(-1)

    def _quantize(self, reader: ShardReader, block: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        scales = []
        r = self.region
        for first, count in r.row_blocks():
            w = r.read_rows(reader, first, count, block)
            scale = per_channel_scale(w)  # a NaN or Inf anywhere in a row makes its max, so its scale, non-finite
            if not torch.isfinite(scale).all():
                bad = first + int((~torch.isfinite(scale)).nonzero()[0])
                raise CheckpointError(
                    f"{r.entry.file}: tensor {r.entry.name!r}: NaN or Inf in row {bad} of a weight to quantize "
                    f"({self.specs[0].name})"
                )
            yield self.specs[0].name, quantize_rows(w, scale)
            scales.append(scale)
        yield self.specs[1].name, torch.cat(scales).float()
        yield self.specs[2].name, torch.zeros(r.rows, dtype=torch.float32)


@dataclass
class Plan:
    units: list[Unit]  # model order
    linear_labels: dict[str, LinearLabel]
    shards: list[list[Unit]] = field(default_factory=list)

    @property
    def description(self) -> dict[str, str]:
        """Tensor name -> label, in write order (the global keys are added by the writer)."""
        return {s.name: lab for u in self.units for s, lab in zip(u.specs, u.labels, strict=True)}

    @property
    def schemes(self) -> list[str]:
        """The quantization schemes the plan writes, e.g. ["W4A8_DYNAMIC", "W8A8_DYNAMIC"]."""
        return sorted({lab.label for lab in self.linear_labels.values() if lab.label in QUANTIZED})

    @property
    def scheme(self) -> str:
        """The artifact's scheme as npuport names it: W4A8_DYNAMIC when any layer is int4 (its experts), else
        W8A8_DYNAMIC. (msModelSlim's description says W8A8_DYNAMIC for both: it ranks no W4A8.)"""
        return W4A8_DYNAMIC if W4A8_DYNAMIC in self.schemes else W8A8_DYNAMIC

    @property
    def ignore_list(self) -> list[LinearLabel]:
        return [lab for lab in self.linear_labels.values() if lab.label == FLOAT]

    @property
    def total_bytes(self) -> int:
        return sum(u.nbytes for u in self.units)


def _quantized_unit(module: str, region: Region) -> Unit:
    specs = [
        OutSpec(f"{module}.weight", "I8", (region.rows, region.cols)),
        OutSpec(f"{module}.weight_scale", "F32", (region.rows, 1)),
        OutSpec(f"{module}.weight_offset", "F32", (region.rows, 1)),
    ]
    return Unit(specs, [W8A8_DYNAMIC] * 3, region, "quantize")


def _w4a8_unit(module: str, region: Region) -> Unit:
    """msModelSlim's W4A8_DYNAMIC tensors of a routed-expert projection [N, K]: int4 pairs packed along N into int8
    [N/2, K], scale and zero offset [N, 1], scale_bias [N, 1] (gate/up) or [N, 16] (down: one per K slice)."""
    if PER_EXPERT.match(module) is None or is_mtp(module):
        raise RecipeError(f"{module}: W4A8_DYNAMIC is written for routed experts only (as msModelSlim's W4A8 "
                          "recipes use it); exclude this layer from the int4 step or give it the int8 qconfig")
    groups = scale_bias_groups(module)
    if region.rows % 2 or region.cols % groups:
        raise CheckpointError(f"{region.entry.file}: tensor {region.entry.name!r}: W4A8_DYNAMIC needs an even number "
                              f"of rows and columns a multiple of {groups}, {module} is [{region.rows}, {region.cols}]")
    specs = [
        OutSpec(f"{module}.weight", "I8", (region.rows // 2, region.cols)),
        OutSpec(f"{module}.weight_scale", "F32", (region.rows, 1)),
        OutSpec(f"{module}.weight_offset", "F32", (region.rows, 1)),
        OutSpec(f"{module}.scale_bias", "F32", (region.rows, groups)),
    ]
    return Unit(specs, [W4A8_DYNAMIC] * 4, region, "quantize_w4a8")


def _float_unit(name: str, region: Region, shape: tuple[int, ...]) -> Unit:
    return Unit([OutSpec(name, region.entry.dtype, shape)], [FLOAT], region, "copy")


def _linear_regions(src: SourceCheckpoint) -> dict[str, Region]:
    """Every linear module (experts split per expert) -> where its [N, K] weight lies in the source."""
    regions: dict[str, Region] = {}
    for name, e in src.entries.items():
        fused = FUSED_EXPERTS.match(name)
        if fused:
            if len(e.shape) != 3:
                raise CheckpointError(
                    f"{e.file}: fused experts tensor {name!r} has shape {list(e.shape)}, expected 3-D"
                )
            n_exp, rows, cols = e.shape
            for x in range(n_exp):
                base = x * rows * cols
                if fused["kind"] == "gate_up_proj":  # [E, 2I, H]: gate rows first, then up
                    half = rows // 2
                    regions[per_expert_module(fused["experts"], x, "gate_proj")] = Region(e, base, half, cols)
                    regions[per_expert_module(fused["experts"], x, "up_proj")] = Region(
                        e, base + half * cols, half, cols
                    )
                else:  # down_proj [E, H, I]
                    regions[per_expert_module(fused["experts"], x, "down_proj")] = Region(e, base, rows, cols)
        elif is_linear_weight(name, e.shape):
            regions[split_param(name)[0]] = Region(e, 0, e.shape[0], e.shape[1])
    return regions


def _refuse_if_nothing_quantized(labels: dict[str, LinearLabel], recipe: Recipe) -> None:
    """An artifact labelled W8A8 whose every layer is BF16 (a misspelt include glob, say) is never written."""
    if any(lab.label in QUANTIZED for lab in labels.values()):
        return
    included = next((m for m in labels if any(r.includes(m) for r in recipe.rules)), None)
    why = (f"every layer they match is kept BF16 (e.g. {shown_name(included)}: {labels[included].reason})"
           if included else "they match no linear layer of this model")
    raise RecipeError(f"{recipe.path}: the recipe quantizes nothing: include patterns {recipe.shown_includes()}: {why}")


def build_plan(src: SourceCheckpoint, recipe: Recipe, part_file_bytes: int, engine: EngineTarget | None = None) -> Plan:
    regions = _linear_regions(src)
    modules = sorted(regions, key=lambda m: model_order_key(m + ".weight"))
    labels = label_linears(modules, recipe, engine)
    _refuse_if_nothing_quantized(labels, recipe)
    units: list[Unit] = []
    for m in modules:
        region = regions[m]
        if labels[m].label in QUANTIZED:
            if region.entry.dtype not in ("BF16", "F16", "F32"):
                raise CheckpointError(
                    f"{region.entry.file}: tensor {region.entry.name!r}: cannot quantize {region.entry.dtype}"
                )
            make = _w4a8_unit if labels[m].label == W4A8_DYNAMIC else _quantized_unit
            units.append(make(m, region))
        else:
            units.append(_float_unit(f"{m}.weight", region, (region.rows, region.cols)))
    for name, e in src.entries.items():
        if FUSED_EXPERTS.match(name) or is_linear_weight(name, e.shape):
            continue
        module, param = split_param(name)
        region = Region(e, 0, e.shape[0] if e.shape else 1, e.numel // (e.shape[0] if e.shape and e.shape[0] else 1))
        if param == "bias" and labels.get(module) and labels[module].label in QUANTIZED:
            units.append(Unit([OutSpec(name, "F32", e.shape)], [FLOAT], region, "to_float32"))
        else:
            units.append(_float_unit(name, region, e.shape))
    units.sort(key=lambda u: model_order_key(u.specs[0].name))
    plan = Plan(units, labels)
    plan.shards = _pack(units, part_file_bytes)
    return plan


def _pack(units: list[Unit], limit: int) -> list[list[Unit]]:
    """Shards in model order, each at most `limit` bytes unless a single unit is larger."""
    shards: list[list[Unit]] = [[]]
    size = 0
    for u in units:
        if shards[-1] and size + u.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(u)
        size += u.nbytes
    return shards
