"""Open a Qwen3.5 model folder: its config (the sizes a Qwen3.5 declares, ModelConfig, which the runtime builds
from), its safetensors index and every shard header, and the tensors checked against the config, all before a
byte is written. The one place that says what a folder's files and tensors must be, for convert, `npuport check`
and the runtime's loader alike."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from npuport.convert.qwen35_names import FUSED_EXPERTS, MTP_PREFIX, PER_EXPERT, text_prefix
from npuport.convert.safetensors_io import TensorEntry, read_header, shown_name
from npuport.errors import CheckpointError, NpuportError
from npuport.jsonfile import read_json_object
from npuport.paths import file_inside, hub_cache_blobs
from npuport.tokenizer_folder import MAX_LAYERS  # beyond it a config is damaged: refused before use

QWEN35_MODEL_TYPES = {"qwen3_5": False, "qwen3_5_text": False, "qwen3_5_moe": True, "qwen3_5_moe_text": True}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


def shown_value(value: object) -> str:
    """A value taken from a JSON file, for a one-line message: its repr, cut short."""
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:80] + "..."


@dataclass(frozen=True)
class ModelConfig:
    """The sizes of a Qwen3.5 text model, read from config.json (its `text_config` when there is one)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # FULL_ATTENTION or LINEAR_ATTENTION (GatedDeltaNet) per layer
    rms_norm_eps: float
    tie_word_embeddings: bool
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # GatedDeltaNet: H key heads of size K, HV value heads of size V, conv kernel width
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MLP: dense (intermediate_size) or MoE (num_experts > 0)
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    mtp_num_hidden_layers: int

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN conv: q, k and v concatenated."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.gdn_value_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @classmethod
    def from_dict(cls, config: dict, where: str = CONFIG_NAME) -> ModelConfig:
        """The sizes in `config` (a parsed config.json); a field that is missing or of the wrong type is a
        CheckpointError naming it (`where` names the file)."""
        fields = _ConfigFields(config, where)
        n_layers = fields.count("num_hidden_layers", maximum=MAX_LAYERS)
        model_type = fields.raw("model_type", None)
        moe = QWEN35_MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
        # A MoE model_type needs experts; a dense one has none; an unknown one (tests, tools) goes by num_experts.
        num_experts = fields.count("num_experts", minimum=1 if moe else 0, default=... if moe else 0)
        if moe is False and num_experts:
            raise CheckpointError(f"{where}: model_type {model_type} is dense, but {fields.name('num_experts')} is "
                                  f"{num_experts}")
        moe = num_experts > 0
        config_ = cls(
            vocab_size=fields.count("vocab_size"),
            hidden_size=fields.count("hidden_size"),
            num_hidden_layers=n_layers,
            layer_types=fields.layer_types(n_layers),
            rms_norm_eps=fields.number("rms_norm_eps", 1e-6),
            tie_word_embeddings=fields.flag("tie_word_embeddings", False),
            num_attention_heads=fields.count("num_attention_heads"),
            num_key_value_heads=fields.count("num_key_value_heads"),
            head_dim=fields.count("head_dim"),
            rope_theta=fields.rope("rope_theta", 10000000.0),
            partial_rotary_factor=fields.rope("partial_rotary_factor", 0.25),
            linear_num_key_heads=fields.count("linear_num_key_heads"),
            linear_num_value_heads=fields.count("linear_num_value_heads"),
            linear_key_head_dim=fields.count("linear_key_head_dim"),
            linear_value_head_dim=fields.count("linear_value_head_dim"),
            linear_conv_kernel_dim=fields.count("linear_conv_kernel_dim", default=4),
            intermediate_size=0 if moe else fields.count("intermediate_size"),
            num_experts=num_experts,
            num_experts_per_tok=fields.count("num_experts_per_tok") if moe else 0,
            moe_intermediate_size=fields.count("moe_intermediate_size") if moe else 0,
            shared_expert_intermediate_size=fields.count("shared_expert_intermediate_size") if moe else 0,
            mtp_num_hidden_layers=fields.count("mtp_num_hidden_layers", minimum=0, default=0),
        )
        fields.require_computed_variants()
        if config_.num_experts_per_tok > num_experts:
            raise CheckpointError(f"{where}: {fields.name('num_experts_per_tok')} {config_.num_experts_per_tok} "
                                  f"exceeds {fields.name('num_experts')} {num_experts}")
        return config_


# Architecture keys of the published Qwen3.5 / 3.6 / 3.8 configs with the one value npuport's runtime (and every
# published model) computes: another value asks for a model npuport would run wrongly, so it is refused by name.
COMPUTED_VARIANTS: dict[str, object] = {
    "attn_output_gate": True,  # full attention's q_proj carries the sigmoid output gate
    "output_gate_type": "swish",  # the GatedDeltaNet output is norm(o) * silu(z)
    "mamba_ssm_dtype": "float32",  # the GatedDeltaNet state is float32
    "mtp_use_dedicated_embeddings": False,  # the MTP head shares embed_tokens and lm_head with the target
    "mlp_only_layers": [],  # every layer has its mixer
}


class _ConfigFields:
    """Typed reads of config.json fields: `text_config` first, then the top level (the multimodal layout keeps the
    text model's sizes in `text_config`)."""

    def __init__(self, config: dict, where: str) -> None:
        text = config.get("text_config")
        if text is not None and not isinstance(text, dict):
            raise CheckpointError(f"{where}: text_config must be an object")
        self.config, self.text, self.where = config, text or {}, where

    def name(self, key: str) -> str:
        """How the field is spelt in the file: `text_config.KEY` when it lives there."""
        return f"text_config.{key}" if key in self.text else key

    def raw(self, key: str, default: object = ...) -> object:
        for scope in (self.text, self.config):
            if scope.get(key) is not None:
                return scope[key]
        if default is ...:
            raise CheckpointError(f"{self.where}: missing {key!r}")
        return default

    def invalid(self, key: str, value: object, wanted: str) -> CheckpointError:
        return CheckpointError(f"{self.where}: {self.name(key)} must be {wanted}, is {shown_value(value)}")

    def count(self, key: str, minimum: int = 1, default: object = ..., maximum: int | None = None) -> int:
        value = self.raw(key, default)
        if (not isinstance(value, int) or isinstance(value, bool) or value < minimum
                or (maximum is not None and value > maximum)):
            wanted = "a positive integer" if minimum else "a non-negative integer"
            raise self.invalid(key, value, wanted + (f" of at most {maximum:,}" if maximum else ""))
        return value

    def number(self, key: str, default: float) -> float:
        value = self.raw(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise self.invalid(key, value, "a positive number")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.invalid(key, value, "true or false")
        return value

    def rope(self, key: str, default: float) -> float:
        """A RoPE setting: in `rope_parameters` (transformers 5) or, older, a plain field."""
        rope = self.raw("rope_parameters", {})
        if not isinstance(rope, dict):
            raise self.invalid("rope_parameters", rope, "an object")
        if rope.get(key) is None:
            return self.number(key, default)
        value = rope[key]
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise self.invalid("rope_parameters", {key: value}, f"an object whose {key} is a positive number")
        return float(value)

    def require_computed_variants(self) -> None:
        """Refuse, naming the key, a value of COMPUTED_VARIANTS' keys other than the one npuport computes (absent
        is fine: the published default)."""
        for key, computed in COMPUTED_VARIANTS.items():
            value = self.raw(key, None)
            if value is not None and (value != computed or type(value) is not type(computed)):
                raise CheckpointError(f"{self.where}: {self.name(key)} is {shown_value(value)}; npuport runs Qwen3.5 "
                                      f"models with {shown_value(computed)} only (every published model's)")

    def layer_types(self, n_layers: int) -> tuple[str, ...]:
        """`layer_types`, or the pattern `full_attention_interval` gives: every interval-th layer full attention."""
        if self.raw("layer_types", None) is None:
            interval = self.count("full_attention_interval", default=4)
            return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n_layers))
        types = self.raw("layer_types")
        known = (FULL_ATTENTION, LINEAR_ATTENTION)
        if not isinstance(types, list) or len(types) != n_layers or any(t not in known for t in types):
            raise CheckpointError(
                f"{self.where}: {self.name('layer_types')} must list {n_layers} ({self.name('num_hidden_layers')}) "
                f"of {FULL_ATTENTION}/{LINEAR_ATTENTION}"
            )
        return tuple(types)


def load_config(model_dir: Path, also_inside: Path | None = None) -> ModelConfig:
    """The sizes in `model_dir`/config.json (which must lie inside the folder, or inside `also_inside`)."""
    path = file_inside(Path(model_dir), CONFIG_NAME, "the folder", CheckpointError, also_inside=also_inside)
    return ModelConfig.from_dict(read_json_object(path, CheckpointError), str(path))


# --- the files a folder names ------------------------------------------------------------------------------------


def read_weight_map(folder: Path, index_name: str, error: type[NpuportError],
                    also_inside: Path | None = None) -> dict[str, str]:
    """The `weight_map` of folder/index_name: tensor name -> the shard file that holds it."""
    index_path = file_inside(folder, index_name, "the folder", error, also_inside=also_inside)
    weight_map = read_json_object(index_path, error).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise error(f"{index_path}: no weight_map")
    if not all(isinstance(shard, str) for shard in weight_map.values()):
        raise error(f"{index_path}: weight_map must map each tensor name to a shard file name")
    return weight_map


def read_tensors(folder: Path, shard_names: list[str], what: str, error: type[NpuportError],
                 weight_map: Mapping[str, str] | None = None,
                 also_inside: Path | None = None) -> dict[str, TensorEntry]:
    """Every tensor of the shards `shard_names` (as named by `what`, e.g. the index), each shard a regular file
    inside `folder` (npuport.paths rule; `also_inside`: a hub cache's blobs) with a strictly valid header; with
    `weight_map`, the headers and the map must agree tensor for tensor."""
    entries: dict[str, TensorEntry] = {}
    for shard in shard_names:
        shard_path = file_inside(folder, shard, what, error, also_inside=also_inside)
        found, _ = read_header(shard_path)
        for name, entry in found.items():
            if name in entries:
                other = shown_name(entries[name].file.name)
                raise error(f"{shard_path}: tensor {shown_name(name)} also stored in {other}")
            if weight_map is not None and weight_map.get(name) != shard:
                raise error(f"{shard_path}: tensor {shown_name(name)} is not listed for this shard in {what}")
            entries[name] = entry
    for name, shard in (weight_map or {}).items():
        if name not in entries:
            raise error(f"{folder / what}: tensor {shown_name(name)} is not in {shown_name(shard)}, where it is listed")
    return entries


# --- tensors against the config ----------------------------------------------------------------------------------

Dim = tuple[int, str]  # a dimension's value and the config fields it comes from, e.g. (64, "hidden_size")


def _dim(config: ModelConfig, *fields: str, times: int = 1) -> Dim:
    value = times * math.prod(getattr(config, f) for f in fields)
    return value, "*".join(([str(times)] if times != 1 else []) + list(fields))


def _fixed(value: int) -> Dim:
    return value, str(value)


def _layer_shapes(c: ModelConfig, kind: str) -> dict[str, tuple[Dim, ...]]:
    """Layer-relative name -> expected shape of every tensor of one decoder layer but its routed experts."""
    h = _dim(c, "hidden_size")
    shapes: dict[str, tuple[Dim, ...]] = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    if kind == FULL_ATTENTION:
        q, kv = _dim(c, "num_attention_heads", "head_dim"), _dim(c, "num_key_value_heads", "head_dim")
        shapes.update({
            "self_attn.q_proj.weight": (_dim(c, "num_attention_heads", "head_dim", times=2), h),  # [q | gate]
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
            "self_attn.q_norm.weight": (_dim(c, "head_dim"),),
            "self_attn.k_norm.weight": (_dim(c, "head_dim"),),
        })
    else:
        conv = (c.conv_dim, "2*linear_num_key_heads*linear_key_head_dim+linear_num_value_heads*linear_value_head_dim")
        hv, value = _dim(c, "linear_num_value_heads"), _dim(c, "linear_num_value_heads", "linear_value_head_dim")
        shapes.update({
            "linear_attn.in_proj_qkv.weight": (conv, h),
            "linear_attn.in_proj_z.weight": (value, h),
            "linear_attn.in_proj_b.weight": (hv, h),
            "linear_attn.in_proj_a.weight": (hv, h),
            "linear_attn.conv1d.weight": (conv, _fixed(1), _dim(c, "linear_conv_kernel_dim")),
            "linear_attn.A_log": (hv,),
            "linear_attn.dt_bias": (hv,),
            "linear_attn.norm.weight": (_dim(c, "linear_value_head_dim"),),
            "linear_attn.out_proj.weight": (h, value),
        })
    if c.is_moe:
        shared = _dim(c, "shared_expert_intermediate_size")
        shapes.update({
            "mlp.gate.weight": (_dim(c, "num_experts"), h),
            "mlp.shared_expert.gate_proj.weight": (shared, h),
            "mlp.shared_expert.up_proj.weight": (shared, h),
            "mlp.shared_expert.down_proj.weight": (h, shared),
            "mlp.shared_expert_gate.weight": (_fixed(1), h),
        })
    else:
        inter = _dim(c, "intermediate_size")
        shapes.update({"mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
                       "mlp.down_proj.weight": (h, inter)})
    return shapes


def _expert_shapes(c: ModelConfig) -> dict[str, tuple[Dim, ...]]:
    """Name under `<layer>.mlp.experts.` -> expected shape, for the fused form and for one expert."""
    e, h, i = _dim(c, "num_experts"), _dim(c, "hidden_size"), _dim(c, "moe_intermediate_size")
    return {"gate_up_proj": (e, _dim(c, "moe_intermediate_size", times=2), h), "down_proj": (e, h, i),
            "gate_proj.weight": (i, h), "up_proj.weight": (i, h), "down_proj.weight": (h, i)}


def _shape_problem(name: str, shape: tuple[int, ...], expected: tuple[Dim, ...]) -> str | None:
    if shape == tuple(v for v, _ in expected):
        return None
    said = ", ".join(f"{label}={v}" for v, label in expected if label != str(v))
    return f"tensor {name} has shape {list(shape)}, expected {[v for v, _ in expected]} ({CONFIG_NAME}: {said})"


def _expert_problems(experts: str, shapes: Mapping[str, tuple[int, ...]], c: ModelConfig) -> list[str]:
    """The routed experts of one MoE layer (`experts` = `<layer>.mlp.experts`): fused gate_up_proj [E, 2I, H]
    (2I even: gate rows, then up rows) with down_proj [E, H, I], or per expert e = 0..E-1 gate/up [I, H] and
    down [H, I]; one form per layer."""
    expected = _expert_shapes(c)
    fused = {m["kind"]: n for n in shapes if (m := FUSED_EXPERTS.match(n)) and m["experts"] == experts}
    per_expert = {n: m for n in shapes if n.endswith(".weight")
                  and (m := PER_EXPERT.match(n.removesuffix(".weight"))) and m["experts"] == experts}
    if fused and per_expert:
        return [f"{experts}: experts stored both fused ({', '.join(sorted(fused))}) and per expert"]
    problems = []
    if fused:
        for kind in ("gate_up_proj", "down_proj"):
            name, shape = f"{experts}.{kind}", shapes.get(f"{experts}.{kind}")
            if shape is None:
                problems.append(f"tensor {name} is missing (its fused partner is there)")
            elif kind == "gate_up_proj" and len(shape) == 3 and shape[1] % 2:
                problems.append(f"tensor {name} has shape {list(shape)}: {shape[1]} rows per expert is odd, so "
                                "they cannot split into gate and up halves")
            elif p := _shape_problem(name, shape, expected[kind]):
                problems.append(p)
        return problems
    indices = sorted({int(m["expert"]) for m in per_expert.values()})
    if not _counts_up(indices, c.num_experts):
        found = f"experts {indices[0]}..{indices[-1]} ({len(indices)} of them)" if indices else "no experts"
        problems.append(f"{experts}: {CONFIG_NAME} says num_experts={c.num_experts}, the checkpoint has {found}")
    for e in indices:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"{experts}.{e}.{proj}.weight"
            if name not in shapes:
                problems.append(f"tensor {name} is missing")
            elif p := _shape_problem(name, shapes[name], expected[f"{proj}.weight"]):
                problems.append(p)
    return problems


def _layers(shapes: Mapping[str, tuple[int, ...]], prefix: str) -> dict[int, dict[str, tuple[int, ...]]]:
    """Layer index -> {name: shape} of the tensors under `prefix` (`...layers.`)."""
    found: dict[int, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        index, dot, _ = name[len(prefix):].partition(".") if name.startswith(prefix) else ("", "", "")
        if dot and index.isdigit():
            found.setdefault(int(index), {})[name] = shape
    return found


def _layer_problems(prefix: str, tensors: Mapping[str, tuple[int, ...]], kind: str, c: ModelConfig,
                    field: str) -> list[str]:
    """One decoder layer (`prefix` = `...layers.<i>.`) against its kind and the config's sizes."""
    other = "self_attn." if kind == LINEAR_ATTENTION else "linear_attn."
    if any(n.startswith(prefix + other) for n in tensors):
        return [f"{prefix.rstrip('.')}: {field} says {kind}, but the layer has {other.rstrip('.')} tensors"]
    problems = []
    for rel, expected in _layer_shapes(c, kind).items():
        name = prefix + rel
        if name not in tensors:
            problems.append(f"tensor {name} is missing ({field} says {kind})")
        elif p := _shape_problem(name, tensors[name], expected):
            problems.append(p)
    if c.is_moe:
        problems += _expert_problems(prefix + "mlp.experts", tensors, c)
    return problems


def _counts_up(indices: list[int], n: int) -> bool:
    """Whether the sorted `indices` are 0..n-1 (without building that range: n comes from the config, unbounded)."""
    return len(indices) == n and indices == list(range(n))


def _index_range(indices: list[int]) -> str:
    return f"layers {indices[0]}..{indices[-1]} ({len(indices)} of them)" if indices else "no layers"


def config_problems(c: ModelConfig, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Every way the tensors (name -> shape, a source's or an artifact's) disagree with the config: decoder layers
    0..num_hidden_layers-1 each with the tensors its layer_types entry needs, in the shapes the sizes give (experts:
    count, fused gate_up_proj halves, per-expert shapes), the MTP head's layers, embeddings and lm_head, and no
    tensor with an empty dimension. One line each, naming the tensor or the field."""
    problems = [f"tensor {shown_name(n)} has shape {list(s)}, with an empty dimension (a Qwen3.5 checkpoint has none)"
                for n, s in shapes.items() if 0 in s]
    if problems:
        return problems
    prefix = text_prefix(shapes)
    layers = _layers(shapes, prefix + "layers.")
    if not _counts_up(sorted(layers), c.num_hidden_layers):
        problems.append(f"{CONFIG_NAME}: num_hidden_layers is {c.num_hidden_layers}, the checkpoint has decoder "
                        f"{_index_range(sorted(layers))}")
    for i, kind in enumerate(c.layer_types):
        if i in layers:
            problems += _layer_problems(f"{prefix}layers.{i}.", layers[i], kind, c, f"layer_types[{i}]")
    h, vocab = _dim(c, "hidden_size"), _dim(c, "vocab_size")
    top = {prefix + "embed_tokens.weight": (vocab, h), prefix + "norm.weight": (h,)}
    if not c.tie_word_embeddings:
        top["lm_head.weight"] = (vocab, h)
    if any(n.startswith(MTP_PREFIX) for n in shapes):
        problems += _mtp_problems(shapes, c)
        top.update({"mtp.fc.weight": (h, _dim(c, "hidden_size", times=2)), "mtp.pre_fc_norm_embedding.weight": (h,),
                    "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)})
    for name, expected in top.items():
        if name not in shapes:
            problems.append(f"tensor {name} is missing")
        elif p := _shape_problem(name, shapes[name], expected):
            problems.append(p)
    return problems


def _mtp_problems(shapes: Mapping[str, tuple[int, ...]], c: ModelConfig) -> list[str]:
    """The MTP head's decoder layers: 0..mtp_num_hidden_layers-1 (any count from 0 when the field is absent),
    each a full-attention layer."""
    layers = _layers(shapes, MTP_PREFIX + "layers.")
    wanted = c.mtp_num_hidden_layers or len(layers)
    if not _counts_up(sorted(layers), wanted):
        return [f"{CONFIG_NAME}: mtp_num_hidden_layers is {c.mtp_num_hidden_layers}, the MTP head has "
                f"{_index_range(sorted(layers))}"]
    problems = []
    for j in sorted(layers):
        problems += _layer_problems(f"{MTP_PREFIX}layers.{j}.", layers[j], FULL_ATTENTION, c, "the MTP head")
    return problems


def check_against_config(folder: Path, c: ModelConfig, shapes: Mapping[str, tuple[int, ...]],
                         error: type[NpuportError] = CheckpointError) -> None:
    """config_problems as one error naming the folder and the first problem (and how many more there are)."""
    problems = config_problems(c, shapes)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise error(f"{folder}: {problems[0]}{more}")


# --- a BF16 source -----------------------------------------------------------------------------------------------


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


def _source_shards(path: Path, blobs: Path | None) -> tuple[list[str], dict[str, str] | None, str]:
    """(shard file names, the index's weight_map or None, what names the shards) of the source at `path`."""
    if (path / INDEX_NAME).exists():
        weight_map = read_weight_map(path, INDEX_NAME, CheckpointError, blobs)
        return sorted(set(weight_map.values())), weight_map, INDEX_NAME
    if (path / SINGLE_NAME).exists():
        return [SINGLE_NAME], None, "the folder"
    raise CheckpointError(f"{path}: neither {INDEX_NAME} nor {SINGLE_NAME} found")


def open_source(path: Path) -> SourceCheckpoint:
    """Read and cross-check config.json, the index and all shard headers of the source at `path`, and the tensors
    against the config. Files must lie inside `path`, or, when `path` is a snapshot of a Hugging Face cache repo
    (`models--Org--Name/snapshots/<rev>`, files symlinked into `../../blobs`), inside that repo's blobs."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a folder")
    if any(p.name.endswith("quant_model_description.json") for p in path.iterdir()):
        raise CheckpointError(f"{path}: this is already a quantized artifact; convert its BF16 source")
    blobs = hub_cache_blobs(path)
    for link in sorted(p.name for p in path.iterdir() if p.is_symlink()):  # tokenizer files etc. are copied too
        file_inside(path, link, "the folder", CheckpointError, must_exist=False, also_inside=blobs)
    config_path = file_inside(path, CONFIG_NAME, "the folder", CheckpointError, also_inside=blobs)
    config = read_json_object(config_path, CheckpointError)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in QWEN35_MODEL_TYPES:
        known = ", ".join(sorted(QWEN35_MODEL_TYPES))
        raise CheckpointError(f"{config_path}: unknown model_type {shown_value(model_type)} (npuport converts {known})")
    sizes = ModelConfig.from_dict(config, str(config_path))
    shard_names, weight_map, what = _source_shards(path, blobs)
    entries = read_tensors(path, shard_names, what, CheckpointError, weight_map, blobs)
    check_against_config(path, sizes, {name: e.shape for name, e in entries.items()})
    return SourceCheckpoint(path, config, model_type, QWEN35_MODEL_TYPES[model_type], entries,
                            [path / s for s in shard_names])

