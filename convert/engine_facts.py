"""What the serving engines are known to do with a model folder like this one, said before the user finds out: the
table in npuport/data/engine_facts.yaml (engine, versions, condition, trigger, effect, workaround, source), each
fact's condition evaluated on the folder's own labels (an artifact's quant_model_description.json; none for a BF16
source) and config.json. `npuport check` prints the facts a folder meets as warnings; the model card lists them
beside its serving commands. What every engine asserts of every folder is engine_rules.py's, not this table's."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from npuport.convert.qwen35_names import is_mtp
from npuport.convert.recipe import FLOAT, QUANTIZED
from npuport.errors import NpuportError
from npuport.jsonfile import read_json_object

KINDS = ("breaks", "loads", "cannot_load")
ENGINES = ("sglang", "vllm-ascend", "vllm")
TARGET_ENGINES = ("sglang", "vllm-ascend")  # the engines `convert-qwen35 --engine` and `check` name
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
    return not any(label in QUANTIZED for label in labels.values())


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


def _quantized(labels: Mapping[str, str], pattern: str) -> bool:
    return any(label in QUANTIZED and re.search(pattern, name) for name, label in labels.items())


# condition name -> whether a folder with these labels (tensor name -> label; empty for a BF16 source) and this
# config.json (parsed; empty when not known) meets it
CONDITIONS: dict[str, Callable[[Mapping[str, str], Mapping[str, Any]], bool]] = {
    # a MoE artifact whose target experts are int8 while its MTP head's experts stay BF16 (FLOAT)
    "float_mtp_experts_beside_int8_experts": lambda labels, config: FLOAT in _expert_labels(labels, mtp=True)
    and bool(set(QUANTIZED) & _expert_labels(labels, mtp=False)),
    # any quantized target with an MTP head (kept BF16: npuport never quantizes it)
    "quantized_target_with_mtp": lambda labels, config: any(is_mtp(n) for n in labels)
    and any(label in QUANTIZED for n, label in labels.items() if not is_mtp(n)),
    # a BF16 source whose GatedDeltaNet head dims vLLM's CPU kernels are not compiled for
    "bf16_source_gdn_head_dims_outside_vllm_cpu_kernels": lambda labels, config: _bf16_source(labels)
    and _gdn_head_dims_outside_vllm_cpu(config),
    # a BF16 source whose config.json declares another dtype than bfloat16 (vLLM serves it in that dtype by default)
    "bf16_source_declares_another_dtype": lambda labels, config: _bf16_source(labels)
    and _dtype(config) not in (None, "bfloat16"),
    # a folder whose config.json names the text-only architecture (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM)
    "text_layout_architecture": lambda labels, config: any(
        isinstance(a, str) and a.endswith("ForCausalLM") for a in config.get("architectures") or []),
    # an artifact with a vision block's linear layer quantized (msModelSlim's Qwen3.6 and 397B-A17B recipes)
    "quantized_vision_blocks": lambda labels, config: _quantized(labels, r"(^|\.)visual\.blocks\..*\.weight$"),
    # an artifact with a GatedDeltaNet layer's in_proj_qkv / in_proj_z quantized (msModelSlim's Qwen3.6 recipes)
    "quantized_gdn_input_projections": lambda labels, config: _quantized(
        labels, r"(^|\.)linear_attn\.in_proj_(qkv|z)\.weight$"),
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
    affected: str
    keep_float: str

    def applies_to(self, version: Version) -> bool:
        """Whether the release `version` of its engine has it (`affected` empty: every release)."""
        return SpecifierSet(self.affected).contains(version, prereleases=True)

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
        try:
            SpecifierSet(fact.affected)
            re.compile(fact.keep_float)
        except (InvalidSpecifier, re.error) as e:
            raise NpuportError(f"{source}: fact {fact.id!r}: affected or keep_float malformed ({e})") from None
        if (fact.kind == "cannot_load") != bool(fact.keep_float):
            raise NpuportError(f"{source}: fact {fact.id!r}: keep_float belongs to cannot_load facts, and only")
        facts.append(fact)
    return facts


def newest_releases(path: Path | None = None) -> dict[str, Version]:
    """engine -> the newest release the table was checked against (what `--engine ENGINE` alone means)."""
    source = path or Path(str(resources.files("npuport.data") / "engine_facts.yaml"))
    data = yaml.safe_load(source.read_text(encoding="utf-8"))
    newest = data.get("newest") if isinstance(data, dict) else None
    if not isinstance(newest, dict) or sorted(newest) != sorted(TARGET_ENGINES):
        raise NpuportError(f"{source}: `newest` must name the newest release of each of {', '.join(TARGET_ENGINES)}")
    return {engine: Version(str(version)) for engine, version in newest.items()}


@dataclass(frozen=True)
class EngineTarget:
    """The engine release an artifact is converted for (`convert-qwen35 --engine sglang` or `sglang==0.5.18`)."""

    engine: str
    version: Version

    def __str__(self) -> str:
        return f"{self.engine} {self.version}"

    @classmethod
    def parse(cls, text: str) -> EngineTarget:
        """ENGINE or ENGINE==VERSION; NpuportError naming what is wrong."""
        engine, _, version = text.strip().partition("==")
        if engine not in TARGET_ENGINES:
            raise NpuportError(f"--engine {text!r}: unknown engine; choose one of {', '.join(TARGET_ENGINES)}, "
                               f"optionally with ==VERSION")
        try:
            return cls(engine, Version(version) if version else newest_releases()[engine])
        except InvalidVersion:
            raise NpuportError(f"--engine {text!r}: {version!r} is not a version number") from None

    def cannot_load(self) -> list[EngineFact]:
        """The facts of layers this release cannot load quantized."""
        return [f for f in engine_facts() if f.kind == "cannot_load" and f.engine == self.engine
                and f.applies_to(self.version)]

    def keep_float_reason(self, module: str) -> str | None:
        """Why `module` stays FLOAT for this release, or None if it loads it quantized."""
        fact = next((f for f in self.cannot_load() if re.search(f.keep_float, module)), None)
        if fact is None:
            return None
        return f"--engine {self}: {fact.engine} cannot load it quantized ({fact.versions}; {fact.source})"


def engines_that_cannot_load(labels: Mapping[str, str], config: Mapping[str, Any] | None = None
                             ) -> dict[str, list[EngineFact]]:
    """engine -> the cannot_load facts an artifact with these labels meets at that engine's newest release (an
    empty list: that release loads it, as far as the table knows)."""
    met = facts_for(labels, "cannot_load", config)
    return {engine: [f for f in met if f.engine == engine and f.applies_to(version)]
            for engine, version in newest_releases().items()}


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


def engine_support(folder: Path) -> list[str]:
    """One line per target engine for an artifact: whether its newest release loads it, or what it cannot load
    (the fact's releases, source and remedy); nothing for a BF16 source."""
    folder = Path(folder)
    if not any(p.name.endswith("quant_model_description.json") for p in folder.iterdir()):
        return []
    cannot = engines_that_cannot_load(artifact_labels(folder), read_json_object(folder / "config.json"))
    newest = newest_releases()
    lines = []
    for engine, facts in cannot.items():
        if not facts:
            lines.append(f"{engine} {newest[engine]}: loads it (no known loading failure; see the warnings above for "
                         f"serving flags)")
        for f in facts:
            lines.append(f"{engine} ({f.versions}): cannot load it: {f.effect}; remedy: {f.workaround} ({f.source})")
    return lines
