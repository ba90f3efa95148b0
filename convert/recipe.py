"""msModelSlim YAML recipes: which linear layers get which scheme, by glob pattern on module names.

The one place where names are matched against a recipe. msModelSlim's own lab_practice recipes load
unchanged; what npuport does not implement (smoothing, calibration data, static or low-bit schemes) is
named in a clear message instead of being silently ignored.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from npuport.errors import RecipeError

W8A8_DYNAMIC = "W8A8_DYNAMIC"
FLOAT = "FLOAT"

_DYNAMIC_QCONFIG = {
    "act": {"scope": "per_token", "dtype": "int8", "symmetric": True, "method": "minmax"},
    "weight": {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"},
}
# Keys of `spec` that only matter for calibration-based schemes: W8A8_DYNAMIC needs no data.
_CALIBRATION_KEYS = {"dataset", "default_text", "calib_dataset", "calib_cfg", "runner", "anti_cfg", "calib_save_params"}
# Process types that change weights with calibration data before quantization.
_UNSUPPORTED_PROCESS = {"iter_smooth", "flex_smooth_quant", "smooth_quant", "anti_outlier", "awq", "gptq", "ssz"}


@dataclass(frozen=True)
class QuantRule:
    """One `linear_quant` entry: modules matching an include glob and no exclude glob get `scheme`."""

    include: tuple[str, ...]
    exclude: tuple[str, ...]
    where: str
    scheme: str = W8A8_DYNAMIC

    def excluded_by(self, module: str) -> str | None:
        return next((p for p in self.exclude if fnmatch.fnmatchcase(module, p)), None)

    def includes(self, module: str) -> bool:
        return any(fnmatch.fnmatchcase(module, p) for p in self.include)


@dataclass
class Recipe:
    name: str
    rules: list[QuantRule]
    part_file_size_gb: float
    text: str
    source_name: str
    notes: list[str] = field(default_factory=list)

    def match(self, module: str) -> QuantRule | None:
        """The first rule that selects `module`, or None."""
        return next((r for r in self.rules if r.includes(module) and not r.excluded_by(module)), None)

    def why_not(self, module: str) -> str:
        """Why no rule selects `module` (for the ignore-list)."""
        for r in self.rules:
            pattern = r.excluded_by(module) if r.includes(module) else None
            if pattern:
                return f"excluded by recipe pattern {pattern!r} ({r.where})"
        return "not included by any recipe pattern"


def default_recipe_path(moe: bool) -> Path:
    name = "qwen3_5_moe_w8a8.yaml" if moe else "qwen3_5_dense_w8a8.yaml"
    return Path(str(resources.files("npuport.recipes") / name))


def _patterns(value: object, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(p, str) for p in value):
        return tuple(value)
    raise RecipeError(f"{where}: include/exclude must be a glob pattern or a list of them, got {value!r}")


def _check_qconfig(qconfig: object, where: str) -> None:
    if not isinstance(qconfig, dict):
        raise RecipeError(f"{where}: missing qconfig")
    for part, expected in _DYNAMIC_QCONFIG.items():
        got = qconfig.get(part)
        if not isinstance(got, dict):
            raise RecipeError(f"{where}: qconfig.{part} missing")
        for key, want in expected.items():
            if got.get(key, want) != want:
                raise RecipeError(
                    f"{where}: qconfig.{part}.{key} = {got.get(key)!r} is not implemented; npuport writes "
                    f"W8A8_DYNAMIC only (act per_token int8 symmetric minmax, weight per_channel int8 symmetric minmax)"
                )


def _rules(process: list, where: str, allow_unsupported: bool, notes: list[str]) -> list[QuantRule]:
    rules: list[QuantRule] = []
    for i, step in enumerate(process):
        w = f"{where}[{i}]"
        kind = step.get("type") if isinstance(step, dict) else None
        if kind == "group":
            rules += _rules(step.get("configs") or [], f"{w}.configs", allow_unsupported, notes)
        elif kind == "linear_quant":
            _check_qconfig(step.get("qconfig"), w)
            rules.append(QuantRule(_patterns(step.get("include", ["*"]), w), _patterns(step.get("exclude"), w), w))
        else:
            msg = f"{w}: process type {kind!r} is not implemented"
            if kind in _UNSUPPORTED_PROCESS:
                msg += " (it rewrites weights from calibration activations)"
            if not allow_unsupported:
                raise RecipeError(msg + "; pass --skip-unsupported to convert without it")
            notes.append(msg + "; skipped (--skip-unsupported)")
    return rules


def load_recipe(path: Path, allow_unsupported: bool = False) -> Recipe:
    """Parse an msModelSlim recipe (`apiversion`, `metadata`, `spec.process[]`, `spec.save[]`)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        doc = yaml.safe_load(text)
    except OSError as e:
        raise RecipeError(f"{path}: cannot read recipe: {e}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("spec"), dict):
        raise RecipeError(f"{path}: not an msModelSlim recipe (no `spec` mapping)")
    spec = doc["spec"]
    if "process" not in spec:
        raise RecipeError(f"{path}: spec.process is missing (msModelSlim V0 recipes with calib_cfg are not supported)")
    notes: list[str] = []
    for key in doc:
        if key not in ("apiversion", "metadata", "spec"):
            notes.append(f"top-level key {key!r} is not part of the schema (a YAML anchor holder?); ignored")
    part_gb = 4.0
    for i, save in enumerate(spec.get("save") or []):
        if not isinstance(save, dict) or save.get("type") != "ascendv1_saver":
            raise RecipeError(f"{path}: spec.save[{i}]: only type 'ascendv1_saver' is implemented, got {save!r}")
        part_gb = float(save.get("part_file_size", part_gb))
        for k in save:
            if k not in ("type", "part_file_size"):
                notes.append(f"spec.save[{i}].{k} is not implemented; ignored")
    for key in spec:
        if key in ("process", "save"):
            continue
        if key in _CALIBRATION_KEYS:
            notes.append(f"spec.{key} ignored: W8A8_DYNAMIC needs no calibration data or model runner")
        else:
            notes.append(f"spec.{key} is not implemented; ignored")
    rules = _rules(spec["process"] or [], f"{path.name}: spec.process", allow_unsupported, notes)
    if not rules:
        raise RecipeError(f"{path}: no linear_quant step; nothing would be quantized")
    name = str((doc.get("metadata") or {}).get("config_id") or path.stem)
    return Recipe(name, rules, part_gb, text, path.name, notes)
