"""What the serving engines are known to do with an artifact like this one, said before the user finds out: the
table in npuport/data/engine_facts.yaml (engine, versions, condition, trigger, effect, workaround, source), each
fact's condition evaluated on the artifact's own labels (quant_model_description.json). `npuport check` prints
the facts an artifact meets as warnings; the model card lists them beside its serving commands."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path

import yaml

from npuport.convert.qwen35_names import is_mtp
from npuport.convert.recipe import FLOAT, W8A8_DYNAMIC
from npuport.errors import NpuportError
from npuport.jsonfile import read_json_object

KINDS = ("breaks", "loads")
ENGINES = ("sglang", "vllm-ascend")


def _expert_labels(labels: Mapping[str, str], mtp: bool) -> set[str]:
    return {label for name, label in labels.items() if ".mlp.experts." in name and is_mtp(name) == mtp}


# condition name -> whether an artifact's labels (tensor name -> label) meet it
CONDITIONS: dict[str, Callable[[Mapping[str, str]], bool]] = {
    # a MoE artifact whose target experts are int8 while its MTP head's experts stay BF16 (FLOAT)
    "float_mtp_experts_beside_int8_experts": lambda labels: FLOAT in _expert_labels(labels, mtp=True)
    and W8A8_DYNAMIC in _expert_labels(labels, mtp=False),
    # any quantized target with an MTP head (kept BF16: npuport never quantizes it)
    "quantized_target_with_mtp": lambda labels: any(is_mtp(n) for n in labels)
    and any(label == W8A8_DYNAMIC for n, label in labels.items() if not is_mtp(n)),
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


def facts_for(labels: Mapping[str, str], kind: str | None = None) -> list[EngineFact]:
    """The facts whose condition an artifact with these labels meets (of one kind, if given)."""
    return [f for f in engine_facts() if CONDITIONS[f.condition](labels) and kind in (None, f.kind)]
