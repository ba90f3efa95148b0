"""How closely a candidate model (the W8A8 artifact) follows its reference (the BF16 source) on the same token
sequences: greedy token agreement, next-token top-1 agreement, mean KL divergence, per-layer cosine - and the
top-k KL estimates an endpoint's log-probabilities would give on the same positions, to state their bias."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

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


@dataclass
class _Totals:
    """Running sums over every compared position."""

    positions: int = 0
    top1_same: int = 0
    kl: float = 0.0
    cosine: list[float] | None = None
    topk_kl: dict[int, float] = field(default_factory=lambda: dict.fromkeys(ESTIMATE_KS, 0.0))

    def add(self, cand_logits: torch.Tensor, ref_logits: torch.Tensor, cand_hidden: Sequence[torch.Tensor],
            ref_hidden: Sequence[torch.Tensor]) -> None:
        """One sequence: logits [T, V], hidden states per layer [T, hidden]."""
        self.positions += cand_logits.shape[0]
        self.top1_same += int((cand_logits.argmax(-1) == ref_logits.argmax(-1)).sum())
        for s in range(0, cand_logits.shape[0], KL_CHUNK):
            self.kl += float(kl_divergence(ref_logits[s:s + KL_CHUNK], cand_logits[s:s + KL_CHUNK]).sum())
        for k, estimates in topk_kl_from_logits(ref_logits, cand_logits, ESTIMATE_KS).items():
            self.topk_kl[k] += sum(estimates)
        sums = [float(torch.cosine_similarity(c.float(), r.float(), dim=-1).sum())
                for c, r in zip(cand_hidden, ref_hidden, strict=True)]
        self.cosine = sums if self.cosine is None else [a + b for a, b in zip(self.cosine, sums, strict=True)]


@torch.no_grad()
def measure_fidelity(candidate: Qwen35, reference: Qwen35, prompts: Sequence[Sequence[int]],
                     candidate_tokens: Sequence[Sequence[int]], reference_tokens: Sequence[Sequence[int]]) -> Fidelity:
    """Compare the two models on the same prompts (token ids).

    - greedy token agreement: of the tokens each model generated greedily from the prompts (candidate_tokens,
      reference_tokens), see `greedy_token_agreement`;
    - teacher-forced on prompt + the reference's continuation, fed to both models one sequence at a time,
      at every position: top-1 agreement (same argmax of the next-token logits), mean KL(reference ||
      candidate) in nats, and per decoder layer the mean cosine similarity of the two models' outputs (the
      last layer's after the final norm, as transformers' output_hidden_states gives it);
    - at the same positions, the top-k KL estimate (topk_kl.topk_kl_estimate) for each k of ESTIMATE_KS."""
    if not len(prompts) == len(candidate_tokens) == len(reference_tokens):
        raise ValueError("one prompt, one candidate and one reference generation per request")
    totals = _Totals()
    for prompt, continuation in zip(prompts, reference_tokens, strict=True):
        sequence = [list(prompt) + list(continuation)]
        cand_logits, cand_hidden = forward_logits(candidate, sequence)
        ref_logits, ref_hidden = forward_logits(reference, sequence)
        # hidden_states[0] is the input embedding, the same table in both models: not a layer's output
        totals.add(cand_logits[0], ref_logits[0], [h[0] for h in cand_hidden[1:]], [h[0] for h in ref_hidden[1:]])
    return Fidelity(
        greedy_token_agreement=greedy_token_agreement(candidate_tokens, reference_tokens),
        top1_agreement=totals.top1_same / totals.positions,
        mean_kl=totals.kl / totals.positions,
        layer_cosine=[c / totals.positions for c in totals.cosine or []],
        num_prompts=len(prompts),
        num_tokens=totals.positions,
        topk_kl_estimates={k: v / totals.positions for k, v in totals.topk_kl.items()},
    )
