"""Log-probabilities as OpenAI-compatible servers return them, and what fidelity can make of them.

`sequence_logprobs`: one teacher-forced forward over a token sequence (a prompt and its continuation) gives every
position's next-token distribution; kept are the log-probability of the token that is there and the k most likely
tokens. `topk_kl_estimate`: KL(reference || candidate) at one position from two such top-k lists alone - all an
endpoint tells - over the reference's top-k tokens plus one bucket for the rest of the vocabulary, a candidate
log-probability its own top-k does not list taken at its k-th (the most it can be). Its bias against the
full-vocabulary KL is measured wherever both models run in the built-in runtime (fidelity.py reports both).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from npuport.runtime.generate import logits_in_chunks
from npuport.runtime.model import Qwen35

LOGPROB_CHUNK = 256  # positions whose float32 log-softmax is held at once (x vocabulary)
# the smallest probability mass the estimate's rest-of-vocabulary bucket is given, so that its log stays finite
REST_FLOOR = 1e-12


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


def topk_kl_estimate(reference: Mapping[int, float], candidate: Mapping[int, float]) -> float:
    """KL(reference || candidate) in nats at one position from each model's top-k log-probabilities (token ->
    log-probability; non-empty): the KL of the two distributions coarsened to the reference's top-k tokens and
    one bucket for everything else, a token missing from the candidate's top-k given the candidate's smallest
    listed log-probability (an upper bound on its own). Exact when k covers the vocabulary."""
    if not reference or not candidate:
        raise ValueError("a top-k estimate needs log-probabilities from both models")
    floor = min(candidate.values())
    kl, mass_ref, mass_cand = 0.0, 0.0, 0.0
    for token, ref_lp in reference.items():
        cand_lp = candidate.get(token, floor)
        p = math.exp(ref_lp)
        kl += p * (ref_lp - cand_lp)
        mass_ref += p
        mass_cand += math.exp(cand_lp)
    rest_ref, rest_cand = max(1.0 - mass_ref, 0.0), max(1.0 - mass_cand, REST_FLOOR)
    if rest_ref > 0:
        kl += rest_ref * (math.log(max(rest_ref, REST_FLOOR)) - math.log(rest_cand))
    return kl


def topk_kl_from_logits(reference_logits: torch.Tensor, candidate_logits: torch.Tensor,
                        ks: Sequence[int]) -> dict[int, list[float]]:
    """k -> topk_kl_estimate at every row of two logits [N, V], for each k of ks: what an endpoint's top-k would
    give, from full logits (one log-softmax and top-k per chunk for all ks: a smaller k's top is a prefix)."""
    estimates: dict[int, list[float]] = {k: [] for k in ks}
    for s in range(0, reference_logits.shape[0], LOGPROB_CHUNK):
        _, ref_values, ref_ids = top_logprobs(reference_logits[s:s + LOGPROB_CHUNK], max(ks))
        _, cand_values, cand_ids = top_logprobs(candidate_logits[s:s + LOGPROB_CHUNK], max(ks))
        for rv, ri, cv, ci in zip(ref_values.tolist(), ref_ids.tolist(), cand_values.tolist(), cand_ids.tolist(),
                                  strict=True):
            for k, rows in estimates.items():
                rows.append(topk_kl_estimate(dict(zip(ri[:k], rv[:k], strict=True)),
                                             dict(zip(ci[:k], cv[:k], strict=True))))
    return estimates
