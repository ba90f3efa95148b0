"""The sizes of a Qwen3.5 text model, read from config.json (its `text_config` when there is one)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from npuport.errors import CheckpointError
from npuport.jsonfile import read_json_object

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class ModelConfig:
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
    def from_dict(cls, config: dict, where: str = "config.json") -> ModelConfig:
        text = config.get("text_config") or config

        def get(key: str, default: object = ...) -> object:
            if key in text:
                return text[key]
            if key in config:
                return config[key]
            if default is ...:
                raise CheckpointError(f"{where}: missing {key!r}")
            return default

        if get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{where}: hidden_act {get('hidden_act')!r} is not supported (Qwen3.5 uses silu)")
        n_layers = int(get("num_hidden_layers"))
        interval = int(get("full_attention_interval", 4))
        default_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n_layers)]
        layer_types = tuple(get("layer_types", None) or default_types)
        if len(layer_types) != n_layers or set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION}:
            raise CheckpointError(f"{where}: layer_types must list {n_layers} of {FULL_ATTENTION}/{LINEAR_ATTENTION}")
        rope = get("rope_parameters", None) or {}
        num_experts = int(get("num_experts", 0) or 0)
        return cls(
            vocab_size=int(get("vocab_size")),
            hidden_size=int(get("hidden_size")),
            num_hidden_layers=n_layers,
            layer_types=layer_types,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            num_attention_heads=int(get("num_attention_heads")),
            num_key_value_heads=int(get("num_key_value_heads")),
            head_dim=int(get("head_dim")),
            rope_theta=float(rope.get("rope_theta", get("rope_theta", 10000000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", get("partial_rotary_factor", 0.25))),
            linear_num_key_heads=int(get("linear_num_key_heads")),
            linear_num_value_heads=int(get("linear_num_value_heads")),
            linear_key_head_dim=int(get("linear_key_head_dim")),
            linear_value_head_dim=int(get("linear_value_head_dim")),
            linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
            intermediate_size=0 if num_experts else int(get("intermediate_size")),
            num_experts=num_experts,
            num_experts_per_tok=int(get("num_experts_per_tok")) if num_experts else 0,
            moe_intermediate_size=int(get("moe_intermediate_size")) if num_experts else 0,
            shared_expert_intermediate_size=int(get("shared_expert_intermediate_size")) if num_experts else 0,
            mtp_num_hidden_layers=int(get("mtp_num_hidden_layers", 0) or 0),
        )


def load_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    return ModelConfig.from_dict(read_json_object(path, CheckpointError), str(path))
