"""What the serving engines are known to do with a model folder like this one, said before the user finds out: the
table in npuport/data/engine_facts.yaml (engine, versions, condition, trigger, effect, workaround, source), each
fact's condition evaluated on the folder's own labels (an artifact's quant_model_description.json; none for a BF16
source) and config.json. `npuport check` prints the facts a folder meets as warnings; the model card lists them
beside its serving commands. What every engine asserts of every folder is engine_rules.py's, not this table's."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from npuport.convert.qwen35_names import is_mtp
from npuport.convert.recipe import FLOAT, W8A8_DYNAMIC
from npuport.errors import NpuportError
from npuport.jsonfile import read_json_object

KINDS = ("breaks", "loads")
ENGINES = ("sglang", "vllm-ascend", "vllm")
# The linear-attention (GatedDeltaNet) head dims the chunked GDN kernels of vLLM's CPU build are compiled for
# (csrc/cpu/sgl-kernels/fla.cpp, DISPATCH_HEAD_DIM); key and value head dims must also be equal there.
VLLM_CPU_GDN_HEAD_DIMS = (64, 128)


def _expert_labels(labels: Mapping[str, str], mtp: bool) -> set[str]:
    return {label for name, label in labels.items() if ".mlp.experts." in name and is_mtp(name) == mtp}


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _bf16_source(labels: Mapping[str, str]) -> bool:
    """A folder without int8 layers: a BF16 source (the only kind vLLM's CPU build serves)."""
    return W8A8_DYNAMIC not in labels.values()


def _gdn_head_dims_outside_vllm_cpu(config: Mapping[str, Any]) -> bool:
    k, v = (_text_config(config).get(f"linear_{kind}_head_dim") for kind in ("key", "value"))
    return isinstance(k, int) and isinstance(v, int) and (k != v or k not in VLLM_CPU_GDN_HEAD_DIMS)


def _dtype(config: Mapping[str, Any]) -> object:
    text = _text_config(config)
    for scope in (text, config):
        for key in ("dtype", "torch_dtype"):
            if scope.get(key) is not None:
                return scope[key]
    return None


# condition name -> whether a folder with these labels (tensor name -> label; empty for a BF16 source) and this
# config.json (parsed; empty when not known) meets it
CONDITIONS: dict[str, Callable[[Mapping[str, str], Mapping[str, Any]], bool]] = {
    # a MoE artifact whose target experts are int8 while its MTP head's experts stay BF16 (FLOAT)
    "float_mtp_experts_beside_int8_experts": lambda labels, config: FLOAT in _expert_labels(labels, mtp=True)
    and W8A8_DYNAMIC in _expert_labels(labels, mtp=False),
    # any quantized target with an MTP head (kept BF16: npuport never quantizes it)
    "quantized_target_with_mtp": lambda labels, config: any(is_mtp(n) for n in labels)
    and any(label == W8A8_DYNAMIC for n, label in labels.items() if not is_mtp(n)),
    # a BF16 source whose GatedDeltaNet head dims vLLM's CPU kernels are not compiled for
    "bf16_source_gdn_head_dims_outside_vllm_cpu_kernels": lambda labels, config: _bf16_source(labels)
    and _gdn_head_dims_outside_vllm_cpu(config),
    # a BF16 source whose config.json declares another dtype than bfloat16 (vLLM serves it in that dtype by default)
    "bf16_source_declares_another_dtype": lambda labels, config: _bf16_source(labels)
    and _dtype(config) not in (None, "bfloat16"),
}


@dataclass(frozen=True)
class EngineFact:
    id: str
    engine: str
    versions: str
    kind: str
    condition: str
    trigger: str
    effect: str
    workaround: str
    source: str
    checked: bool

    def warning(self) -> str:
        """The one line `npuport check` prints."""
        when = f" with {self.trigger}" if self.trigger else ""
        return (f"{self.engine} {self.versions}{when}: {self.effect}; workaround: {self.workaround} "
                f"({self.source}{'' if self.checked else ', not re-checked'})")


def engine_facts(path: Path | None = None) -> list[EngineFact]:
    """The table (default: the one shipped with npuport), every entry checked: its fields, its kind, engine and
    condition known. NpuportError naming the entry otherwise."""
    source = path or Path(str(resources.files("npuport.data") / "engine_facts.yaml"))
    data = yaml.safe_load(source.read_text(encoding="utf-8"))
    names = [f.name for f in fields(EngineFact)]
    entries = data.get("facts") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise NpuportError(f"{source}: expected a list under `facts`")
    facts = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or sorted(entry) != sorted(names):
            raise NpuportError(f"{source}: fact {i} must have exactly the fields {', '.join(names)}")
        fact = EngineFact(**entry)
        if fact.kind not in KINDS or fact.engine not in ENGINES or fact.condition not in CONDITIONS:
            raise NpuportError(f"{source}: fact {fact.id!r}: kind, engine or condition unknown ({fact.kind}, "
                               f"{fact.engine}, {fact.condition})")
        facts.append(fact)
    return facts


def artifact_labels(art: Path) -> dict[str, str]:
    """tensor name -> label of an artifact's quant_model_description.json (`npuport check` checked its form)."""
    descriptions = sorted(Path(art).glob("*quant_model_description.json"))
    if len(descriptions) != 1:
        raise NpuportError(f"{art}: expected one *quant_model_description.json, found {len(descriptions)}")
    return {k: v for k, v in read_json_object(descriptions[0]).items() if isinstance(v, str)}


def facts_for(labels: Mapping[str, str], kind: str | None = None,
              config: Mapping[str, Any] | None = None) -> list[EngineFact]:
    """The facts whose condition a folder with these labels and this config.json meets (of one kind, if given)."""
    config = config or {}
    return [f for f in engine_facts() if CONDITIONS[f.condition](labels, config) and kind in (None, f.kind)]


def folder_facts(folder: Path, kind: str | None = None) -> list[EngineFact]:
    """facts_for an artifact (its labels and config.json) or a BF16 source (no labels), of one kind if given;
    `npuport check` has checked the folder's files first."""
    folder = Path(folder)
    artifact = any(p.name.endswith("quant_model_description.json") for p in folder.iterdir())
    config = read_json_object(folder / "config.json")
    return facts_for(artifact_labels(folder) if artifact else {}, kind, config)
