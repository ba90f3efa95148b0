"""One round of generation - a plain decode step, or an MTP round: draft k tokens with the head, verify k + 1
positions in one target step, accept, commit what each request keeps, let the head catch up (QWEN35.md, "Verify,
accept, commit") - written once, as a body over the `Round` protocol. `DirectRound` runs a round's parts on the
states directly; graphs.py implements the same protocol with each part a captured graph, and captures a whole
greedy body over a DirectRound as one graph."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from npuport.runtime.model import Qwen35
from npuport.runtime.state import ModelState, commit_accepted

# (logits [B, V]) -> the chosen token [B]: argmax, or a sampler's draw
Choose = Callable[[torch.Tensor], torch.Tensor]
# (logits [B, k + 1, V], drafts [B, k]) -> (accepted drafts [B], the target's next token [B])
Accept = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Round(Protocol):
    """The model work of a round, on the target's state and (with MTP) the head's; k drafts per round."""

    k: int

    def positions(self) -> torch.Tensor:
        """The target's committed positions [B]."""

    def verify(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A target step over tokens [B, t] (t = k + 1, or 1 to decode): (final hidden [B, t, hidden], logits
        [B, t, V]), staged."""

    def commit(self, n_new: torch.Tensor, step_tokens: int) -> None:
        """The target keeps n_new[b] of the step_tokens tokens its last step staged."""

    def draft(self, logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """k drafts [B, k] from the head's logits [B, V] and output [B, hidden] at its last committed row."""

    def catch_up(self, emitted: torch.Tensor, hidden: torch.Tensor, start: torch.Tensor, accepted: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over the verified positions from start [B]: row i pairs emitted [B, k + 1] token i with the
        target's hidden [B, k + 1, hidden] row i. Returns (logits [B, 1, V] at row accepted[b], output
        [B, k + 1, hidden])."""

    def commit_head(self, n_new: torch.Tensor) -> None:
        """The head keeps n_new[b] of the rows it just caught up over."""


class DirectRound:
    """A round's parts run on the states as they are called."""

    def __init__(self, model: Qwen35, state: ModelState, mtp_state: ModelState | None, k: int) -> None:
        self.model, self.state, self.mtp_state, self.k = model, state, mtp_state, k

    def positions(self) -> torch.Tensor:
        return self.state.positions

    def verify(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model.step(tokens, self.state)
        return hidden, self.model.logits(hidden)

    def commit(self, n_new: torch.Tensor, step_tokens: int) -> None:
        commit_accepted(self.state, n_new, step_tokens)

    def draft(self, logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return draft(self.model, self.mtp_state, logits, hidden, self.k)

    def catch_up(self, emitted: torch.Tensor, hidden: torch.Tensor, start: torch.Tensor, accepted: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.mtp_forward(emitted, hidden, self.mtp_state, start, logits_at=accepted)

    def commit_head(self, n_new: torch.Tensor) -> None:
        commit_accepted(self.mtp_state, n_new, 0)  # the head's state holds KV caches only: nothing is staged


def draft(model: Qwen35, state: ModelState, logits: torch.Tensor, hidden: torch.Tensor, k: int) -> torch.Tensor:
    """k argmax drafts [B, k]: the first from the head's logits [B, V] at its last committed row, each
    further one from the head run at the next position on the previous draft and its own output [B, hidden]."""
    tok = logits.argmax(-1)
    drafts = [tok]
    for j in range(1, k):
        lg, out = model.mtp_forward(tok[:, None], hidden[:, None], state, start=state.positions + (j - 1))
        tok, hidden = lg[:, 0].argmax(-1), out[:, 0]
        drafts.append(tok)
    return torch.stack(drafts, dim=1)


def advanced(new: torch.Tensor, counts: torch.Tensor, active: torch.Tensor, produced: torch.Tensor,
             stop_tokens: torch.Tensor, max_new_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(active [B], produced [B]) after request b produced the first counts[b] tokens of new [B, n]: it stops
    running at a stop token among them or at max_new_tokens [B]. New tensors, so that a captured round can
    return them."""
    taken = torch.arange(new.shape[1], device=new.device)[None, :] < counts[:, None]
    stopped = (torch.isin(new, stop_tokens) & taken).any(1)
    produced = produced + counts
    return active & ~stopped & (produced < max_new_tokens), produced


def decode_round(parts: Round, choose: Choose, tok: torch.Tensor, active: torch.Tensor, produced: torch.Tensor,
                 stop_tokens: torch.Tensor, max_new_tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A plain decode step of every request from its last token tok [B]: the target's step, committed for the
    requests that still run (active [B]), the next token chosen. Returns (next token [B], active, produced)."""
    counts = active.long()
    _, logits = parts.verify(tok[:, None])
    parts.commit(counts, 1)
    new = choose(logits[:, 0])
    return new, *advanced(new[:, None], counts, active, produced, stop_tokens, max_new_tokens)


def mtp_round(parts: Round, accept: Accept, tok: torch.Tensor, mtp_logits: torch.Tensor, mtp_hidden: torch.Tensor,
              active: torch.Tensor, produced: torch.Tensor, stop_tokens: torch.Tensor, max_new_tokens: torch.Tensor
              ) -> tuple[torch.Tensor, ...]:
    """Draft k tokens, verify k + 1 positions in one target step, accept, commit what the requests that still
    run (active [B]) keep, and let the head catch up over the verified positions. Returns (next token [B], the
    round's record [B, k + 2]: emitted tokens then the accepted count, the head's logits [B, V] and output
    [B, hidden] for the next drafts, active, produced)."""
    rows = torch.arange(tok.shape[0], device=tok.device)
    drafts = parts.draft(mtp_logits, mtp_hidden)
    start = parts.positions().clone()
    hidden, logits = parts.verify(torch.cat([tok[:, None], drafts], dim=1))
    accepted, tok = accept(logits, drafts)
    n_new = (accepted + 1) * active
    parts.commit(n_new, parts.k + 1)
    emitted = torch.cat([drafts, tok[:, None]], dim=1)  # d_1..d_a, then the target's token
    emitted[rows, accepted] = tok
    active, produced = advanced(emitted, n_new, active, produced, stop_tokens, max_new_tokens)
    logits, head_out = parts.catch_up(emitted, hidden, start, accepted)
    parts.commit_head(n_new)
    return (tok, torch.cat([emitted, accepted[:, None]], dim=1), logits[:, 0], head_out[rows, accepted], active,
            produced)
