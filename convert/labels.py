"""The label of every linear layer: W8A8_DYNAMIC where the recipe selects it and nothing forbids it,
FLOAT otherwise, with the reason. The MTP head overrides any recipe; so does the engine release named with
`--engine` (what it cannot load quantized, from the table of engine facts) - and nothing else: by default the
artifact is what the recipe asks, as msModelSlim writes it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from npuport.convert.engine_facts import EngineTarget
from npuport.convert.qwen35_names import fused_group, is_mtp
from npuport.convert.recipe import FLOAT, Recipe

# Linear layers no engine loads quantized, and too small to matter (CONTRACT.md).
ENGINE_FLOAT_RULES: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"\.mlp\.gate$"), "router: a tiny layer that engines keep in BF16"),
    (re.compile(r"\.mlp\.shared_expert_gate$"), "shared-expert gate: a tiny layer that engines keep in BF16"),
)
MTP_REASON = "MTP head: always BF16 (sglang runs it unquantized; an int8 mtp.* tensor would be garbage)"


@dataclass(frozen=True)
class LinearLabel:
    module: str
    label: str
    reason: str  # why it is FLOAT; the recipe rule that selected it when quantized


def engine_float_reason(module: str) -> str | None:
    return next((reason for pattern, reason in ENGINE_FLOAT_RULES if pattern.search(module)), None)


def label_linears(modules: list[str], recipe: Recipe, engine: EngineTarget | None = None) -> dict[str, LinearLabel]:
    """A label for each linear module name (per-expert names for experts), in the order given; `engine`: the
    release the artifact is for, whose known loading failures are avoided."""
    labels: dict[str, LinearLabel] = {}
    for m in modules:
        rule = recipe.match(m)
        if is_mtp(m):
            asked = f"; the recipe ({rule.where}) asked to quantize it, npuport never does" if rule else ""
            labels[m] = LinearLabel(m, FLOAT, MTP_REASON + asked)
        elif rule is None:
            labels[m] = LinearLabel(m, FLOAT, recipe.why_not(m))
        elif (reason := engine_float_reason(m) or (engine and engine.keep_float_reason(m))) is not None:
            labels[m] = LinearLabel(m, FLOAT, reason)
        else:
            labels[m] = LinearLabel(m, rule.scheme, f"selected by {rule.where}")
    groups: dict[str, list[str]] = {}
    for m in modules:
        groups.setdefault(fused_group(m), []).append(m)
    for members in groups.values():
        floats = [m for m in members if labels[m].label == FLOAT]
        if floats and len(floats) < len(members):
            for m in members:
                if labels[m].label != FLOAT:
                    labels[m] = LinearLabel(
                        m,
                        FLOAT,
                        f"fused by the engines with {floats[0]}, which is kept FLOAT (one label per fused layer)",
                    )
    return labels
