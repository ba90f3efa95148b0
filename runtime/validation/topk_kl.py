"""What fidelity can make of the top-k log-probabilities an OpenAI-compatible server returns.

`topk_kl_estimate`: KL(reference || candidate) at one position from two top-k lists alone - all an endpoint tells -
over the reference's top-k tokens plus one bucket for the rest of the vocabulary, a candidate log-probability its
own top-k does not list taken at its k-th (the most it can be). Its bias against the full-vocabulary KL is measured
wherever both models run in the built-in runtime (fidelity.py reports both). The log-probabilities themselves come
from runtime/token_logprobs.py (the built-in runtime) or from a server's answers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from npuport.runtime.token_logprobs import LOGPROB_CHUNK, top_logprobs

# the smallest probability mass the estimate's rest-of-vocabulary bucket is given, so that its log stays finite
REST_FLOOR = 1e-12


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
