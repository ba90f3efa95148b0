"""A model folder's tokenizer read as generate, serve and validate read it - and as `npuport check` checks it, so that
a folder check passes is one they load: each JSON file within npuport's bounds first, then transformers'
AutoTokenizer, then a one-message conversation through the chat template. A shared helper: the runtime and the
converter's checks both use it."""

from __future__ import annotations

from pathlib import Path

from npuport.chat_prompt import render_chat_prompt
from npuport.errors import NpuportError
from npuport.jsonfile import read_json_object

# No model comes near this many decoder layers (Qwen3.5's largest has 60, Qwen3.8-2.4T-A95B 92); a count beyond it
# is a damaged config, refused before anything is built that long.
MAX_LAYERS = 100_000


def _config_to_build(model_dir: Path) -> None:
    """AutoTokenizer first builds the model's config from config.json - a list as long as num_hidden_layers says
    (10**12 took all memory) - with the last value of a key given twice: read it within npuport's bounds first,
    and refuse a layer count no model comes near."""
    path = model_dir / "config.json"
    if not path.exists():
        return
    config = read_json_object(path)
    for section, name in ((config, "num_hidden_layers"), (config.get("text_config"), "text_config.num_hidden_layers")):
        layers = section.get("num_hidden_layers") if isinstance(section, dict) else None
        if isinstance(layers, int) and not isinstance(layers, bool) and layers > MAX_LAYERS:
            raise NpuportError(f"{path}: {name} is {layers}, more than the {MAX_LAYERS:,} layers any model comes "
                               "near")


def load_tokenizer(model_dir: Path):
    """The folder's tokenizer (transformers), or None when it has none. A damaged tokenizer file is one NpuportError
    naming it (or, where the tokenizers library refuses it, the folder)."""
    if not any((Path(model_dir) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    _config_to_build(Path(model_dir))
    for name in TOKENIZER_JSON_FILES:
        if (Path(model_dir) / name).exists():  # transformers reads them unchecked: a list, deep nesting: a traceback;
            read_json_object(Path(model_dir) / name)  # a key twice: the last value, without a word
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # the tokenizers library raises a bare Exception for a tokenizer.json it cannot build
        first_line = (str(e).strip().splitlines() or [""])[0][:200]
        raise NpuportError(f"{model_dir}: the tokenizer does not load ({type(e).__name__}: {first_line})") from None


# What AutoTokenizer reads of a model folder as JSON, each read first within npuport's bounds (jsonfile).
TOKENIZER_JSON_FILES = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json",
                        "chat_template.json")
PROBE_CONVERSATION = [{"role": "user", "content": "What is 1 + 1?"}]


def check_tokenizer(model_dir: Path) -> None:
    """Read the folder's tokenizer as generate, serve and validate will - load_tokenizer, then, where it has a chat
    template, a one-message conversation rendered within the bounds serve and validate render with
    (render_chat_prompt) - raising the NpuportError they would. `npuport check` calls it."""
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        render_chat_prompt(tokenizer, PROBE_CONVERSATION)


