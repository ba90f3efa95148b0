"""Text completions on the built-in runtime as an OpenAI-compatible server returns them: prompts through the
model folder's tokenizer, batched generation, and the decoded text cut at the first stop string."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from npuport.errors import NpuportError
from npuport.jsonfile import read_json_object
from npuport.runtime.generate import AcceptanceStats, generate, use_invariance
from npuport.runtime.loader import load_model
from npuport.runtime.model import Qwen35
from npuport.runtime.sampling import SamplingParams
from npuport.runtime.textgen import DTYPES, load_tokenizer, stop_token_ids
from npuport.runtime.validation.endpoint import EndpointBatch, EndpointCompletion
from npuport.runtime.validation.gsm8k import cut_at_stop

Decode = Callable[[Sequence[int]], str]


def _holds_stop(text: str, stop: Sequence[str]) -> bool:
    return any(s in text for s in stop)


def finish_completion(tokens: Sequence[int], decode: Decode, stop: Sequence[str],
                      stop_tokens: frozenset[int]) -> EndpointCompletion:
    """The completion a server that checks stop strings after every token returns for the generated `tokens`:
    it stops at the fewest tokens whose decoded text holds a stop string and answers that text cut before
    its earliest stop string (finish "stop"); without a stop string, all of the text, finish "stop" when the
    last token is a stop token (EOS) and "length" otherwise. `completion_tokens` counts the tokens it
    generated. Found by bisection: the text of a prefix of the tokens is a prefix of the text."""
    text = decode(tokens)
    if not _holds_stop(text, stop):
        reason = "stop" if tokens and tokens[-1] in stop_tokens else "length"
        return EndpointCompletion(text, len(tokens), reason)
    low, high = 1, len(tokens)  # the fewest tokens holding a stop string lie in [low, high]
    while low < high:
        mid = (low + high) // 2
        if _holds_stop(decode(tokens[:mid]), stop):
            high = mid
        else:
            low = mid + 1
    return EndpointCompletion(cut_at_stop(decode(tokens[:low]), stop), low, "stop")


def context_tokens_of(path: Path) -> int | None:
    """The model's context in tokens: `max_position_embeddings` of config.json (its `text_config` first, as
    ModelConfig reads the sizes); None when it states none."""
    config = read_json_object(path / "config.json")
    for section in (config.get("text_config") or {}, config):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def merge_acceptance(parts: Sequence[AcceptanceStats]) -> AcceptanceStats | None:
    """The statistics of several batches as one (their requests side by side); None for no batch."""
    if not parts:
        return None
    return AcceptanceStats(parts[0].k, [r for p in parts for r in p.rounds], [a for p in parts for a in p.accepted],
                           [row for p in parts for row in p.accepted_at])


@dataclass(frozen=True)
class RuntimeBatch(EndpointBatch):
    """What EndpointBatch holds, plus what only the runtime knows: each prompt's token ids, every generated
    token (before stop strings cut the text) and the MTP acceptance statistics (None without MTP)."""

    prompt_ids: list[list[int]]
    token_ids: list[list[int]]
    acceptance: AcceptanceStats | None


class RuntimeCompletions:
    """Completes text prompts with a loaded model: `batch_size` prompts per `generate` call, in order, with
    `mtp` draft tokens per round (0: plain decoding). The same `complete` signature as CompletionsEndpoint,
    so a GSM8K run does not care which one it drives. `context_tokens`: the model's context (None: unknown),
    for callers that bound prompt + max_tokens by it. invariant: batch-invariant steps (generate's; None: its
    default)."""

    def __init__(self, model: Qwen35, tokenizer, stop_tokens: Sequence[int] = (), *, batch_size: int = 1,
                 mtp: int = 0, context_tokens: int | None = None, invariant: bool | None = None) -> None:
        if batch_size < 1:
            raise NpuportError(f"batch size must be at least 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.stop_tokens = frozenset(stop_tokens)
        self.batch_size = batch_size
        self.mtp = mtp
        self.context_tokens = context_tokens
        self.invariant = use_invariance(model, invariant)  # resolved once: every rank of a split model is told

    @classmethod
    def load(cls, path: Path | str, *, device: torch.device | str | None = None, dtype: str = "bfloat16",
             batch_size: int = 1, mtp: int = 0, invariant: bool | None = None) -> RuntimeCompletions:
        """The model folder `path` (BF16 source or W8A8 artifact) with its own tokenizer and EOS ids."""
        path = Path(path)
        if dtype not in DTYPES:
            raise NpuportError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        tokenizer = load_tokenizer(path)
        if tokenizer is None:
            raise NpuportError(f"{path} has no tokenizer (tokenizer.json / tokenizer_config.json); text prompts "
                               "need one")
        model = load_model(path, device, DTYPES[dtype])
        return cls(model, tokenizer, stop_token_ids(path), batch_size=batch_size, mtp=mtp,
                   context_tokens=context_tokens_of(path), invariant=invariant)

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of generated tokens, special tokens (EOS) left out, as the servers answer by default."""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def complete(self, prompts: Sequence[str], *, max_tokens: int, stop: Sequence[str] = (),
                 sampling: SamplingParams | None = None,
                 progress: Callable[[int], None] | None = None) -> RuntimeBatch:
        """Complete every prompt (greedy unless `sampling` says otherwise); `progress(done)` after each batch.
        `latency_s` is the wall time of generation and decoding, tokenization excluded."""
        return self.complete_ids([self.encode(p) for p in prompts], max_tokens=max_tokens, stop=stop,
                                 sampling=sampling, progress=progress)

    def complete_ids(self, prompt_ids: Sequence[list[int]], *, max_tokens: int, stop: Sequence[str] = (),
                     sampling: SamplingParams | None = None,
                     progress: Callable[[int], None] | None = None) -> RuntimeBatch:
        """`complete` for prompts already tokenized (e.g. by a server that checks their length first)."""
        prompt_ids = [list(ids) for ids in prompt_ids]
        tokens: list[list[int]] = []
        stats: list[AcceptanceStats] = []
        start = time.perf_counter()
        for first in range(0, len(prompt_ids), self.batch_size):
            result = generate(self.model, prompt_ids[first:first + self.batch_size], max_tokens, mtp=self.mtp,
                              sampling=sampling, stop_tokens=self.stop_tokens, invariant=self.invariant,
                              should_stop=(lambda toks: _holds_stop(self.decode(toks), stop)) if stop else None)
            tokens += result.tokens
            if result.stats is not None:
                stats.append(result.stats)
            if progress is not None:
                progress(len(tokens))
        completions = [finish_completion(t, self.decode, stop, self.stop_tokens) for t in tokens]
        latency = time.perf_counter() - start
        return RuntimeBatch(completions, latency, prompt_ids, tokens, merge_acceptance(stats))
