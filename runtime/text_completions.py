"""Text completions on the built-in runtime as an OpenAI-compatible server returns them: prompts through the
model folder's tokenizer, batched generation (each request with its own limit and stop strings), the decoded text
cut at the first stop string, and the log-probabilities of prompt and completion tokens. What the validator drives
(runtime.validation) and the server serves (runtime.serving)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from npuport.errors import NpuportError
from npuport.runtime import slots
from npuport.runtime.completion import LENGTH, STOP, Completion, CompletionBatch, stop_at, stop_token_end
from npuport.runtime.generate import AcceptanceStats, TokenSink, generate
from npuport.runtime.incremental_text import StopStrings
from npuport.runtime.loader import load_model
from npuport.runtime.model import Qwen35
from npuport.runtime.run_options import run_options
from npuport.runtime.sampling import SamplingParams
from npuport.runtime.textgen import DTYPES, context_tokens_of, load_tokenizer, stop_token_ids
from npuport.runtime.token_logprobs import PositionLogprobs, sequence_logprobs

Decode = Callable[[Sequence[int]], str]
Interruption = Callable[[int, int], bool]  # (row, tokens this call made for it) -> end it now, unfinished


def finish_completion(tokens: Sequence[int], decode: Decode, stop: Sequence[str], stop_tokens: frozenset[int],
                      min_tokens: int = 0, include_stop: bool = False) -> Completion:
    """The completion a server that checks stop strings after every token returns for the generated `tokens`:
    they end at their first stop token past the first min_tokens (finish "stop"; the token counts, its text is
    not in the answer unless include_stop), else at their end ("length"); and at the fewest tokens whose decoded
    text holds a stop string ending past the text of the first min_tokens tokens, the answer then cut before that
    string (after it with include_stop; finish "stop"). `completion_tokens` counts the tokens it generated. Found
    by bisection: the text of a prefix of the tokens is a prefix of the text. As vLLM's `min_tokens`,
    `include_stop_str_in_output` and `stop_token_ids` (with the model's EOS ids, unless `ignore_eos`) read."""
    tokens = list(tokens)
    end = stop_token_end(tokens, stop_tokens, min_tokens)
    if end is not None:
        tokens = tokens[:end]
    shown = tokens if end is None or include_stop else tokens[:-1]
    after = len(decode(shown[:min_tokens])) if min_tokens and stop else 0
    text = decode(shown)
    if stop_at(text, stop, after) is None:
        return Completion(text, len(tokens), LENGTH if end is None else STOP)
    low, high = 1, len(shown)  # the fewest tokens holding a stop string lie in [low, high]
    while low < high:
        mid = (low + high) // 2
        if stop_at(decode(shown[:mid]), stop, after) is not None:
            high = mid
        else:
            low = mid + 1
    text = decode(shown[:low])
    i, s = stop_at(text, stop, after)
    return Completion(text[:i + len(s)] if include_stop else text[:i], low, STOP)


def only_reads(tokenizer) -> None:
    """Leave `tokenizer` in the state in which encode and decode only read it, so that several threads may call
    them at once with none waiting for another: a tokenizers-backed (Rust) tokenizer mutates itself only to set
    truncation or padding, which an encode asking for neither turns off when set (and meanwhile another thread's
    call would fail, "Already borrowed"); so both go now, once. Its encode runs without Python's GIL."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()


def merge_acceptance(parts: Sequence[AcceptanceStats]) -> AcceptanceStats | None:
    """The statistics of several batches as one (their requests side by side); None for no batch."""
    if not parts:
        return None
    return AcceptanceStats(parts[0].k, [r for p in parts for r in p.rounds], [a for p in parts for a in p.accepted],
                           [row for p in parts for row in p.accepted_at])


@dataclass(frozen=True)
class TextRequest:
    """One row of a generation: its prompt's token ids, the most tokens it may make, its stop strings, and the
    tokens an earlier call made for it (`generated`: a row resumed after an interruption), which follow the prompt,
    count against max_tokens and begin its answer; and what ends it beyond those (finish_completion)."""

    prompt_ids: list[int]
    max_tokens: int
    stop: tuple[str, ...] = ()
    generated: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # end it as the model's EOS ids do (vLLM's stop_token_ids)
    ignore_eos: bool = False  # the model's EOS ids do not end it
    min_tokens: int = 0  # no stop token or stop string ends it before it has this many tokens
    include_stop: bool = False  # its answer keeps the stop string (or stop token's text) that ended it


@dataclass(frozen=True)
class TextResult:
    """One row's answer (text cut at its first stop string, the tokens that text took, why it ended: None for a
    row interrupted before it finished) and every token it generated (a few more than the text took where a stop
    string ended it)."""

    completion: Completion
    token_ids: list[int]


@dataclass(frozen=True)
class RuntimeBatch(CompletionBatch):
    """What CompletionBatch holds, plus what only the runtime knows: each prompt's token ids, every generated
    token (before stop strings cut the text) and the MTP acceptance statistics (None without MTP)."""

    prompt_ids: list[list[int]]
    token_ids: list[list[int]]
    acceptance: AcceptanceStats | None


class RuntimeCompletions:
    """Completes text prompts with a loaded model: `batch_size` prompts per `generate` call, in order, with
    `mtp` draft tokens per round (0: plain decoding) - `complete`, as a GSM8K run asks - or rows of one generate
    call that may be interrupted and resumed - `run`, as a server's batcher asks. `context_tokens`: the model's
    context (None: unknown), for callers that bound prompt + max_tokens by it. invariant: batch-invariant steps
    (generate's; None: its default)."""

    def __init__(self, model: Qwen35, tokenizer, stop_tokens: Sequence[int] = (), *, batch_size: int = 1,
                 mtp: int = 0, context_tokens: int | None = None, invariant: bool | None = None,
                 dispatch: str | None = None) -> None:
        if batch_size < 1:
            raise NpuportError(f"batch size must be at least 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.stop_tokens = frozenset(stop_tokens)
        self.batch_size = batch_size
        self.context_tokens = context_tokens
        # resolved once, for calls with and without MTP alike (their outputs compare); every rank is told
        self.options = run_options(model, mtp, invariant=invariant, dispatch=dispatch)
        only_reads(tokenizer)

    @classmethod
    def load(cls, path: Path | str, *, device: torch.device | str | None = None, dtype: str = "bfloat16",
             batch_size: int = 1, mtp: int = 0, invariant: bool | None = None, dispatch: str | None = None
             ) -> RuntimeCompletions:
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
                   context_tokens=context_tokens_of(path), invariant=invariant, dispatch=dispatch)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def encode(self, prompt: str) -> list[int]:
        """Token ids of `prompt`; safe from several threads at once, none waiting for another (see only_reads)."""
        return list(self.tokenizer.encode(prompt))

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of generated tokens, special tokens (EOS) left out, as the servers answer by default."""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token's own text, special tokens included: how a server names a token in its log-probabilities."""
        return self.tokenizer.decode([token])

    def logprobs(self, sequence: Sequence[int], top_k: int, start: int = 1) -> list[PositionLogprobs]:
        """Log-probabilities of positions start.. of `sequence` and their top_k, in one forward pass."""
        return sequence_logprobs(self.model, sequence, top_k, start)

    def run(self, requests: Sequence[TextRequest], sampling: SamplingParams | None = None,
            on_tokens: TokenSink | None = None, interrupted: Interruption | None = None,
            on_done: Callable[[int, TextResult], None] | None = None
            ) -> tuple[list[TextResult], AcceptanceStats | None]:
        """Every request as one generate call, each with its own max_tokens and stop strings (checked every few
        tokens, as generate's should_stop is), a resumed one going on from its `generated` tokens. on_tokens(row,
        new tokens) hears of tokens as they come, on_done(row, result) of each row's result as soon as it ends
        (the others may still run); interrupted(row, tokens this call made) True ends that row at that check,
        its finish reason None (a client that went away, or a row that gives its place to another request and
        resumes later)."""
        results: list[TextResult | None] = [None] * len(requests)
        stopped: set[int] = set()
        # generate ends a row at the stop tokens every row of the call stops at from its first token; a row with
        # stop tokens of its own (or a min_tokens still ahead) is ended by its stop check, and cut by finish
        own = [self.stop_set(r) for r in requests]
        early = [r.min_tokens > len(r.generated) for r in requests]
        shared = frozenset.intersection(*[frozenset() if e else s for s, e in zip(own, early, strict=True)]) \
            if requests else frozenset()
        special = {row for row in range(len(requests)) if early[row] or own[row] != shared}

        searches = [StopStrings(self.decode, r.stop, r.min_tokens) for r in requests]

        def should_stop(row: int, tokens: list[int]) -> bool:
            request = requests[row]
            every = [*request.generated, *tokens]
            if row in special and stop_token_end(every, own[row], request.min_tokens) is not None:
                return True
            if searches[row].found(every):
                return True
            if interrupted is not None and interrupted(row, len(tokens)):
                stopped.add(row)
                return True
            return False

        def on_finish(row: int, new: list[int], _reason: str) -> None:
            tokens = [*requests[row].generated, *new]
            results[row] = (TextResult(Completion(self.decode(tokens), len(tokens), None), tokens)
                            if row in stopped else self.finish(requests[row], tokens))
            if on_done is not None:
                on_done(row, results[row])

        checks = any(r.stop for r in requests) or interrupted is not None or bool(special)
        stats = generate(self.model, [[*r.prompt_ids, *r.generated] for r in requests],
                         [r.max_tokens - len(r.generated) for r in requests], self.options, sampling=sampling,
                         stop_tokens=shared,
                         should_stop=should_stop if checks else None, on_tokens=on_tokens,
                         on_finish=on_finish).stats
        return results, stats

    # -- a continuous batch's slots (runtime/slots.py), on this model with these options ------------------------

    def open_slots(self, rows: int, capacity: int) -> int:
        """A pool of `rows` decode slots of at least `capacity` positions (slots.open_slots); its capacity."""
        return slots.open_slots(self.model, self.options, rows, capacity)

    def prefill_slots(self, first: int, chunk: Sequence[slots.ChunkRow], width: int,
                      samplers: Sequence[slots.RowSampling] | None = None, spare: int = 0) -> list[int | None]:
        """One prefill chunk of slots first.. (slots.prefill_slots; spare: the free slots after them); each row's
        first token where its prompt ended."""
        return slots.prefill_slots(self.model, first, chunk, width, samplers, spare)

    def capture_decode_steps(self) -> int:
        """With graphs, the decode step of every bucket of the pool captured now (slots.capture_decode_steps)."""
        return slots.capture_decode_steps(self.model)

    def warm_up_prefill(self, shapes: Sequence[tuple[int, int]]) -> int:
        """Prefill chunks of these (rows, width) shapes on scratch states (slots.warm_up_prefill); how many."""
        return slots.warm_up_prefill(self.model, self.options, shapes)

    def decode_slots(self, n: int, rounds: int) -> list[slots.DecodeRound]:
        """`rounds` decode steps (MTP rounds) of slots [0, n) (slots.decode_slots)."""
        return slots.decode_slots(self.model, n, rounds)

    def move_slots(self, source: Sequence[int], target: Sequence[int]) -> None:
        slots.move_slots(self.model, source, target)

    def close_slots(self) -> None:
        slots.close_slots(self.model)

    def stop_set(self, request: TextRequest) -> frozenset[int]:
        """The token ids that end `request` (past its min_tokens): the model's EOS ids unless it ignores them, and
        its own stop_token_ids."""
        return (frozenset() if request.ignore_eos else self.stop_tokens) | frozenset(request.stop_token_ids)

    def finish(self, request: TextRequest, tokens: list[int]) -> TextResult:
        """The answer to `request` that generated `tokens` (all of them, from its first)."""
        return TextResult(finish_completion(tokens, self.decode, request.stop, self.stop_set(request),
                                            request.min_tokens, request.include_stop), tokens)

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
        results: list[TextResult] = []
        stats: list[AcceptanceStats] = []
        start = time.perf_counter()
        for first in range(0, len(prompt_ids), self.batch_size):
            rows = [TextRequest(ids, max_tokens, tuple(stop)) for ids in prompt_ids[first:first + self.batch_size]]
            done, acceptance = self.run(rows, sampling)
            results += done
            if acceptance is not None:
                stats.append(acceptance)
            if progress is not None:
                progress(len(results))
        latency = time.perf_counter() - start
        return RuntimeBatch([r.completion for r in results], latency, prompt_ids, [r.token_ids for r in results],
                            merge_acceptance(stats))
