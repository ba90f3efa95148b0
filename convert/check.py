"""`npuport check`: every rule of CONTRACT.md checked on an artifact folder, each violation listed."""

from __future__ import annotations

from pathlib import Path

from npuport.convert.ascend_writer import DESCRIPTION_GLOBALS, INDEX_NAME
from npuport.convert.labels import engine_float_reason
from npuport.convert.qwen35_names import FUSED_EXPERTS, fused_group, is_linear_weight, is_mtp, split_param
from npuport.convert.recipe import FLOAT, W8A8_DYNAMIC
from npuport.convert.safetensors_io import MappedShards, TensorEntry, read_header
from npuport.convert.source import ModelConfig, config_problems, shown_value
from npuport.errors import ArtifactError, NpuportError
from npuport.jsonfile import read_json_object
from npuport.paths import file_inside

QUANT_PARAMS = ("weight", "weight_scale", "weight_offset")
SOURCE_ONLY_FILES = ("model.safetensors.index.json", "model.safetensors")


def _load_json(path: Path, problems: list[str]) -> dict | None:
    """The JSON object in `path`, or None with the problem added (the file outside the artifact, unreadable, not
    JSON within npuport's bounds, not an object)."""
    try:
        return read_json_object(file_inside(path.parent, path.name, "the artifact", ArtifactError), ArtifactError)
    except ArtifactError as e:
        problems.append(_relative(e, path.parent))
        return None


def _relative(error: NpuportError, art: Path) -> str:
    """An error's message without the artifact folder in front of the file it names."""
    return str(error).replace(f"{art}/", "").replace(f"{art}: ", "")


def _read_shards(art: Path, problems: list[str]) -> dict[str, TensorEntry]:
    index = _load_json(art / INDEX_NAME, problems) if (art / INDEX_NAME).exists() else None
    if index is None:
        if not (art / INDEX_NAME).exists():
            problems.append(f"{INDEX_NAME} is missing (written even for one shard)")
        return {}
    weight_map = index.get("weight_map") or {}
    if not isinstance(weight_map, dict) or not all(isinstance(shard, str) for shard in weight_map.values()):
        problems.append(f"{INDEX_NAME}: weight_map must map each tensor name to a shard file name")
        return {}
    entries: dict[str, TensorEntry] = {}
    read: set[str] = set()
    for shard in sorted(set(weight_map.values())):
        try:
            found, _ = read_header(file_inside(art, shard, INDEX_NAME, ArtifactError))
        except NpuportError as e:
            problems.append(_relative(e, art))
            continue
        read.add(shard)
        for name, entry in found.items():
            if weight_map.get(name) != shard:
                problems.append(f"{shard}: tensor {name} is not mapped to this shard in {INDEX_NAME}")
            entries[name] = entry
    for name, shard in weight_map.items():
        if name not in entries and shard in read:
            problems.append(f"{INDEX_NAME}: maps {name} to {shard}, which does not contain it")
    metadata = index.get("metadata") or {}
    if not isinstance(metadata, dict):
        problems.append(f"{INDEX_NAME}: metadata must be an object (with total_size), is {type(metadata).__name__}")
    elif (total := metadata.get("total_size")) != sum(e.nbytes for e in entries.values()):
        problems.append(f"{INDEX_NAME}: metadata.total_size {shown_value(total)} != "
                        f"{sum(e.nbytes for e in entries.values())}")
    for p in sorted(art.glob("*.safetensors")):
        if p.name not in set(weight_map.values()):
            problems.append(f"{p.name}: a safetensors file not named by {INDEX_NAME}")
    return entries


def _config_problems(config: dict, entries: dict[str, TensorEntry]) -> list[str]:
    """The tensors against config.json, by the rule convert and the loader apply (convert.source)."""
    try:
        sizes = ModelConfig.from_dict(config, "config.json")
    except NpuportError as e:
        return [str(e)]
    return config_problems(sizes, {name: e.shape for name, e in entries.items()})


def _check_quantized(module: str, entries: dict[str, TensorEntry], desc: dict, reader: MappedShards,
                     problems: list[str]) -> None:
    w = entries[f"{module}.weight"]
    if w.dtype != "I8" or len(w.shape) != 2:
        problems.append(f"{w.name}: W8A8_DYNAMIC weight must be int8 [N, K], is {w.dtype} {list(w.shape)}")
        return
    for param in ("weight_scale", "weight_offset"):
        name = f"{module}.{param}"
        e = entries.get(name)
        if e is None:
            problems.append(f"{name}: missing for quantized layer {module}")
            continue
        if desc.get(name) != W8A8_DYNAMIC:
            problems.append(f"{name}: labelled {shown_value(desc.get(name))}, must be W8A8_DYNAMIC like "
                            f"{module}.weight")
        if e.dtype != "F32" or e.shape != (w.shape[0], 1):
            problems.append(f"{name}: must be float32 [{w.shape[0]}, 1], is {e.dtype} {list(e.shape)}")
        elif param == "weight_offset" and bool(reader.view(e).any()):
            problems.append(f"{name}: must be all zeros (engines ignore it)")
        elif param == "weight_scale" and not bool((reader.view(e) > 0).all()):
            problems.append(f"{name}: scales must be positive")
    bias = entries.get(f"{module}.bias")
    if bias is not None and (bias.dtype != "F32" or desc.get(bias.name) != FLOAT):
        problems.append(f"{bias.name}: bias of a quantized layer must be float32 and labelled FLOAT")


def check_artifact(art: Path) -> list[str]:
    """Every violation of CONTRACT.md found in the artifact folder `art` (empty when it conforms)."""
    art = Path(art)
    if not art.is_dir():
        return [f"{art}: not a folder"]
    problems: list[str] = []
    descs = sorted(p for p in art.iterdir() if p.name.endswith("quant_model_description.json"))
    if len(descs) != 1:
        problems.append(f"expected exactly one *quant_model_description.json, found {len(descs)}")
    for name in SOURCE_ONLY_FILES:
        if (art / name).exists():
            problems.append(f"{name}: a BF16 source file; engines that find it load the wrong weights")
    for p in art.glob("model-*-of-*.safetensors"):
        problems.append(f"{p.name}: a BF16 source shard must not be in an artifact")
    config = _load_json(art / "config.json", problems) if (art / "config.json").exists() else None
    if config is None and not (art / "config.json").exists():
        problems.append("config.json is missing")
    if config is not None:
        if "quantization_config" in config:
            problems.append("config.json: has quantization_config (sglang would ignore the description)")
        if isinstance(config.get("text_config"), dict) and "quantization_config" in config["text_config"]:
            problems.append("config.json: text_config has quantization_config (sglang reads it instead)")
    entries = _read_shards(art, problems)
    if config is not None and entries:
        problems += _config_problems(config, entries)
    desc = _load_json(descs[0], problems) if len(descs) == 1 else None
    if desc is None:
        return problems
    for key, value in DESCRIPTION_GLOBALS.items():
        if key == "model_quant_type":
            continue
        if desc.get(key) != value:
            problems.append(f"description: {key} must be {value!r}, is {shown_value(desc.get(key))}")
    if desc.get("model_quant_type") not in (W8A8_DYNAMIC, FLOAT):
        problems.append(f"description: model_quant_type {shown_value(desc.get('model_quant_type'))} is not "
                        "W8A8_DYNAMIC")
    labels = {k: v for k, v in desc.items() if k not in DESCRIPTION_GLOBALS}
    for name in entries:
        if name not in labels:
            problems.append(f"{name}: tensor has no entry in the description")
    for name, label in labels.items():
        if name not in entries:
            problems.append(f"{name}: description entry for a tensor that is not written")
        elif label not in (W8A8_DYNAMIC, FLOAT):
            problems.append(f"{name}: unknown label {shown_value(label)}")
    reader = MappedShards()
    try:
        _check_layers(entries, labels, reader, problems)
    finally:
        reader.close()
    return problems


def _check_layers(entries: dict[str, TensorEntry], labels: dict, reader: MappedShards, problems: list[str]) -> None:
    module_labels: dict[str, str] = {}
    for name, e in entries.items():
        label = labels.get(name)
        module, param = split_param(name)
        if FUSED_EXPERTS.match(name):
            problems.append(f"{name}: experts must be stored per expert (mlp.experts.<e>.<proj>.weight)")
        if is_mtp(name) and (label != FLOAT or e.dtype != "BF16"):
            problems.append(f"{name}: every mtp.* tensor must be BF16 and FLOAT, is {e.dtype} {label}")
        if label == W8A8_DYNAMIC and param not in QUANT_PARAMS:
            problems.append(f"{name}: only weight/weight_scale/weight_offset of a quantized layer can be W8A8_DYNAMIC")
        if param == "weight" and (is_linear_weight(name, e.shape) or label == W8A8_DYNAMIC):
            module_labels[module] = label
            if label == W8A8_DYNAMIC:
                _check_quantized(module, entries, labels, reader, problems)
            elif e.dtype == "I8":
                problems.append(f"{name}: int8 weight labelled FLOAT")
        if label == FLOAT and param in ("weight_scale", "weight_offset"):
            problems.append(f"{name}: scale/offset of a FLOAT layer")
    groups: dict[str, set[str]] = {}
    for module, label in module_labels.items():
        reason = engine_float_reason(module)
        if reason and label != FLOAT:
            problems.append(f"{module}: must stay FLOAT ({reason})")
        groups.setdefault(fused_group(module), set()).add(label)
    for group, found in sorted(groups.items()):
        if len(found) > 1:
            problems.append(f"{group}: fused pieces carry different labels {sorted(found)}")

