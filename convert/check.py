"""`npuport check`: every rule of CONTRACT.md checked on an artifact folder, or the source checks on a BF16 source
folder, and on both what the serving engines assert (engine_rules.py); each violation listed in one line."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import torch

from npuport.convert.ascend_writer import DESCRIPTION_GLOBALS, INDEX_NAME
from npuport.convert.engine_rules import engine_problems
from npuport.convert.labels import engine_float_reason
from npuport.convert.qwen35_names import FUSED_EXPERTS, PER_EXPERT, fused_group, is_linear_weight, is_mtp, split_param
from npuport.convert.recipe import FLOAT, QUANTIZED, W4A8_DYNAMIC, W8A8_DYNAMIC
from npuport.convert.safetensors_io import MappedShards, TensorEntry, read_header
from npuport.convert.source import (
    CONFIG_NAME,
    QWEN35_MODEL_TYPES,
    SINGLE_NAME,
    ModelConfig,
    config_problems,
    shown_value,
)
from npuport.convert.source import INDEX_NAME as SOURCE_INDEX_NAME
from npuport.convert.w4a8 import scale_bias, scale_bias_groups, unpack_int4
from npuport.errors import ArtifactError, NpuportError
from npuport.jsonfile import read_json_object
from npuport.paths import file_inside, hub_cache_blobs

SOURCE_ONLY_FILES = ("model.safetensors.index.json", "model.safetensors")


def _load_json(path: Path, problems: list[str], also_inside: Path | None = None) -> dict | None:
    """The JSON object in `path`, or None with the problem added (the file outside the folder, unreadable, not
    JSON within npuport's bounds, not an object)."""
    try:
        inside = file_inside(path.parent, path.name, "the folder", ArtifactError, also_inside=also_inside)
        return read_json_object(inside, ArtifactError)
    except ArtifactError as e:
        problems.append(_relative(e, path.parent))
        return None


def control_character_names(folder: Path) -> list[str]:
    """A problem for each file of `folder` whose name holds a control character (a newline, a tab...): SHA256SUMS
    lists one name a line, and every message naming it would be broken across lines."""
    return [f"{p.name!r}: a file name with a control character; rename it" for p in sorted(folder.iterdir())
            if any(unicodedata.category(c) == "Cc" for c in p.name)]


def _relative(error: NpuportError, art: Path) -> str:
    """An error's message without the artifact folder in front of the file it names."""
    return str(error).replace(f"{art}/", "").replace(f"{art}: ", "")


def _read_shards(art: Path, problems: list[str], index_name: str = INDEX_NAME, strict: bool = True,
                 also_inside: Path | None = None) -> dict[str, TensorEntry]:
    """Every tensor the index `index_name` of the folder `art` names, with a problem added for each way the index
    and the shard headers disagree; `strict` (an artifact, which npuport wrote): also the index's total_size and
    any safetensors file it does not name. `also_inside`: a hub cache's blobs, where a source's files may lie."""
    index = _load_json(art / index_name, problems, also_inside) if (art / index_name).exists() else None
    if index is None:
        if not (art / index_name).exists():
            problems.append(f"{index_name} is missing (written even for one shard)")
        return {}
    weight_map = index.get("weight_map") or {}
    if not isinstance(weight_map, dict) or not all(isinstance(shard, str) for shard in weight_map.values()):
        problems.append(f"{index_name}: weight_map must map each tensor name to a shard file name")
        return {}
    entries: dict[str, TensorEntry] = {}
    read: set[str] = set()
    for shard in sorted(set(weight_map.values())):
        try:
            found, _ = read_header(file_inside(art, shard, index_name, ArtifactError, also_inside=also_inside))
        except NpuportError as e:
            problems.append(_relative(e, art))
            continue
        read.add(shard)
        for name, entry in found.items():
            if weight_map.get(name) != shard:
                problems.append(f"{shard}: tensor {name} is not mapped to this shard in {index_name}")
            entries[name] = entry
    for name, shard in weight_map.items():
        if name not in entries and shard in read:
            problems.append(f"{index_name}: maps {name} to {shard}, which does not contain it")
    if not strict:
        return entries
    metadata = index.get("metadata") or {}
    if not isinstance(metadata, dict):
        problems.append(f"{index_name}: metadata must be an object (with total_size), is {type(metadata).__name__}")
    elif (total := metadata.get("total_size")) != sum(e.nbytes for e in entries.values()):
        problems.append(f"{index_name}: metadata.total_size {shown_value(total)} != "
                        f"{sum(e.nbytes for e in entries.values())}")
    for p in sorted(art.glob("*.safetensors")):
        if p.name not in set(weight_map.values()):
            problems.append(f"{p.name}: a safetensors file not named by {index_name}")
    return entries


def _config_problems(config: dict, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The tensors (name -> shape as the model sees it) against config.json, by the rule convert and the loader
    apply (convert.source)."""
    try:
        sizes = ModelConfig.from_dict(config, "config.json")
    except NpuportError as e:
        return [str(e)]
    return config_problems(sizes, shapes)


def check_folder(folder: Path) -> list[str]:
    """check_artifact for a folder with a *quant_model_description.json (an artifact), else check_source."""
    folder = Path(folder)
    if folder.is_dir() and any(p.name.endswith("quant_model_description.json") for p in folder.iterdir()):
        return check_artifact(folder)
    return check_source(folder)


def check_source(src: Path) -> list[str]:
    """Every problem of the BF16 source folder `src` that convert and the loader would refuse (config.json, index,
    shard headers, tensors against the config: convert.source's rules, all of them listed rather than the first),
    and every engine rule it breaks (empty when it conforms). Files may lie in a hub cache's blobs, as for
    convert."""
    src = Path(src)
    if not src.is_dir():
        return [f"{src}: not a folder"]
    problems: list[str] = []
    blobs = hub_cache_blobs(src)
    config = _load_json(src / CONFIG_NAME, problems, blobs) if (src / CONFIG_NAME).exists() else None
    if config is None and not (src / CONFIG_NAME).exists():
        problems.append(f"{CONFIG_NAME} is missing")
    sizes = None
    if config is not None:
        model_type = config.get("model_type")
        if not isinstance(model_type, str) or model_type not in QWEN35_MODEL_TYPES:
            problems.append(f"{CONFIG_NAME}: unknown model_type {shown_value(model_type)} (npuport converts "
                            f"{', '.join(sorted(QWEN35_MODEL_TYPES))})")
        try:
            sizes = ModelConfig.from_dict(config, CONFIG_NAME)
        except NpuportError as e:
            problems.append(str(e))
    if (src / SOURCE_INDEX_NAME).exists():
        entries = _read_shards(src, problems, SOURCE_INDEX_NAME, strict=False, also_inside=blobs)
    elif (src / SINGLE_NAME).exists():
        entries = _single_shard(src, problems, blobs)
    else:
        entries = {}
        problems.append(f"neither {SOURCE_INDEX_NAME} nor {SINGLE_NAME} found")
    if sizes is not None and entries:
        problems += config_problems(sizes, {name: e.shape for name, e in entries.items()})
    if config is not None:
        problems += engine_problems(src, config, {name: e.shape for name, e in entries.items()})
    return problems


def _single_shard(src: Path, problems: list[str], blobs: Path | None) -> dict[str, TensorEntry]:
    try:
        found, _ = read_header(file_inside(src, SINGLE_NAME, "the folder", ArtifactError, also_inside=blobs))
    except NpuportError as e:
        problems.append(_relative(e, src))
        return {}
    return dict(found)


# The tensors of a quantized layer, by its label (CONTRACT.md; W4A8_DYNAMIC as msModelSlim 26.1's saver writes it)
QUANT_PARAMS = {W8A8_DYNAMIC: ("weight", "weight_scale", "weight_offset"),
                W4A8_DYNAMIC: ("weight", "weight_scale", "weight_offset", "scale_bias")}


def logical_shapes(entries: dict[str, TensorEntry], labels: dict) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape as the model sees it: a W4A8_DYNAMIC weight stores int4 pairs packed along its rows (int8
    [N/2, K]), so its layer is [N, K]."""
    return {name: (2 * e.shape[0], *e.shape[1:]) if labels.get(name) == W4A8_DYNAMIC and name.endswith(".weight")
            and len(e.shape) == 2 else e.shape for name, e in entries.items()}


def _check_quantized(module: str, label: str, entries: dict[str, TensorEntry], desc: dict, reader: MappedShards,
                     problems: list[str]) -> None:
    w = entries[f"{module}.weight"]
    packed = label == W4A8_DYNAMIC
    if w.dtype != "I8" or len(w.shape) != 2:
        what = "int8 [N/2, K] (int4 pairs)" if packed else "int8 [N, K]"
        problems.append(f"{w.name}: {label} weight must be {what}, is {w.dtype} {list(w.shape)}")
        return
    rows = 2 * w.shape[0] if packed else w.shape[0]
    for param in QUANT_PARAMS[label][1:]:
        name = f"{module}.{param}"
        e = entries.get(name)
        if e is None:
            problems.append(f"{name}: missing for quantized layer {module}")
            continue
        if desc.get(name) != label:
            problems.append(f"{name}: labelled {shown_value(desc.get(name))}, must be {label} like {module}.weight")
        columns = scale_bias_groups(module) if param == "scale_bias" else 1
        if e.dtype != "F32" or e.shape != (rows, columns):
            problems.append(f"{name}: must be float32 [{rows}, {columns}], is {e.dtype} {list(e.shape)}")
        elif param == "weight_offset" and bool(reader.view(e).any()):
            problems.append(f"{name}: must be all zeros (engines ignore it)")
        elif param == "weight_scale" and not bool((reader.view(e) > 0).all()):
            problems.append(f"{name}: scales must be positive")
        elif param == "scale_bias" and f"{module}.weight_scale" in entries:
            scale = entries[f"{module}.weight_scale"]
            if scale.shape == (rows, 1) and not torch.equal(
                    reader.view(e), scale_bias(unpack_int4(reader.view(w)), reader.view(scale), columns)):
                problems.append(f"{name}: is not 8 x the sum of the dequantized weight over each of its {columns} "
                                "slice(s) of K (msModelSlim's scale_bias)")
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
    problems += control_character_names(art)
    config = _load_json(art / "config.json", problems) if (art / "config.json").exists() else None
    if config is None and not (art / "config.json").exists():
        problems.append("config.json is missing")
    if config is not None:
        if "quantization_config" in config:
            problems.append("config.json: has quantization_config (sglang would ignore the description)")
        if isinstance(config.get("text_config"), dict) and "quantization_config" in config["text_config"]:
            problems.append("config.json: text_config has quantization_config (sglang reads it instead)")
    entries = _read_shards(art, problems)
    desc = _load_json(descs[0], problems) if len(descs) == 1 else None
    shapes = logical_shapes(entries, desc or {})
    if config is not None and entries:
        problems += _config_problems(config, shapes)
    if config is not None:
        problems += engine_problems(art, config, shapes)
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
        elif label not in (*QUANTIZED, FLOAT):
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
        if label in QUANT_PARAMS and param not in QUANT_PARAMS[label]:
            problems.append(f"{name}: only {'/'.join(QUANT_PARAMS[label])} of a quantized layer can be {label}")
        if label == W4A8_DYNAMIC and (PER_EXPERT.match(module) is None or is_mtp(module)):
            problems.append(f"{name}: W4A8_DYNAMIC is for routed experts only")
        elif param == "weight" and (is_linear_weight(name, e.shape) or label in QUANTIZED):
            module_labels[module] = label
            if label in QUANTIZED:
                _check_quantized(module, label, entries, labels, reader, problems)
            elif e.dtype == "I8":
                problems.append(f"{name}: int8 weight labelled FLOAT")
        if label == FLOAT and param in QUANT_PARAMS[W4A8_DYNAMIC][1:]:
            problems.append(f"{name}: scale/offset/scale_bias of a FLOAT layer")
    groups: dict[str, set[str]] = {}
    for module, label in module_labels.items():
        reason = engine_float_reason(module)
        if reason and label != FLOAT:
            problems.append(f"{module}: must stay FLOAT ({reason})")
        groups.setdefault(fused_group(module), set()).add(label)
    for group, found in sorted(groups.items()):
        if len(found) > 1:
            problems.append(f"{group}: fused pieces carry different labels {sorted(found)}")

