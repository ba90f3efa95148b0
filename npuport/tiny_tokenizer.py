"""A small byte-level BPE tokenizer trained on the GSM8K train split, deterministically, with Qwen's
special tokens and chat template: the real file layout of a Qwen3.5 tokenizer at a few hundred KB."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from npuport.runtime.gsm8k import load_records, solved_example

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def gsm8k_train_texts() -> list[str]:
    """Question + worked answer of every GSM8K train record, as plain text, in file order."""
    return [solved_example(r) for r in load_records(split="train")]


@lru_cache(maxsize=4)
def _train(vocab_size: int) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(gsm8k_train_texts(), trainer=trainer)
    return tok.to_str()


def write_tokenizer(out: Path, vocab_size: int) -> int:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into `out`.
    Returns the number of tokens (at most `vocab_size`)."""
    tok = Tokenizer.from_str(_train(vocab_size))
    (out / "tokenizer.json").write_text(_train(vocab_size), encoding="utf-8")
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_prefix_space": False,
        "model_max_length": 262144,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                      "normalized": False, "single_word": False}
            for t in SPECIAL_TOKENS
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return tok.get_vocab_size()


def special_token_id(out: Path, token: str) -> int:
    return Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id(token)
