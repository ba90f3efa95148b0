"""From logits to tokens: the target distribution (temperature, top-p), greedy and seeded sampling, and the
speculative acceptance rules - greedy matching, and rejection sampling against one-hot (argmax) drafts,
which leaves the target distribution unchanged."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (fp32 or wider): softmax(logits / temperature), restricted
    to the smallest set of most likely tokens whose mass reaches top_p, renormalized."""
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / params.temperature, dim=-1)
    if params.top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    outside = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p  # the mass before it already reaches top_p
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(outside, 0.0))
    return kept / kept.sum(-1, keepdim=True)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """logits [B, V] -> tokens [B]."""
    if params.greedy:
        return logits.argmax(-1)
    return torch.multinomial(target_probs(logits, params), 1, generator=generator).squeeze(-1)


def greedy_accept(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, k + 1, V] of the verify forward, drafts [B, k] -> (accepted [B], next token [B]):
    d_i is accepted while it equals argmax(logits_{i-1}); the next token is argmax(logits_accepted)."""
    choice = logits.argmax(-1)  # [B, k + 1]
    accepted = (drafts == choice[:, :-1]).long().cumprod(-1).sum(-1)
    return accepted, choice.gather(1, accepted[:, None]).squeeze(1)


def rejection_sample(probs: torch.Tensor, drafts: torch.Tensor,
                     generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [B, k + 1, V] target distributions at the verify positions, drafts [B, k] (one-hot proposals)
    -> (accepted [B], next token [B]). d_i is accepted with probability p_i(d_i); at the first rejection
    the next token is drawn from p_i with d_i removed, and after k acceptances from p_k."""
    b, k = drafts.shape
    p_draft = probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # [B, k]
    u = torch.rand(b, k, generator=generator, device=probs.device, dtype=probs.dtype)
    accepted = (u < p_draft).long().cumprod(-1).sum(-1)
    rows = torch.arange(b, device=probs.device)
    residual = probs[rows, accepted].clone()  # [B, V]
    rejected = accepted < k
    removed = drafts[rows, accepted.clamp(max=k - 1)]
    residual[rows[rejected], removed[rejected]] = 0.0
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp_min(torch.finfo(total.dtype).tiny), probs[rows, accepted])
    return accepted, torch.multinomial(residual, 1, generator=generator).squeeze(-1)


def accept_drafts(logits: torch.Tensor, drafts: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The verify rule for `params`: greedy matching, or rejection sampling at temperature > 0."""
    if params.greedy:
        return greedy_accept(logits, drafts)
    return rejection_sample(target_probs(logits, params), drafts, generator)
