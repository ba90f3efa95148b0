"""Prefill: prompts padded into a batch, run through the target in chunks of bounded width and committed, then
the MTP head's cache filled over the same positions - directly, or padded to a fixed width with static shapes so
that a captured graph replays it (graphs.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from npuport.errors import NpuportError
from npuport.runtime.model import Qwen35
from npuport.runtime.state import ModelState, commit_accepted

# Capacities are rounded up to this many positions, so that calls with prompts of other lengths find the same
# states and captured steps; a captured prefill's width is rounded the same way.
CAPACITY_STEP = 256
# The most positions (rows x width) one chunk of a prefill takes at once: a chunk's attention holds a mask (and
# scores) of its positions x the context, so a prompt of any length costs that much at a time, not its length
# squared (an 8k-token prompt in one pass took 230 MB more on a tiny model, 32k tokens 5 GB).
PREFILL_CHUNK_POSITIONS = 2048
# A prefill of at most this many positions (batch x width) on a device that captures graphs runs padded to a fixed
# width, as a captured graph: its hundreds of launches would otherwise cost the host more than the device's work.
# Beyond it the device's work hides their cost, and the graph's memory would grow with it.
GRAPH_PREFILL_POSITIONS = 16384


def pad_prompts(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (tokens [B, T] right-padded with 0, lengths [B])."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise NpuportError("every prompt needs at least one token")
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    tokens = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(list(p), dtype=torch.long, device=device)
    return tokens, lengths


def prefill_chunk_width(batch: int) -> int:
    """The width of a prefill's chunks when the caller names none: PREFILL_CHUNK_POSITIONS over the rows."""
    return max(1, PREFILL_CHUNK_POSITIONS // batch)


def rounded_capacity(positions: int) -> int:
    """positions rounded up to a multiple of CAPACITY_STEP."""
    return -(-positions // CAPACITY_STEP) * CAPACITY_STEP


def prefill(model: Qwen35, state: ModelState, tokens: torch.Tensor, lengths: torch.Tensor,
            chunk_size: int | None = None, hidden_states: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Run tokens [B, T] (row b real up to lengths[b]) through the target in chunks of chunk_size tokens
    (default: prefill_chunk_width(B)), committing them. Returns the final-normed hidden [B, T, hidden];
    hidden_states, if given, receives the model's list (Qwen35.prefill), each entry [B, T, hidden] gathered over
    the chunks."""
    chunk = chunk_size or prefill_chunk_width(tokens.shape[0])
    out, per_chunk = [], []
    for s in range(0, tokens.shape[1], chunk):
        n_valid = (lengths - s).clamp(0, min(chunk, tokens.shape[1] - s))
        states: list[torch.Tensor] | None = None if hidden_states is None else []
        out.append(model.prefill(tokens[:, s : s + chunk], state, n_valid, states))
        commit_accepted(state, n_valid, 0)
        per_chunk.append(states)
    if hidden_states is not None:
        hidden_states.extend(torch.cat(parts, dim=1) for parts in zip(*per_chunk, strict=True))
    return torch.cat(out, dim=1)


def prefilled_hidden(model: Qwen35, prompts: Sequence[Sequence[int]],
                     hidden_states: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The final-normed hidden [B, T, hidden] of one chunked prefill from empty caches (rows past a prompt's
    length are padding): what the logits are computed from, a chunk of positions at a time where [T, V] logits
    would not fit."""
    tokens, lengths = pad_prompts(prompts, model.device)
    return prefill(model, model.new_state(len(prompts), tokens.shape[1]), tokens, lengths,
                   hidden_states=hidden_states)


def prefill_width(length: int, chunk_size: int | None) -> int:
    """The width a captured prefill runs at: chunk_size, or the prompt length rounded up to CAPACITY_STEP (so
    that prompts of other lengths replay the same graph)."""
    return chunk_size or rounded_capacity(length)


def pad_to_width(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [B, T, ...] right-padded with zeros along T to a multiple of width."""
    t = x.shape[1]
    return F.pad(x, (0, 0) * (x.dim() - 2) + (0, -(-t // width) * width - t))


def padded_prefill(run: Callable, state: ModelState, tokens: torch.Tensor, lengths: torch.Tensor, width: int
                   ) -> torch.Tensor:
    """prefill() in chunks of exactly `width` tokens (tokens [B, T] right-padded with 0 up to a multiple of it),
    each through run(state, chunk [B, width], n_valid [B]) -> hidden [B, width, hidden], which commits it.
    Returns the final-normed hidden [B, T, hidden]."""
    t, padded = tokens.shape[1], pad_to_width(tokens, width)
    out = [run(state, padded[:, s : s + width], (lengths - s).clamp(0, width)) for s in range(0, t, width)]
    return torch.cat(out, dim=1)[:, :t]


def static_prefill_chunk(model: Qwen35, state: ModelState, tokens: torch.Tensor, n_valid: torch.Tensor
                         ) -> torch.Tensor:
    """One chunk of padded_prefill, without a host synchronisation: the prefill with static shapes, committed."""
    hidden = model.prefill(tokens, state, n_valid, static_shapes=True)
    commit_accepted(state, n_valid, 0)
    return hidden


def mtp_prefill_chunk(model: Qwen35, state: ModelState, next_tokens: torch.Tensor, hidden: torch.Tensor,
                      last: torch.Tensor, n_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of mtp_prefill: the head over next_tokens [B, t] and hidden [B, t, hidden] at the state's
    positions, n_valid [B] of them committed. Returns the logits [B, V] and the head's output [B, hidden] at row
    last[b]. No host synchronisation: a graph can capture it."""
    logits, out = model.mtp_forward(next_tokens, hidden, state, logits_at=last)
    commit_accepted(state, n_valid, 0)
    return logits[:, 0], out[torch.arange(out.shape[0], device=out.device), last]


def mtp_prefill(run: Callable, state: ModelState, next_tokens: torch.Tensor, hidden: torch.Tensor,
                lengths: torch.Tensor, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill the MTP head's cache over the prompt: row t pairs next_tokens[:, t] (the token after t) with the
    target's hidden[:, t], in chunks of chunk_size (default: prefill_chunk_width(B)), each through run(state,
    next_tokens, hidden, last, n_valid) (mtp_prefill_chunk with the model, or its captured graph). Returns logits
    [B, V] and the head's output [B, hidden] at each last real row."""
    chunk = chunk_size or prefill_chunk_width(next_tokens.shape[0])
    logits = outs = None
    for s in range(0, next_tokens.shape[1], chunk):
        n_valid = (lengths - s).clamp(0, min(chunk, next_tokens.shape[1] - s))
        last = (lengths - 1 - s).clamp(0, next_tokens[:, s : s + chunk].shape[1] - 1)
        lg, out = run(state, next_tokens[:, s : s + chunk], hidden[:, s : s + chunk], last, n_valid)
        ends_here = ((lengths - 1 >= s) & (lengths - 1 < s + chunk))[:, None]
        logits = lg if logits is None else torch.where(ends_here, lg, logits)
        outs = out if outs is None else torch.where(ends_here, out, outs)
    return logits, outs
