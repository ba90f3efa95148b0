"""Qwen3.5 tensor-name rules, stated once: layouts, MTP, linear modules, fused expert names, the groups
an engine fuses into one layer, and the model order msModelSlim writes tensors in.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

MTP_PREFIX = "mtp."
MULTIMODAL_TEXT_PREFIX = "model.language_model."
TEXT_ONLY_PREFIX = "model."
VISUAL_PREFIX = "model.visual."

# Modules with a 2-D weight that are lookups, not matmuls: never quantized.
EMBEDDING_LEAVES = ("embed_tokens", "lm_head", "pos_embed")

# Pieces an engine fuses into one layer; they must carry the same label (CONTRACT.md).
FUSED_SIBLINGS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("in_proj_qkv", "in_proj_z"),
    ("in_proj_b", "in_proj_a"),
)

FUSED_EXPERTS = re.compile(r"^(?P<experts>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(r"^(?P<experts>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_DIGITS = re.compile(r"(\d+)")


def is_mtp(name: str) -> bool:
    return name.startswith(MTP_PREFIX)


def text_prefix(names: object) -> str:
    """`model.language_model.` for the multimodal layout the hubs publish, `model.` for text-only."""
    return MULTIMODAL_TEXT_PREFIX if any(n.startswith(MULTIMODAL_TEXT_PREFIX) for n in names) else TEXT_ONLY_PREFIX


def split_param(name: str) -> tuple[str, str]:
    """`a.b.weight` -> (`a.b`, `weight`)."""
    module, _, param = name.rpartition(".")
    return module, param


def per_expert_module(experts: str, expert: int, proj: str) -> str:
    """The per-expert module name engines load: `<experts>.<e>.<proj>`."""
    return f"{experts}.{expert}.{proj}"


def is_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """A `<module>.weight` of a linear layer (2-D, not an embedding or lm_head)."""
    module, param = split_param(name)
    return param == "weight" and len(shape) == 2 and module.rpartition(".")[2] not in EMBEDDING_LEAVES


def fused_group(module: str) -> str:
    """A key shared by all modules an engine fuses with `module` (all experts of one MoE layer too)."""
    m = PER_EXPERT.match(module)
    if m:
        return m["experts"] + ".*"
    parent, _, leaf = module.rpartition(".")
    for group in FUSED_SIBLINGS:
        if leaf in group:
            return f"{parent}.{'|'.join(group)}"
    return module


def layer_index(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def _natural(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in _DIGITS.split(name))


_TAIL_ORDER = ("embed_tokens", "norm", "lm_head")


def model_order_key(name: str) -> tuple:
    """msModelSlim's order: visual, decoder layers 0..N-1, `mtp.*`, then embeddings, final norm, lm_head."""
    if VISUAL_PREFIX in name or name.startswith("visual."):
        section = 0
    elif is_mtp(name):
        section = 2
    elif layer_index(name) is not None:
        section = 1
    else:
        module = split_param(name)[0]
        leaf = module.rpartition(".")[2]
        return (3, _TAIL_ORDER.index(leaf) if leaf in _TAIL_ORDER else len(_TAIL_ORDER), _natural(name))
    return (section, 0, _natural(name))


def layer_kind(module: str) -> str:
    """`a.layers.3.mlp.experts.7.up_proj` -> `a.layers.*.mlp.experts.*.up_proj`: the name of a kind of layer."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", module)


def layer_kinds(modules: Iterable[str]) -> dict[str, int]:
    """Each kind of layer among `modules` (layer_kind) with how many there are, in first-seen order: the one rule by
    which the converter's log and the model card list a group of layers."""
    return dict(Counter(map(layer_kind, modules)))
