"""Open a Qwen3.5 BF16 source folder: config, safetensors index and every shard header, checked
against each other before anything is written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from npuport.convert.safetensors_io import TensorEntry, read_header
from npuport.errors import CheckpointError
from npuport.jsonfile import read_json_object

QWEN35_MODEL_TYPES = {"qwen3_5": False, "qwen3_5_text": False, "qwen3_5_moe": True, "qwen3_5_moe_text": True}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass
class SourceCheckpoint:
    path: Path
    config: dict
    model_type: str
    is_moe: bool
    entries: dict[str, TensorEntry]  # every tensor, by name
    shard_files: list[Path]

    @property
    def text_config(self) -> dict:
        return self.config.get("text_config") or self.config


def open_source(path: Path) -> SourceCheckpoint:
    """Read and cross-check config.json, the index and all shard headers of the source at `path`."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a folder")
    if any(p.name.endswith("quant_model_description.json") for p in path.iterdir()):
        raise CheckpointError(f"{path}: this is already a quantized artifact; convert its BF16 source")
    config = read_json_object(path / "config.json", CheckpointError)
    model_type = config.get("model_type")
    if model_type not in QWEN35_MODEL_TYPES:
        known = ", ".join(sorted(QWEN35_MODEL_TYPES))
        raise CheckpointError(f"{path / 'config.json'}: unknown model_type {model_type!r} (npuport converts {known})")
    index_path = path / INDEX_NAME
    if index_path.exists():
        index = read_json_object(index_path, CheckpointError)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no weight_map")
    elif (path / SINGLE_NAME).exists():
        weight_map = None
    else:
        raise CheckpointError(f"{path}: neither {INDEX_NAME} nor {SINGLE_NAME} found")
    shard_names = sorted(set(weight_map.values())) if weight_map else [SINGLE_NAME]
    entries: dict[str, TensorEntry] = {}
    for shard in shard_names:
        shard_path = path / shard
        found, _ = read_header(shard_path)
        for name, entry in found.items():
            if name in entries:
                raise CheckpointError(f"{shard_path}: tensor {name!r} also stored in {entries[name].file.name}")
            if weight_map is not None and weight_map.get(name) != shard:
                raise CheckpointError(f"{shard_path}: tensor {name!r} is not listed for this shard in {INDEX_NAME}")
            entries[name] = entry
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in entries:
                raise CheckpointError(f"{index_path}: names tensor {name!r} in {shard}, which does not contain it")
    return SourceCheckpoint(path, config, model_type, QWEN35_MODEL_TYPES[model_type], entries,
                            [path / s for s in shard_names])
