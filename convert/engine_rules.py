"""What the serving engines assert of a Qwen3.5 model folder (config.json, tokenizer, processor files), as data:
each rule names the engines and the code that asserts it, and its check gives one line per violation naming the
file and the field. `npuport check` applies every rule to BF16 sources and W8A8 artifacts alike; docs/ENGINE_RULES.md
says why each rule holds."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from npuport.convert.qwen35_names import MTP_PREFIX
from npuport.convert.source import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig, shown_value
from npuport.errors import NpuportError
from npuport.jsonfile import read_json_object
from npuport.paths import file_inside, hub_cache_blobs

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
IMAGE_PROCESSOR = "preprocessor_config.json"
VIDEO_PROCESSOR = "video_preprocessor_config.json"

# config.json's model_type -> the architecture the engines build for it (their registries map the name to the class)
ARCHITECTURES = {
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
# the multimodal model_type -> the model_type its text_config must have
TEXT_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
# the config.json field of each vision token id -> the token Qwen's processor writes into the prompt
VISION_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
# processor config field -> the vision_config field it must equal
PROCESSOR_GEOMETRY = {"patch_size": "patch_size", "temporal_patch_size": "temporal_patch_size",
                      "merge_size": "spatial_merge_size"}


@dataclass
class ModelFolder:
    """What the rules read of a model folder: config.json (parsed), the names of its top-level files, its tensors'
    shapes (empty when not read) and, read on first use, its other JSON files and its tokenizer."""

    path: Path
    config: dict[str, Any]
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    _json: dict[str, dict | str | None] = field(default_factory=dict, repr=False)

    @property
    def text(self) -> dict[str, Any]:
        """The text model's config: `text_config` when there is one, else config.json itself."""
        text = self.config.get("text_config")
        return text if isinstance(text, dict) else self.config

    @property
    def multimodal(self) -> bool:
        return isinstance(self.config.get("text_config"), dict) or "vision_config" in self.config

    def name(self, key: str) -> str:
        """How a text-model field is spelt in config.json."""
        return f"text_config.{key}" if self.text is not self.config else key

    def has(self, name: str) -> bool:
        return (self.path / name).is_file()

    def json(self, name: str) -> dict | str | None:
        """The JSON object in the folder's file `name`; None when absent; the one-line reason when unreadable."""
        if name not in self._json:
            if not (self.path / name).exists():
                self._json[name] = None
            else:
                try:
                    path = file_inside(self.path, name, "the folder", also_inside=hub_cache_blobs(self.path))
                    self._json[name] = read_json_object(path)
                except NpuportError as e:
                    self._json[name] = str(e).replace(f"{self.path}/", "").replace(f"{self.path}: ", "")
        return self._json[name]


Check = Callable[[ModelFolder], list[str]]


@dataclass(frozen=True)
class EngineRule:
    """One thing the engines assert of a model folder: its name, the engines that assert it, the code where they
    do, and the check (one line per violation, naming the file and the field)."""

    name: str
    engines: str
    source: str
    check: Check


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _positive(value: object) -> int | None:
    n = _int(value)
    return n if n is not None and n > 0 else None


def _rope(folder: ModelFolder) -> dict[str, Any]:
    """The text model's RoPE settings: `rope_parameters`, or the older plain fields."""
    rope = folder.text.get("rope_parameters")
    if isinstance(rope, dict):
        return rope
    return {k: folder.text[k] for k in ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
            if k in folder.text}


def _rotary_dim(folder: ModelFolder) -> tuple[int, float] | None:
    """(int(head_dim * partial_rotary_factor), partial_rotary_factor), or None when either is not a number."""
    head_dim, factor = _positive(folder.text.get("head_dim")), _rope(folder).get("partial_rotary_factor", 1.0)
    if head_dim is None or not isinstance(factor, int | float) or isinstance(factor, bool):
        return None
    return int(head_dim * factor), factor


# --- the checks ------------------------------------------------------------------------------------------------


def _architecture(folder: ModelFolder) -> list[str]:
    model_type, archs = folder.config.get("model_type"), folder.config.get("architectures")
    wanted = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if wanted is None:
        return [f"{CONFIG}: model_type {shown_value(model_type)} is none of {', '.join(ARCHITECTURES)}"]
    if archs != [wanted]:
        return [f"{CONFIG}: architectures is {shown_value(archs)}, model_type {model_type} needs [{wanted!r}]"]
    return []


def _text_model_type(folder: ModelFolder) -> list[str]:
    model_type = folder.config.get("model_type")
    if model_type not in TEXT_MODEL_TYPES or not isinstance(folder.config.get("text_config"), dict):
        return []  # a text-only config is its own text model: _architecture checks its model_type
    text_type, wanted = folder.text.get("model_type"), TEXT_MODEL_TYPES[model_type]
    if text_type != wanted:
        return [f"{CONFIG}: text_config.model_type is {shown_value(text_type)}, model_type {model_type} needs "
                f"{wanted!r}"]
    return []


def _full_attention_interval(folder: ModelFolder) -> list[str]:
    interval, key = folder.text.get("full_attention_interval"), folder.name("full_attention_interval")
    if _positive(interval) is None:
        return [f"{CONFIG}: {key} must be a positive integer, is {shown_value(interval)} (sglang takes the layer "
                "kinds from it alone)"]
    types, n = folder.text.get("layer_types"), _positive(folder.text.get("num_hidden_layers"))
    if not isinstance(types, list) or n is None or len(types) != n:
        return []  # the source checks report a layer_types list of the wrong length or kind
    pattern = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n)]
    differ = [i for i, (t, p) in enumerate(zip(types, pattern, strict=True)) if t != p]
    if differ:
        return [f"{CONFIG}: {folder.name('layer_types')}[{differ[0]}] is {shown_value(types[differ[0]])}, but "
                f"{key} {interval} makes it {pattern[differ[0]]} ({len(differ)} layer(s) differ; sglang follows "
                f"{key})"]
    return []


def _rotary(folder: ModelFolder) -> list[str]:
    found = _rotary_dim(folder)
    if found is None:
        return []  # the source checks report a missing or malformed head_dim or partial_rotary_factor
    rotary_dim, factor = found
    if not 0 < factor <= 1:
        return [f"{CONFIG}: {folder.name('rope_parameters')}.partial_rotary_factor {factor} must lie in (0, 1]"]
    if rotary_dim < 2 or rotary_dim % 2:
        return [f"{CONFIG}: {folder.name('head_dim')} {folder.text['head_dim']} x partial_rotary_factor {factor} "
                f"gives rotary_dim {rotary_dim}, which must be a positive even number (RoPE rotates pairs)"]
    return []


def _mrope_section(folder: ModelFolder) -> list[str]:
    rope, found = _rope(folder), _rotary_dim(folder)
    if "mrope_section" not in rope or found is None:
        return []
    section, key = rope["mrope_section"], f"{folder.name('rope_parameters')}.mrope_section"
    if not isinstance(section, list) or len(section) != 3 or any(_int(s) is None or s < 0 for s in section):
        return [f"{CONFIG}: {key} must list 3 non-negative integers (temporal, height, width), is "
                f"{shown_value(section)}"]
    rotary_dim, factor = found
    if not 0 < factor <= 1:
        return []  # the rotary-dim rule reports it
    if sum(section) != rotary_dim // 2:
        return [f"{CONFIG}: {key} {section} sums to {sum(section)}, not rotary_dim // 2 = {rotary_dim // 2} "
                f"(head_dim {folder.text['head_dim']} x partial_rotary_factor {factor} = {rotary_dim})"]
    return []


def _mrope_interleaved(folder: ModelFolder) -> list[str]:
    rope = _rope(folder)
    if "mrope_section" in rope and rope.get("mrope_interleaved") is not True:
        return [f"{CONFIG}: {folder.name('rope_parameters')}.mrope_interleaved is "
                f"{shown_value(rope.get('mrope_interleaved'))}, must be true (Qwen3.5 interleaves its M-RoPE "
                "sections; vLLM lays them out in blocks otherwise)"]
    return []


def _divides(folder: ModelFolder, many: str, few: str, what: str) -> list[str]:
    m, f = _positive(folder.text.get(many)), _positive(folder.text.get(few))
    if m is None or f is None or m % f == 0:
        return []
    return [f"{CONFIG}: {folder.name(many)} {m} is not a multiple of {folder.name(few)} {f} ({what})"]


def _attention_heads(folder: ModelFolder) -> list[str]:
    return _divides(folder, "num_attention_heads", "num_key_value_heads", "each key/value head serves a whole "
                    "group of query heads")


def _linear_heads(folder: ModelFolder) -> list[str]:
    return _divides(folder, "linear_num_value_heads", "linear_num_key_heads", "each GatedDeltaNet key head serves "
                    "a whole group of value heads")


def _mtp_head(folder: ModelFolder) -> list[str]:
    if not any(name.startswith(MTP_PREFIX) for name in folder.shapes):
        return []
    layers = folder.text.get("mtp_num_hidden_layers")
    if _positive(layers) is None:
        return [f"{CONFIG}: {folder.name('mtp_num_hidden_layers')} is {shown_value(layers)}, the checkpoint has an "
                "MTP head (mtp.*): vLLM takes the number of draft layers from this field"]
    return []


def _config_reads(folder: ModelFolder) -> bool:
    """Whether config.json holds sizes npuport reads (else check names its problems, and transformers, which the
    tokenizer loads through, would build a model config from it unchecked)."""
    try:
        ModelConfig.from_dict(folder.config)
    except NpuportError:
        return False
    return True


def _tokenizer_files(folder: ModelFolder) -> list[str]:
    problems = []
    if not (folder.has(TOKENIZER) or (folder.has("vocab.json") and folder.has("merges.txt"))):
        problems.append(f"{TOKENIZER}: missing (nor vocab.json + merges.txt): the engines load the tokenizer at "
                        "start-up")
    if not folder.has(TOKENIZER_CONFIG):
        problems.append(f"{TOKENIZER_CONFIG}: missing: the engines load the tokenizer at start-up")
    if not problems and not isinstance(folder.json(TOKENIZER), str) and _config_reads(folder):
        from npuport.tokenizer_folder import check_tokenizer  # the runtime's own reading (imports transformers)

        try:
            check_tokenizer(folder.path)
        except NpuportError as e:
            problems.append(str(e).replace(f"{folder.path}/", "").replace(f"{folder.path}: ", ""))
    return problems


def tokenizer_vocabulary(folder: ModelFolder) -> dict[str, int] | str:
    """token -> id of every token of the folder's tokenizer.json (its model's vocabulary and its added tokens), or
    the one-line reason it cannot be read."""
    data = folder.json(TOKENIZER)
    if not isinstance(data, dict):
        return data or f"{TOKENIZER}: missing"
    vocab: dict[str, int] = {}
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    pieces = model.get("vocab")
    if isinstance(pieces, dict):  # BPE, WordPiece, WordLevel: token -> id
        vocab.update({t: i for t, i in pieces.items() if _int(i) is not None})
    elif isinstance(pieces, list):  # Unigram: [token, score] in id order
        vocab.update({p[0]: i for i, p in enumerate(pieces) if isinstance(p, list) and p and isinstance(p[0], str)})
    for added in data.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("content"), str) and _int(added.get("id")) is not None:
            vocab[added["content"]] = added["id"]
    return vocab


def _tokenizer_fits(folder: ModelFolder) -> list[str]:
    vocab_size = _positive(folder.text.get("vocab_size"))
    vocab = tokenizer_vocabulary(folder) if folder.has(TOKENIZER) else {}
    if isinstance(vocab, str):
        return [vocab]
    if vocab_size is None or not vocab:
        return []
    token, top = max(vocab.items(), key=lambda item: item[1])
    if top >= vocab_size:
        return [f"{TOKENIZER}: token {shown_value(token)} has id {top}, beyond {CONFIG} {folder.name('vocab_size')} "
                f"{vocab_size} (the embedding has no row for it)"]
    return []


def _special_token_ids(folder: ModelFolder) -> list[str]:
    generation = folder.json(GENERATION_CONFIG)
    if isinstance(generation, str):  # unreadable: generate, serve and the engines would refuse it
        return [generation]
    vocab_size = _positive(folder.text.get("vocab_size"))
    if vocab_size is None:
        return []
    scopes = [(CONFIG, folder.name, folder.text)]
    if folder.text is not folder.config:
        scopes.append((CONFIG, str, folder.config))
    if isinstance(generation, dict):
        scopes.append((GENERATION_CONFIG, str, generation))
    problems = []
    for file, spell, scope in scopes:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            ids = scope.get(key)
            for token_id in ids if isinstance(ids, list) else [ids]:
                if token_id is not None and (_int(token_id) is None or not 0 <= token_id < vocab_size):
                    problems.append(f"{file}: {spell(key)} {shown_value(token_id)} is not a token id below "
                                    f"{folder.name('vocab_size')} {vocab_size}")
    return problems


def _vision_token_ids(folder: ModelFolder) -> list[str]:
    if not folder.multimodal:
        return []
    vocab = tokenizer_vocabulary(folder) if folder.has(TOKENIZER) else {}
    problems = [vocab] if isinstance(vocab, str) else []
    vocab = vocab if isinstance(vocab, dict) else {}
    for key, token in VISION_TOKENS.items():
        value, in_tokenizer = folder.config.get(key), vocab.get(token)
        if _int(value) is None:
            problems.append(f"{CONFIG}: {key} must be the id of {token}, is {shown_value(value)}")
        elif vocab and value != in_tokenizer:
            held = "has no such token" if in_tokenizer is None else f"gives it id {in_tokenizer}"
            problems.append(f"{CONFIG}: {key} is {value}, but the tokenizer {held} ({token})")
    return problems


def _processor_files(folder: ModelFolder) -> list[str]:
    if folder.multimodal and not folder.has(IMAGE_PROCESSOR):
        return [f"{IMAGE_PROCESSOR}: missing: vLLM loads the image processor at start-up (else it starts only with "
                "--language-model-only)"]
    return []


def _processor_geometry(folder: ModelFolder) -> list[str]:
    vision = folder.config.get("vision_config")
    if not folder.multimodal or not isinstance(vision, dict):
        return []
    problems = []
    for name in (IMAGE_PROCESSOR, VIDEO_PROCESSOR):
        processor = folder.json(name)
        if isinstance(processor, str):
            problems.append(processor)
            continue
        for key, vision_key in (PROCESSOR_GEOMETRY.items() if processor else ()):
            if processor.get(key) != vision.get(vision_key):
                problems.append(f"{name}: {key} is {shown_value(processor.get(key))}, {CONFIG} "
                                f"vision_config.{vision_key} is {shown_value(vision.get(vision_key))}")
    return problems


def _vision_tower(folder: ModelFolder) -> list[str]:
    vision = folder.config.get("vision_config")
    if not folder.multimodal or not isinstance(vision, dict):
        return []
    problems = []
    out, hidden = vision.get("out_hidden_size"), _positive(folder.text.get("hidden_size"))
    if hidden is not None and out != hidden:
        problems.append(f"{CONFIG}: vision_config.out_hidden_size is {shown_value(out)}, "
                        f"{folder.name('hidden_size')} is {hidden} (image embeddings replace token embeddings)")
    width, heads = _positive(vision.get("hidden_size")), _positive(vision.get("num_heads"))
    if width is not None and heads is not None and width % heads:
        problems.append(f"{CONFIG}: vision_config.hidden_size {width} is not a multiple of vision_config.num_heads "
                        f"{heads}")
    positions = _positive(vision.get("num_position_embeddings"))
    if positions is not None and math.isqrt(positions) ** 2 != positions:
        problems.append(f"{CONFIG}: vision_config.num_position_embeddings {positions} is not a square (the position "
                        "embeddings form a square grid)")
    return problems


VLLM_QWEN35 = "vllm model_executor/models/qwen3_5.py"
RULES: tuple[EngineRule, ...] = (
    EngineRule("architecture", "vLLM, sglang, transformers",
               "vllm model_executor/models/registry.py; sglang srt/models/qwen3_5.py (EntryClass); transformers "
               "models/auto", _architecture),
    EngineRule("text-model-type", "vLLM", f"{VLLM_QWEN35} (Qwen3_5DecoderLayer: 'Invalid model_type')",
               _text_model_type),
    EngineRule("full-attention-interval", "sglang",
               "sglang srt/configs/qwen3_next.py (Qwen3NextConfig.layers_block_type)", _full_attention_interval),
    EngineRule("rotary-dim", "vLLM, sglang", "vllm model_executor/layers/rotary_embedding/__init__.py (get_rope)",
               _rotary),
    EngineRule("mrope-section", "vLLM, sglang",
               "vllm model_executor/layers/rotary_embedding/mrope.py (MRotaryEmbedding asserts the sum); sglang "
               "srt/layers/rotary_embedding.py (the same assert)", _mrope_section),
    EngineRule("mrope-interleaved", "vLLM",
               "vllm model_executor/layers/rotary_embedding/__init__.py (mrope_interleaved defaults to false); "
               "transformers models/qwen3_5/modeling_qwen3_5.py (always interleaved)", _mrope_interleaved),
    EngineRule("attention-heads", "vLLM", "vllm attention/layer.py (Attention asserts num_heads % num_kv_heads == "
               "0); vllm model_executor/models/qwen3_next.py (Qwen3NextAttention)", _attention_heads),
    EngineRule("linear-heads", "vLLM, sglang, transformers",
               "vllm model_executor/layers/mamba/gdn_linear_attn.py; vllm csrc/cpu/sgl-kernels/fla.cpp "
               "(CHECK_EQ(v_num_heads % num_heads, 0)); transformers modeling_qwen3_5.py (repeat_interleave)",
               _linear_heads),
    EngineRule("mtp-head", "vLLM", "vllm config/speculative.py (n_predict from mtp_num_hidden_layers); "
               "vllm model_executor/models/qwen3_5_mtp.py", _mtp_head),
    EngineRule("tokenizer-files", "vLLM, sglang", "AutoTokenizer.from_pretrained at server start-up",
               _tokenizer_files),
    EngineRule("tokenizer-fits-vocab", "vLLM, sglang",
               "vllm model_executor/layers/vocab_parallel_embedding.py (one row per token id)", _tokenizer_fits),
    EngineRule("special-token-ids", "vLLM, transformers",
               "transformers configuration_utils.py (validate_token_ids); vLLM stops on generation_config's "
               "eos_token_id", _special_token_ids),
    EngineRule("vision-token-ids", "vLLM, sglang, transformers",
               "transformers models/qwen3_vl/processing_qwen3_vl.py (looks the tokens up in the tokenizer); vllm "
               "model_executor/models/qwen3_vl.py (placeholders by token, M-RoPE positions by config id)",
               _vision_token_ids),
    EngineRule("processor-files", "vLLM", "vllm model_executor/models/qwen3_vl.py (Qwen3VLProcessingInfo loads "
               "the Hugging Face processor to profile images at start-up)", _processor_files),
    EngineRule("processor-geometry", "vLLM, sglang, transformers",
               "transformers models/qwen2_vl/image_processing_qwen2_vl.py (defaults: patch 14, not Qwen3.5's); "
               "vllm model_executor/models/qwen3_vl.py (patch embedding)", _processor_geometry),
    EngineRule("vision-tower", "vLLM, transformers",
               "vllm model_executor/models/qwen3_vl.py (Qwen3_VisionTransformer); transformers "
               "modeling_qwen3_5.py (Qwen3_5VisionModel)", _vision_tower),
)


def engine_problems(path: Path, config: dict[str, Any],
                    shapes: Mapping[str, tuple[int, ...]] | None = None) -> list[str]:
    """Every engine rule the model folder `path` (its parsed config.json, its tensors' shapes) breaks: one line
    each, naming the file and the field, ending with the rule's name."""
    folder = ModelFolder(Path(path), config, shapes or {})
    return [f"{line} [engine rule {rule.name}]" for rule in RULES for line in rule.check(folder)]
