"""`npuport make-tiny`: deterministic Qwen3.5 checkpoints with the real architecture and file layout
(config, sharded safetensors with index, tokenizer, MTP head), from a few MB (CI) to a few GB (benchmarks).

Every tensor is drawn from its own generator seeded by (seed, tensor name), so a checkpoint is the same
bytes however it is sharded, and it is written one tensor at a time (bounded memory at any size).
"""

from __future__ import annotations

import json
import math
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from npuport.convert.qwen35_names import MULTIMODAL_TEXT_PREFIX, TEXT_ONLY_PREFIX, VISUAL_PREFIX
from npuport.convert.safetensors_io import DTYPE_NAMES, OutSpec, ShardWriter
from npuport.tiny_tokenizer import ENDOFTEXT, IM_END, special_token_id, write_tokenizer

TOKENIZER_VOCAB = 2048


@dataclass(frozen=True)
class Sizes:
    """The sizes of a preset; field names follow the `text_config` keys they become."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    vocab_size: int
    vision_depth: int
    vision_hidden: int
    shards: int


# Proportions follow the real models (QWEN35.md): GDN/full 3:1, K = V head dims equal, HV = 2-3 x H,
# dense intermediate ~3.4 x hidden, MoE experts 1/4 of hidden. "mid" is a few GB of BF16.
PRESETS: dict[str, Sizes] = {
    "tiny": Sizes(64, 4, 4, 2, 32, 2, 4, 16, 16, 192, 8, 2, 32, 32, TOKENIZER_VOCAB, 1, 32, 3),
    "small": Sizes(512, 8, 8, 2, 128, 4, 8, 64, 64, 1728, 16, 4, 128, 128, TOKENIZER_VOCAB, 1, 64, 3),
    "mid": Sizes(2048, 12, 16, 4, 256, 16, 32, 128, 128, 6912, 32, 8, 512, 512, 248320, 2, 256, 4),
    # `npuport train-tiny` (train_tiny.py): wide enough to learn GSM8K text, a few MB / ~100M parameters.
    "trained-tiny": Sizes(128, 4, 4, 2, 32, 2, 4, 32, 32, 384, 8, 2, 64, 64, TOKENIZER_VOCAB, 1, 32, 3),
    "trained-small": Sizes(768, 8, 6, 2, 128, 4, 8, 128, 128, 3072, 16, 4, 192, 768, TOKENIZER_VOCAB, 1, 64, 3),
}


@dataclass(frozen=True)
class TinySpec:
    arch: str = "dense"  # dense | moe
    layout: str = "multimodal"  # multimodal | text
    mtp_experts: str = "fused"  # fused | per-expert (MoE MTP layer only)
    size: str = "tiny"
    seed: int = 0
    tie_word_embeddings: bool = False


def layer_types(n: int, interval: int = 4) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def text_config(spec: TinySpec, vocab_size: int, eos_id: int, pad_id: int) -> dict:
    s = PRESETS[spec.size]
    cfg = {
        "model_type": "qwen3_5_moe_text" if spec.arch == "moe" else "qwen3_5_text",
        "vocab_size": vocab_size,
        "hidden_size": s.hidden_size,
        "num_hidden_layers": s.num_hidden_layers,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "linear_conv_kernel_dim": 4,
        "linear_num_key_heads": s.linear_num_key_heads,
        "linear_num_value_heads": s.linear_num_value_heads,
        "linear_key_head_dim": s.linear_key_head_dim,
        "linear_value_head_dim": s.linear_value_head_dim,
        "layer_types": layer_types(s.num_hidden_layers),
        "full_attention_interval": 4,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "use_cache": True,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "bos_token_id": None,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "dtype": "bfloat16",
    }
    if spec.arch == "moe":
        cfg.update(
            num_experts=s.num_experts,
            num_experts_per_tok=s.num_experts_per_tok,
            moe_intermediate_size=s.moe_intermediate_size,
            shared_expert_intermediate_size=s.shared_expert_intermediate_size,
            norm_topk_prob=True,
            router_aux_loss_coef=0.001,
            output_router_logits=False,
        )
    else:
        cfg["intermediate_size"] = s.intermediate_size
    return cfg


def vision_config(spec: TinySpec) -> dict:
    s = PRESETS[spec.size]
    return {
        "model_type": "qwen3_5_moe_vision" if spec.arch == "moe" else "qwen3_5_vision",
        "depth": s.vision_depth,
        "hidden_size": s.vision_hidden,
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": 2 * s.vision_hidden,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": s.hidden_size,
        "num_position_embeddings": 16,
        "initializer_range": 0.02,
    }


def full_config(spec: TinySpec, vocab_size: int, eos_id: int, pad_id: int) -> dict:
    text = text_config(spec, vocab_size, eos_id, pad_id)
    if spec.layout == "text":
        arch = "Qwen3_5MoeForCausalLM" if spec.arch == "moe" else "Qwen3_5ForCausalLM"
        return {"architectures": [arch], **text, "transformers_version": "5.23.0"}
    arch = "Qwen3_5MoeForConditionalGeneration" if spec.arch == "moe" else "Qwen3_5ForConditionalGeneration"
    return {
        "architectures": [arch],
        "model_type": "qwen3_5_moe" if spec.arch == "moe" else "qwen3_5",
        "text_config": text,
        "vision_config": vision_config(spec),
        "image_token_id": vocab_size - 1,
        "video_token_id": vocab_size - 2,
        "vision_start_token_id": vocab_size - 3,
        "vision_end_token_id": vocab_size - 4,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "transformers_version": "5.23.0",
    }


def _decoder_layer(p: str, s: Sizes, full_attention: bool, moe: bool, experts: str) -> list[tuple[str, tuple]]:
    """(name, shape) of one decoder layer under prefix `p` (ending in '.')."""
    h = s.hidden_size
    out: list[tuple[str, tuple]] = []
    if full_attention:
        q, kv = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
        out += [
            (p + "self_attn.q_proj.weight", (2 * q, h)),  # per head: [q | gate]
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "self_attn.q_norm.weight", (s.head_dim,)),
            (p + "self_attn.k_norm.weight", (s.head_dim,)),
        ]
    else:
        hk, hv = s.linear_num_key_heads, s.linear_num_value_heads
        kd, vd = s.linear_key_head_dim, s.linear_value_head_dim
        conv_dim = 2 * hk * kd + hv * vd
        out += [
            (p + "linear_attn.dt_bias", (hv,)),
            (p + "linear_attn.A_log", (hv,)),
            (p + "linear_attn.conv1d.weight", (conv_dim, 1, 4)),
            (p + "linear_attn.norm.weight", (vd,)),
            (p + "linear_attn.out_proj.weight", (h, hv * vd)),
            (p + "linear_attn.in_proj_qkv.weight", (conv_dim, h)),
            (p + "linear_attn.in_proj_z.weight", (hv * vd, h)),
            (p + "linear_attn.in_proj_b.weight", (hv, h)),
            (p + "linear_attn.in_proj_a.weight", (hv, h)),
        ]
    if moe:
        e, i, si = s.num_experts, s.moe_intermediate_size, s.shared_expert_intermediate_size
        out.append((p + "mlp.gate.weight", (e, h)))
        if experts == "fused":
            out += [(p + "mlp.experts.gate_up_proj", (e, 2 * i, h)), (p + "mlp.experts.down_proj", (e, h, i))]
        else:
            for x in range(e):
                out += [
                    (p + f"mlp.experts.{x}.gate_proj.weight", (i, h)),
                    (p + f"mlp.experts.{x}.up_proj.weight", (i, h)),
                    (p + f"mlp.experts.{x}.down_proj.weight", (h, i)),
                ]
        out += [
            (p + "mlp.shared_expert.gate_proj.weight", (si, h)),
            (p + "mlp.shared_expert.up_proj.weight", (si, h)),
            (p + "mlp.shared_expert.down_proj.weight", (h, si)),
            (p + "mlp.shared_expert_gate.weight", (1, h)),
        ]
    else:
        out += [
            (p + "mlp.gate_proj.weight", (s.intermediate_size, h)),
            (p + "mlp.up_proj.weight", (s.intermediate_size, h)),
            (p + "mlp.down_proj.weight", (h, s.intermediate_size)),
        ]
    out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    return out


def _visual(s: Sizes) -> list[tuple[str, tuple]]:
    v, p = s.vision_hidden, "model.visual."
    out: list[tuple[str, tuple]] = [
        (p + "patch_embed.proj.weight", (v, 3, 2, 4, 4)),
        (p + "patch_embed.proj.bias", (v,)),
        (p + "pos_embed.weight", (16, v)),
    ]
    for b in range(s.vision_depth):
        q = f"{p}blocks.{b}."
        out += [
            (q + "norm1.weight", (v,)), (q + "norm1.bias", (v,)),
            (q + "norm2.weight", (v,)), (q + "norm2.bias", (v,)),
            (q + "attn.qkv.weight", (3 * v, v)), (q + "attn.qkv.bias", (3 * v,)),
            (q + "attn.proj.weight", (v, v)), (q + "attn.proj.bias", (v,)),
            (q + "mlp.linear_fc1.weight", (2 * v, v)), (q + "mlp.linear_fc1.bias", (2 * v,)),
            (q + "mlp.linear_fc2.weight", (v, 2 * v)), (q + "mlp.linear_fc2.bias", (v,)),
        ]
    out += [
        (p + "merger.norm.weight", (v,)), (p + "merger.norm.bias", (v,)),
        (p + "merger.linear_fc1.weight", (4 * v, 4 * v)), (p + "merger.linear_fc1.bias", (4 * v,)),
        (p + "merger.linear_fc2.weight", (s.hidden_size, 4 * v)), (p + "merger.linear_fc2.bias", (s.hidden_size,)),
    ]
    return out


def tensor_shapes(spec: TinySpec, vocab_size: int) -> list[tuple[str, tuple]]:
    """Every tensor of the checkpoint as (name, shape), in the order they are written."""
    s = PRESETS[spec.size]
    moe = spec.arch == "moe"
    tp = MULTIMODAL_TEXT_PREFIX if spec.layout == "multimodal" else TEXT_ONLY_PREFIX
    out: list[tuple[str, tuple]] = _visual(s) if spec.layout == "multimodal" else []
    out.append((tp + "embed_tokens.weight", (vocab_size, s.hidden_size)))
    for i, kind in enumerate(layer_types(s.num_hidden_layers)):
        out += _decoder_layer(f"{tp}layers.{i}.", s, kind == "full_attention", moe, "fused")
    out.append((tp + "norm.weight", (s.hidden_size,)))
    if not spec.tie_word_embeddings:
        out.append(("lm_head.weight", (vocab_size, s.hidden_size)))
    h = s.hidden_size
    out += [
        ("mtp.fc.weight", (h, 2 * h)),
        ("mtp.pre_fc_norm_embedding.weight", (h,)),
        ("mtp.pre_fc_norm_hidden.weight", (h,)),
        ("mtp.norm.weight", (h,)),
    ]
    out += _decoder_layer("mtp.layers.0.", s, True, moe, spec.mtp_experts)
    return out


def _init(name: str, shape: tuple, seed: int) -> torch.Tensor:
    """Deterministic values for one tensor, drawn in float32 and rounded to BF16."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    leaf = name.rsplit(".", 2)
    if name.endswith("A_log"):
        x = torch.log(torch.rand(shape, generator=g) * 15 + 1)
    elif name.endswith("dt_bias"):
        x = 1 + 0.1 * torch.randn(shape, generator=g)
    elif name.endswith("linear_attn.norm.weight") or name.endswith("norm1.weight") or name.endswith("norm2.weight") \
            or name.endswith("merger.norm.weight"):
        x = 1 + 0.1 * torch.randn(shape, generator=g)  # plain `w` norms
    elif len(shape) == 1:
        x = 0.1 * torch.randn(shape, generator=g)  # `(1 + w)` RMSNorms and biases
    elif "embed" in leaf[-2] or name == "lm_head.weight":  # logits of order 1, also with tied embeddings
        x = torch.randn(shape, generator=g) / math.sqrt(shape[1])
    else:
        fan_in = math.prod(shape[1:]) if len(shape) != 3 or "experts" not in name else shape[-1]
        x = torch.randn(shape, generator=g) / math.sqrt(fan_in)
    return x.to(torch.bfloat16)


def _split_shards(shapes: list[tuple[str, tuple]], n: int) -> list[list[tuple[str, tuple]]]:
    total = sum(2 * math.prod(s) for _, s in shapes)
    target, shards, cur, size = total / n, [], [], 0
    for item in shapes:
        cur.append(item)
        size += 2 * math.prod(item[1])
        if size >= target * (len(shards) + 1) and len(shards) < n - 1:
            shards.append(cur)
            cur = []
    shards.append(cur)
    return [s for s in shards if s]


TensorValues = Callable[[str, tuple], torch.Tensor]


def make_tiny(out: Path, spec: TinySpec, progress: Callable[[str], None] | None = None,
              weights: TensorValues | None = None) -> Path:
    """Write the checkpoint described by `spec` into the new folder `out` (written to a temporary
    folder beside it, renamed when complete). `weights(name, shape)` gives the BF16 value of each tensor of
    the text model and MTP head (default: deterministic random values); the vision tower is always random."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write(tmp, spec, progress, weights)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_metadata(out: Path, spec: TinySpec) -> dict:
    """Write the tokenizer, config.json and generation_config.json of `spec` into the folder `out`;
    returns the config."""
    n_tokens = write_tokenizer(out, TOKENIZER_VOCAB)
    vocab = max(PRESETS[spec.size].vocab_size, n_tokens)
    eos, pad = special_token_id(out, IM_END), special_token_id(out, ENDOFTEXT)
    config = full_config(spec, vocab, eos, pad)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    gen = {"bos_token_id": None, "eos_token_id": [eos, pad], "pad_token_id": pad, "do_sample": False,
           "transformers_version": "5.23.0"}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")
    return config


def _write(out: Path, spec: TinySpec, progress: Callable[[str], None] | None, weights: TensorValues | None) -> None:
    sizes = PRESETS[spec.size]
    config = write_metadata(out, spec)
    vocab = (config.get("text_config") or config)["vocab_size"]
    shapes = tensor_shapes(spec, vocab)
    shards = _split_shards(shapes, sizes.shards)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        specs = [OutSpec(n, DTYPE_NAMES[torch.bfloat16], tuple(s)) for n, s in shard]
        w = ShardWriter(out / fname, specs, {"format": "pt"})
        for name, shape in shard:
            own = weights is not None and not name.startswith(VISUAL_PREFIX)
            w.write(name, weights(name, shape) if own else _init(name, shape, spec.seed))
            weight_map[name] = fname
            total += 2 * math.prod(shape)
        w.close()
        if progress:
            progress(f"wrote {fname} ({len(shard)} tensors)")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
