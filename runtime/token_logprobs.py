"""Log-probabilities of a token sequence under the model, as OpenAI-compatible servers return them: one
teacher-forced forward over a prompt and its continuation gives every position's next-token distribution; kept are
the log-probability of the token that is there and the k most likely tokens."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from npuport.runtime.generate import logits_in_chunks
from npuport.runtime.model import Qwen35

LOGPROB_CHUNK = 256  # positions whose float32 log-softmax is held at once (x vocabulary)


@dataclass(frozen=True)
class PositionLogprobs:
    """The token at one position of a sequence, its log-probability given the tokens before it, and the top-k
    (token id, log-probability) there, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, V] -> (log-probabilities [N, V] in float32 or wider, top-k values [N, k], top-k ids [N, k])."""
    logprobs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1) if k > 0 else (logprobs[:, :0],) * 2
    return logprobs, values, ids


def sequence_logprobs(model: Qwen35, sequence: Sequence[int], top_k: int, start: int = 1) -> list[PositionLogprobs]:
    """Positions start..len(sequence) - 1 of `sequence` (token ids; start >= 1: the first token has no
    distribution before it), each from the model's logits at the position before, in one forward pass. The
    logits are computed LOGPROB_CHUNK positions at a time: all of them, [T, V] in float32, would take 16 GB for a
    32k-token prompt at Qwen3.5's vocabulary."""
    if not 1 <= start <= len(sequence):
        raise ValueError(f"start {start} outside 1..{len(sequence)}")
    per_chunk = logits_in_chunks(model, list(sequence), start, LOGPROB_CHUNK,
                                 functools.partial(_chunk_logprobs, list(sequence), top_k))
    return [position for chunk in per_chunk for position in chunk]


def _chunk_logprobs(sequence: list[int], top_k: int, logits: torch.Tensor, first: int) -> list[PositionLogprobs]:
    """Positions first..first + n - 1 of `sequence` from logits [n, V] (each the position before's)."""
    rows = range(first, first + logits.shape[0])
    logprobs, values, ids = top_logprobs(logits, top_k)
    tokens = torch.tensor([sequence[i] for i in rows], device=logprobs.device)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    return [PositionLogprobs(sequence[i], chosen[j], tuple(zip(ids[j].tolist(), values[j].tolist(), strict=True)))
            for j, i in enumerate(rows)]
