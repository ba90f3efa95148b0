"""How closely a candidate model (the W8A8 artifact) follows its reference (the BF16 source) on the same token
sequences: greedy token agreement, next-token top-1 agreement, mean KL divergence, per-layer cosine - and the
top-k KL estimates an endpoint's log-probabilities would give on the same positions, to state their bias."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from npuport.benchlog import Progress
from npuport.runtime.generate import forward_logits
from npuport.runtime.model import Qwen35
from npuport.runtime.validation.report import Fidelity
from npuport.runtime.validation.topk_kl import topk_kl_from_logits

KL_CHUNK = 256  # positions whose float32 log-probabilities are held at once (x 2 models x vocabulary)
ESTIMATE_KS = (5, 20)  # the top-k an endpoint gives: the OpenAI API's most for completions, vLLM's default most


def greedy_token_agreement(candidate: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> float:
    """The share of the reference's generated tokens that the candidate generated at the same position of the
    same request (a position the candidate did not reach counts as a disagreement)."""
    if len(candidate) != len(reference):
        raise ValueError(f"{len(candidate)} candidate generations for {len(reference)} reference ones")
    total = sum(len(r) for r in reference)
    if not total:
        raise ValueError("the reference generated no tokens")
    same = sum(c == r for cand, ref in zip(candidate, reference, strict=True) for c, r in zip(cand, ref, strict=False))
    return same / total


def kl_divergence(reference_logits: torch.Tensor, candidate_logits: torch.Tensor) -> torch.Tensor:
    """KL(P_reference || P_candidate) in nats per row: logits [N, V] -> [N], computed in float32 or wider."""
    dtype = torch.promote_types(reference_logits.dtype, torch.float32)
    ref = torch.log_softmax(reference_logits.to(dtype), dim=-1)
    cand = torch.log_softmax(candidate_logits.to(dtype), dim=-1)
    return (ref.exp() * (ref - cand)).sum(-1)


def sequence_sums(cand_logits: torch.Tensor, ref_logits: torch.Tensor, cand_hidden: Sequence[torch.Tensor],
                  ref_hidden: Sequence[torch.Tensor]) -> dict[str, Any]:
    """One sequence's sums over its positions (logits [T, V], hidden states per layer [T, hidden]): positions,
    same top-1, KL(reference || candidate), each top-k KL estimate and each layer's cosine similarity. What
    fidelity.jsonl holds per sequence; the measures are their totals over the sequences, in order."""
    kl = 0.0
    for s in range(0, cand_logits.shape[0], KL_CHUNK):
        kl += float(kl_divergence(ref_logits[s:s + KL_CHUNK], cand_logits[s:s + KL_CHUNK]).sum())
    return {"positions": int(cand_logits.shape[0]),
            "top1_same": int((cand_logits.argmax(-1) == ref_logits.argmax(-1)).sum()),
            "kl": kl,
            "topk_kl": {str(k): float(sum(v)) for k, v in topk_kl_from_logits(ref_logits, cand_logits,
                                                                               ESTIMATE_KS).items()},
            "cosine": [float(torch.cosine_similarity(c.float(), r.float(), dim=-1).sum())
                       for c, r in zip(cand_hidden, ref_hidden, strict=True)]}


def fidelity_of(sums: Sequence[dict[str, Any]], candidate_tokens: Sequence[Sequence[int]],
                reference_tokens: Sequence[Sequence[int]]) -> Fidelity:
    """The measures from each sequence's sums (sequence_sums), added in sequence order, and the greedy tokens."""
    positions = sum(s["positions"] for s in sums)
    kl, topk, cosine = 0.0, dict.fromkeys(ESTIMATE_KS, 0.0), None
    for s in sums:
        kl += s["kl"]
        for k in ESTIMATE_KS:
            topk[k] += s["topk_kl"][str(k)]
        cosine = list(s["cosine"]) if cosine is None else [a + b for a, b in zip(cosine, s["cosine"], strict=True)]
    return Fidelity(
        greedy_token_agreement=greedy_token_agreement(candidate_tokens, reference_tokens),
        top1_agreement=sum(s["top1_same"] for s in sums) / positions,
        mean_kl=kl / positions,
        layer_cosine=[c / positions for c in cosine or []],
        num_prompts=len(sums),
        num_tokens=positions,
        topk_kl_estimates={k: v / positions for k, v in topk.items()},
    )


@torch.no_grad()
def measure_fidelity(candidate: Qwen35, reference: Qwen35, prompts: Sequence[Sequence[int]],
                     candidate_tokens: Sequence[Sequence[int]], reference_tokens: Sequence[Sequence[int]], *,
                     done: Sequence[dict[str, Any]] = (), on_sequence: Callable[[dict[str, Any]], None] | None = None,
                     progress: Progress | None = None) -> Fidelity:
    """Compare the two models on the same prompts (token ids).

    - greedy token agreement: of the tokens each model generated greedily from the prompts (candidate_tokens,
      reference_tokens), see `greedy_token_agreement`;
    - teacher-forced on prompt + the reference's continuation, fed to both models one sequence at a time,
      at every position: top-1 agreement (same argmax of the next-token logits), mean KL(reference ||
      candidate) in nats, and per decoder layer the mean cosine similarity of the two models' outputs (the
      last layer's after the final norm, as transformers' output_hidden_states gives it);
    - at the same positions, the top-k KL estimate (topk_kl.topk_kl_estimate) for each k of ESTIMATE_KS.

    `done`: the sums (sequence_sums) of the first sequences, from a run that was stopped: not computed again.
    `on_sequence(sums)` hears of each sequence's sums as they are made (validate appends them to fidelity.jsonl);
    `progress` of each sequence done."""
    if not len(prompts) == len(candidate_tokens) == len(reference_tokens):
        raise ValueError("one prompt, one candidate and one reference generation per request")
    sums = list(done[:len(prompts)])
    if progress is not None:
        progress.skip(len(sums))
    for prompt, continuation in list(zip(prompts, reference_tokens, strict=True))[len(sums):]:
        sequence = [list(prompt) + list(continuation)]
        cand_logits, cand_hidden = forward_logits(candidate, sequence)
        ref_logits, ref_hidden = forward_logits(reference, sequence)
        # hidden_states[0] is the input embedding, the same table in both models: not a layer's output
        sums.append(sequence_sums(cand_logits[0], ref_logits[0], [h[0] for h in cand_hidden[1:]],
                                  [h[0] for h in ref_hidden[1:]]))
        if on_sequence is not None:
            on_sequence(sums[-1])
        if progress is not None:
            progress.update(advance=1, tokens=sums[-1]["positions"])
    return fidelity_of(sums, candidate_tokens, reference_tokens)
