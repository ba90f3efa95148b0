"""Generation: prefill (in chunks of bounded width), decode, and MTP speculative decoding - draft k tokens with
the MTP head, verify k + 1 positions in one target forward, accept, commit per request - with stop tokens,
max tokens and acceptance statistics per draft position (QWEN35.md, "Verify, accept, commit")."""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from npuport.devices import DeviceGraph, graphs_supported, runs_triton
from npuport.errors import NpuportError
from npuport.kernels.gated_delta_rule import VerifyLog
from npuport.runtime.invariance import batch_invariant
from npuport.runtime.lockstep import mirrored
from npuport.runtime.model import Qwen35
from npuport.runtime.sampling import SamplingParams, accept_drafts, greedy_accept, make_generator, sample
from npuport.runtime.state import GDNState, ModelState, commit_accepted, reset_state

MAX_DRAFTS = 4


@dataclass
class AcceptanceStats:
    """Per request: verify rounds, drafts accepted, and accepted_at[j] = rounds in which draft j + 1 was
    accepted (counted as verified, before stop tokens or max tokens cut the output)."""

    k: int
    rounds: list[int]
    accepted: list[int]
    accepted_at: list[list[int]]

    @classmethod
    def empty(cls, batch: int, k: int) -> AcceptanceStats:
        return cls(k, [0] * batch, [0] * batch, [[0] * k for _ in range(batch)])

    def record(self, accepted: torch.Tensor, active: torch.Tensor) -> None:
        for b, (a, live) in enumerate(zip(accepted.tolist(), active.tolist(), strict=True)):
            if live:
                self.rounds[b] += 1
                self.accepted[b] += a
                for j in range(a):
                    self.accepted_at[b][j] += 1

    def acceptance_rate_per_position(self) -> list[float]:
        """Over the batch: the fraction of rounds in which draft j + 1 was accepted."""
        rounds = sum(self.rounds)
        return [sum(per[j] for per in self.accepted_at) / rounds if rounds else 0.0 for j in range(self.k)]

    def mean_accepted_length(self) -> float:
        """Tokens per verify round over the batch (accepted drafts + the one the target adds)."""
        rounds = sum(self.rounds)
        return (sum(self.accepted) + rounds) / rounds if rounds else 0.0

    def to_dict(self) -> dict:
        return {
            "k": self.k,
            "rounds": self.rounds,
            "accepted": self.accepted,
            "accepted_at": self.accepted_at,
            "acceptance_rate_per_position": self.acceptance_rate_per_position(),
            "mean_accepted_length": self.mean_accepted_length(),
        }


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per request, a stop token included
    finish_reasons: list[str]  # "stop" or "length"
    stats: AcceptanceStats | None = None  # None without MTP


StopCheck = Callable[[int, list[int]], bool]  # (request index, its tokens so far) -> stop it now
TokenSink = Callable[[int, list[int]], None]  # (request index, the tokens it just produced)
FinishSink = Callable[[int, list[int], str], None]  # (request index, all its tokens, why it ended)
STOP_CHECK_EVERY = 8  # tokens between two calls of a request's stop check
SYNC_EVERY = 8  # decode steps / MTP rounds the device runs between two looks of the host at their tokens


class _Outputs:
    """The tokens each request has produced, and why it finished (None while it runs). max_new_tokens: each
    request's limit; on_tokens hears of every request's new tokens as they are added, on_finish of each request's
    end once it is decided."""

    def __init__(self, max_new_tokens: Sequence[int], stop_tokens: Iterable[int],
                 should_stop: StopCheck | None = None, on_tokens: TokenSink | None = None,
                 on_finish: FinishSink | None = None) -> None:
        batch = len(max_new_tokens)
        self.max_new_tokens, self.stop_tokens = list(max_new_tokens), frozenset(stop_tokens)
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.reasons: list[str | None] = [None] * batch
        self.should_stop, self.on_tokens, self.on_finish = should_stop, on_tokens, on_finish
        self._checked = [0] * batch  # how many tokens each request had at its last stop check

    def add(self, new: torch.Tensor, counts: torch.Tensor) -> None:
        """Append the first counts[b] tokens of new[b] ([B, n]) to unfinished request b, up to a stop token
        or its max_new_tokens."""
        for b, (row, n) in enumerate(zip(new.tolist(), counts.tolist(), strict=True)):
            before, running = len(self.tokens[b]), self.reasons[b] is None
            for tok in row[:n]:
                if self.reasons[b] is not None:
                    break
                self.tokens[b].append(tok)
                if tok in self.stop_tokens:
                    self.reasons[b] = "stop"
                elif len(self.tokens[b]) >= self.max_new_tokens[b]:
                    self.reasons[b] = "length"
            if self.on_tokens is not None and len(self.tokens[b]) > before:
                self.on_tokens(b, self.tokens[b][before:])
            if self.should_stop is not None and self.reasons[b] is None \
                    and len(self.tokens[b]) - self._checked[b] >= STOP_CHECK_EVERY:
                self._checked[b] = len(self.tokens[b])
                if self.should_stop(b, self.tokens[b]):
                    self.reasons[b] = "stop"
            if self.on_finish is not None and running and self.reasons[b] is not None:
                self.on_finish(b, self.tokens[b], self.reasons[b])

    def active(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([r is None for r in self.reasons], device=device)

    def running(self) -> bool:
        return any(r is None for r in self.reasons)

    def rounds_before_sync(self) -> int:
        """Decode steps / MTP rounds to run before the host looks at their tokens again: SYNC_EVERY, or fewer
        when no running request can take that many more tokens (every round gives each at least one)."""
        room = max(limit - len(t) for limit, t, r in zip(self.max_new_tokens, self.tokens, self.reasons, strict=True)
                   if r is None)
        return min(SYNC_EVERY, room)


class DeviceProgress:
    """Between two host synchronisations, which requests still run - no stop token yet and fewer than
    max_new_tokens - kept on the device, so the steps need not ask the host. The host then replays the rounds'
    tokens through _Outputs, which decides exactly as before (stop checks included); a request the host
    finds finished earlier than the device did only ran a few steps more, on its own state, whose tokens
    are dropped."""

    def __init__(self, out: _Outputs, device: torch.device) -> None:
        self.active = out.active(device)
        self.produced = torch.tensor([len(t) for t in out.tokens], device=device)
        self.stop_tokens = torch.tensor(sorted(out.stop_tokens) or [-1], device=device)
        # a tensor [B], so that steps captured once serve calls with any max_new_tokens
        self.max_new_tokens = torch.tensor(out.max_new_tokens, device=device)

    def advance(self, new: torch.Tensor, counts: torch.Tensor) -> None:
        """The first counts[b] tokens of new [B, n] were produced by request b."""
        self.active, self.produced = advanced(new, counts, self.active, self.produced, self.stop_tokens,
                                              self.max_new_tokens)


def advanced(new: torch.Tensor, counts: torch.Tensor, active: torch.Tensor, produced: torch.Tensor,
             stop_tokens: torch.Tensor, max_new_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeviceProgress's (active [B], produced [B]) after request b produced the first counts[b] tokens of
    new [B, n]: new tensors, so that a captured step can return them."""
    taken = torch.arange(new.shape[1], device=new.device)[None, :] < counts[:, None]
    stopped = (torch.isin(new, stop_tokens) & taken).any(1)
    produced = produced + counts
    return active & ~stopped & (produced < max_new_tokens), produced


def pad_prompts(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (tokens [B, T] right-padded with 0, lengths [B])."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise NpuportError("every prompt needs at least one token")
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    tokens = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(list(p), dtype=torch.long, device=device)
    return tokens, lengths


# The most positions (rows x width) one chunk of a prefill takes at once: a chunk's attention holds a mask (and
# scores) of its positions x the context, so a prompt of any length costs that much at a time, not its length
# squared (an 8k-token prompt in one pass took 230 MB more on a tiny model, 32k tokens 5 GB).
PREFILL_CHUNK_POSITIONS = 2048


def prefill_chunk_width(batch: int) -> int:
    """The width of a prefill's chunks when the caller names none: PREFILL_CHUNK_POSITIONS over the rows."""
    return max(1, PREFILL_CHUNK_POSITIONS // batch)


def prefill(model: Qwen35, state: ModelState, tokens: torch.Tensor, lengths: torch.Tensor,
            chunk_size: int | None = None, hidden_states: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Run tokens [B, T] (row b real up to lengths[b]) through the target in chunks of chunk_size tokens
    (default: prefill_chunk_width(B)), committing them. Returns the final-normed hidden [B, T, hidden];
    hidden_states, if given, receives forward's list, each entry [B, T, hidden] gathered over the chunks."""
    chunk = chunk_size or prefill_chunk_width(tokens.shape[0])
    out, per_chunk = [], []
    for s in range(0, tokens.shape[1], chunk):
        n_valid = (lengths - s).clamp(0, min(chunk, tokens.shape[1] - s))
        states: list[torch.Tensor] | None = None if hidden_states is None else []
        out.append(model(tokens[:, s : s + chunk], state, n_valid, states))
        commit_accepted(state, n_valid)
        per_chunk.append(states)
    if hidden_states is not None:
        hidden_states.extend(torch.cat(parts, dim=1) for parts in zip(*per_chunk, strict=True))
    return torch.cat(out, dim=1)


# A prefill of at most this many positions (batch x width) on a device that captures graphs runs padded to a fixed
# width, as a captured graph: its hundreds of launches would otherwise cost the host more than the device's work.
# Beyond it the device's work hides their cost, and the graph's memory would grow with it.
GRAPH_PREFILL_POSITIONS = 16384


def prefill_width(length: int, chunk_size: int | None) -> int:
    """The width a captured prefill runs at: chunk_size, or the prompt length rounded up to CAPACITY_STEP (so
    that prompts of other lengths replay the same graph)."""
    return chunk_size or -(-length // CAPACITY_STEP) * CAPACITY_STEP


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
    """One chunk of padded_prefill, without a host synchronisation: the forward with static shapes, committed."""
    hidden = model(tokens, state, n_valid, static_shapes=True)
    commit_accepted(state, n_valid)
    return hidden


def mtp_prefill_chunk(model: Qwen35, state: ModelState, next_tokens: torch.Tensor, hidden: torch.Tensor,
                      last: torch.Tensor, n_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of mtp_prefill: the head over next_tokens [B, t] and hidden [B, t, hidden] at the state's
    positions, n_valid [B] of them committed. Returns the logits [B, V] and the head's output [B, hidden] at row
    last[b]. No host synchronisation: a graph can capture it."""
    logits, out = model.mtp_forward(next_tokens, hidden, state, logits_at=last)
    commit_accepted(state, n_valid)
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


def scratch_copy(state: ModelState) -> ModelState:
    """The same state with every tensor cloned: a step can be warmed up on it without touching the caches."""
    layers = []
    for layer in state.layers:
        twin = copy.copy(layer)
        for name, value in vars(layer).items():
            if isinstance(value, torch.Tensor | VerifyLog):
                setattr(twin, name, value.clone())
        layers.append(twin)
    return ModelState(state.positions.clone(), layers, state.capacity)


def set_staged(state: ModelState, t: int) -> None:
    """What a decode / verify forward (t tokens) or a commit (t = 0) leaves in each GDN layer's Python
    attribute, which a graph replay does not run."""
    for layer in state.layers:
        if isinstance(layer, GDNState):
            layer.staged = t


class CapturedStep:
    """fn(*states, *inputs) captured once as a device graph over `states` and static copies of `inputs`
    (CUDA graphs: the launches of a whole step replayed at once). A call copies the new inputs in, replays,
    restores the step's Python-side effect on the states (GDN layers staged = t) and returns fresh outputs."""

    def __init__(self, fn: Callable, states: Sequence[ModelState], inputs: Sequence[torch.Tensor], staged: int,
                 pool=None) -> None:
        self.inputs, self.states, self.staged = [x.clone() for x in inputs], states, staged
        self.graph = DeviceGraph(states[0].positions.device, pool)  # outputs are cloned out: pools can be shared
        layers = [layer for state in states for layer in state.layers]
        before = [getattr(layer, "staged", 0) for layer in layers]
        # compiles kernels, makes workspaces
        self.graph.warm_up(lambda: fn(*(scratch_copy(state) for state in states), *self.inputs))
        self.outputs = self.graph.capture(lambda: fn(*states, *self.inputs))
        for layer, value in zip(layers, before, strict=True):
            if isinstance(layer, GDNState):
                layer.staged = value

    def __call__(self, *inputs: torch.Tensor):
        for buf, x in zip(self.inputs, inputs, strict=True):
            buf.copy_(x)
        self.graph.replay()
        for state in self.states:
            set_staged(state, self.staged)
        if self.outputs is None or isinstance(self.outputs, torch.Tensor):
            return None if self.outputs is None else self.outputs.clone()
        return tuple(x.clone() for x in self.outputs)


@dataclass
class RoundParts:
    """The model steps of an MTP round, run directly on two states or as the captured steps of Steps."""

    draft: Callable  # (head logits [B, V], head output [B, hidden]) -> drafts [B, k]
    positions: torch.Tensor  # the target state's committed positions [B]
    target: Callable  # tokens [B, t] -> (final hidden [B, t, hidden], logits [B, t, V]), staged
    commit: Callable  # n_new [B] -> None: the target keeps that many of its staged tokens
    catch_up: Callable  # (emitted, hidden, start, accepted) -> the head's (logits [B, 1, V], output)
    commit_mtp: Callable  # n_new [B] -> None

    @classmethod
    def direct(cls, model: Qwen35, state: ModelState, mtp_state: ModelState, k: int) -> RoundParts:
        def target(tokens):
            hidden = model(tokens, state)
            return hidden, model.logits(hidden)

        return cls(lambda lg, h: draft(model, mtp_state, lg, h, k), state.positions, target,
                   lambda n: commit_accepted(state, n),
                   lambda tok, h, st, at: model.mtp_forward(tok, h, mtp_state, st, logits_at=at),
                   lambda n: commit_accepted(mtp_state, n))


def mtp_round_body(parts: RoundParts, accept: Callable, tok: torch.Tensor, mtp_logits: torch.Tensor,
                   mtp_hidden: torch.Tensor, active: torch.Tensor, produced: torch.Tensor, stop_tokens: torch.Tensor,
                   max_new_tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Draft k tokens, verify k + 1 positions in one target forward, accept (accept(logits, drafts) ->
    (accepted [B], next token [B])), commit what the requests that still run (active [B]) keep, and let the
    head catch up over the verified positions. Returns (next token [B], emitted tokens then the accepted
    count [B, k + 2], the head's logits [B, V] and output [B, hidden] for the next drafts, active, produced)."""
    rows = torch.arange(tok.shape[0], device=tok.device)
    drafts = parts.draft(mtp_logits, mtp_hidden)
    start = parts.positions.clone()
    hidden, logits = parts.target(torch.cat([tok[:, None], drafts], dim=1))  # verify k + 1 positions
    accepted, tok = accept(logits, drafts)
    n_new = (accepted + 1) * active
    parts.commit(n_new)
    emitted = torch.cat([drafts, tok[:, None]], dim=1)  # d_1..d_a, then the target's token
    emitted[rows, accepted] = tok
    active, produced = advanced(emitted, n_new, active, produced, stop_tokens, max_new_tokens)
    # The head catches up over the verified positions: row i pairs emitted token i with hidden i.
    logits, head_out = parts.catch_up(emitted, hidden, start, accepted)
    parts.commit_mtp(n_new)
    return (tok, torch.cat([emitted, accepted[:, None]], dim=1), logits[:, 0], head_out[rows, accepted], active,
            produced)


class Steps:
    """The per-round steps of generation - target decode / verify of t tokens with its logits, commit, MTP
    drafting and catch-up - run eagerly or, where the device supports it, each captured once as a graph; with
    greedy decoding a whole decode step or MTP round is one graph (decode, mtp_round)."""

    def __init__(self, model: Qwen35, state: ModelState, mtp_state: ModelState | None, graphs: bool) -> None:
        self.model, self.state, self.mtp_state, self.graphs = model, state, mtp_state, graphs
        self.captured: dict[tuple, CapturedStep] = {}
        self.prefill_pool = None  # one memory pool for the prefill graphs of every width: one runs at a time

    def _run(self, key: tuple, fn: Callable, state: ModelState | tuple[ModelState, ...],
             inputs: Sequence[torch.Tensor], staged: int, pool=None):
        states = state if isinstance(state, tuple) else (state,)
        if not self.graphs:
            return fn(*states, *inputs)
        if key not in self.captured:
            self.captured[key] = CapturedStep(fn, states, inputs, staged, pool)
        return self.captured[key](*inputs)

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, chunk_size: int | None) -> torch.Tensor:
        """prefill() of tokens [B, T] (lengths [B]) into the target state. Where graphs can be captured and the
        prefill is small enough to be bound by launches (GRAPH_PREFILL_POSITIONS), padded to a fixed width with
        static shapes, each chunk a graph with `graphs` (the same kernels either way, so the same bits)."""
        width = prefill_width(tokens.shape[1], chunk_size)
        if not self.prefill_padded(tokens.shape[0], width):
            return prefill(self.model, self.state, tokens, lengths, chunk_size)
        direct = functools.partial(static_prefill_chunk, self.model)

        def run(state, chunk, n_valid):
            return self._run(("prefill", width), direct, state, [chunk, n_valid], 0, self.prefill_pool)

        return padded_prefill(run, self.state, tokens, lengths, width)

    def mtp_prefill(self, next_tokens: torch.Tensor, hidden: torch.Tensor, lengths: torch.Tensor,
                    chunk_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """mtp_prefill() into the head's state, padded and captured as prefill() is (the head's chunks right-padded
        with token 0 and zero hidden rows, which it commits none of)."""
        direct = functools.partial(mtp_prefill_chunk, self.model)
        width = prefill_width(next_tokens.shape[1], chunk_size)
        if not self.prefill_padded(next_tokens.shape[0], width):
            return mtp_prefill(direct, self.mtp_state, next_tokens, hidden, lengths, chunk_size)

        def run(state, tokens, h, last, n_valid):
            return self._run(("mtp prefill", width), direct, state, [tokens, h, last, n_valid], 0, self.prefill_pool)

        return mtp_prefill(run, self.mtp_state, pad_to_width(next_tokens, width), pad_to_width(hidden, width),
                           lengths, width)

    def prefill_padded(self, batch: int, width: int) -> bool:
        """Whether a prefill of `batch` rows in chunks of `width` runs padded with static shapes (each chunk a
        graph with `graphs`): where graphs can be captured and the prefill is small enough to be bound by its
        launches (GRAPH_PREFILL_POSITIONS). Makes the graphs' shared memory pool on first use."""
        if not graphs_supported(self.model.device) or batch * width > GRAPH_PREFILL_POSITIONS:
            return False
        if self.graphs and self.prefill_pool is None:
            self.prefill_pool = DeviceGraph.new_pool(self.model.device)
        return True

    def target(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode / verify tokens [B, t]: (final hidden [B, t, hidden], logits [B, t, vocab]), staged."""
        def fn(state, tok):
            hidden = self.model(tok, state)
            return hidden, self.model.logits(hidden)

        return self._run(("target", tokens.shape[1]), fn, self.state, [tokens], tokens.shape[1])

    def commit(self, n_new: torch.Tensor) -> None:
        staged = next((layer.staged for layer in self.state.layers if isinstance(layer, GDNState)), 0)
        if not self.graphs or not staged:
            commit_accepted(self.state, n_new)
            return
        self._run(("commit", staged), lambda state, n: commit_accepted(state, n), self.state, [n_new], 0)

    def decode(self, tok: torch.Tensor, progress: DeviceProgress, sampling: SamplingParams,
               generator: torch.Generator) -> torch.Tensor:
        """One plain decode step of every request: tok [B] in, the next token [B] out, committed (for the
        requests progress says still run) and progress advanced. Greedy with graphs, the whole step - forward,
        commit, argmax, progress - is one graph; otherwise the forward and the commit are (a sampler's draws
        stay eager)."""
        if sampling.greedy and self.graphs:
            def fn(state, tok, active, produced, stop_tokens, max_new_tokens):
                counts = active.long()
                hidden = self.model(tok[:, None], state)
                commit_accepted(state, counts)
                new = self.model.logits(hidden)[:, 0].argmax(-1)
                return new, *advanced(new[:, None], counts, active, produced, stop_tokens, max_new_tokens)

            inputs = [tok, progress.active, progress.produced, progress.stop_tokens, progress.max_new_tokens]
            new, progress.active, progress.produced = self._run(("decode", progress.stop_tokens.numel()), fn,
                                                                self.state, inputs, 0)
            return new
        counts = progress.active.long()
        _, logits = self.target(tok[:, None])
        self.commit(counts)
        new = sample(logits[:, 0], sampling, generator)
        progress.advance(new[:, None], counts)
        return new

    def mtp_round(self, tok: torch.Tensor, mtp_logits: torch.Tensor, mtp_hidden: torch.Tensor, k: int,
                  progress: DeviceProgress, sampling: SamplingParams, generator: torch.Generator
                  ) -> tuple[torch.Tensor, ...]:
        """One MTP round of every request (mtp_round_body) from the last token tok [B] and the head's logits
        [B, V] and output [B, hidden]; progress advanced. Greedy with graphs, the whole round is one graph over
        both states; otherwise its forwards and commits are (a sampler's draws stay eager). Returns the next
        token [B], the round's record [B, k + 2] (emitted tokens, then the accepted count) and the head's next
        logits and output."""
        if sampling.greedy and self.graphs:
            def fn(state, mtp_state, tok, mtp_logits, mtp_hidden, active, produced, stop_tokens, max_new_tokens):
                return mtp_round_body(RoundParts.direct(self.model, state, mtp_state, k), greedy_accept, tok,
                                      mtp_logits, mtp_hidden, active, produced, stop_tokens, max_new_tokens)

            key = ("mtp round", k, progress.stop_tokens.numel())
            inputs = [tok, mtp_logits, mtp_hidden, progress.active, progress.produced, progress.stop_tokens,
                      progress.max_new_tokens]
            *out, progress.active, progress.produced = self._run(key, fn, (self.state, self.mtp_state), inputs, 0)
            return tuple(out)
        parts = RoundParts(lambda lg, h: self.draft(lg, h, k), self.state.positions, self.target, self.commit,
                           self.mtp_catch_up, lambda n: commit_accepted(self.mtp_state, n))
        *out, progress.active, progress.produced = mtp_round_body(
            parts, lambda logits, drafts: accept_drafts(logits, drafts, sampling, generator), tok, mtp_logits,
            mtp_hidden, progress.active, progress.produced, progress.stop_tokens, progress.max_new_tokens)
        return tuple(out)

    def draft(self, logits: torch.Tensor, hidden: torch.Tensor, k: int) -> torch.Tensor:
        return self._run(("draft", k), lambda state, lg, h: draft(self.model, state, lg, h, k), self.mtp_state,
                         [logits, hidden], 0)

    def mtp_catch_up(self, emitted: torch.Tensor, hidden: torch.Tensor, start: torch.Tensor,
                     accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def fn(state, tok, h, st, at):
            return self.model.mtp_forward(tok, h, state, st, logits_at=at)

        return self._run(("mtp", emitted.shape[1]), fn, self.mtp_state, [emitted, hidden, start, accepted], 0)


def use_graphs(model: Qwen35, graphs: bool | None) -> bool:
    """Capture steps as graphs: by default where the device supports it (MoE too: its routing stays on the
    device, in shapes fixed by the batch; a split model's steps too, their collectives captured with them: the
    expert-parallel exchange of a step has shapes fixed by the batch, expert_parallel.py)."""
    supported = graphs_supported(model.device)
    if graphs is None:
        return supported
    if graphs and not supported:
        raise NpuportError(f"graph capture is not available on {model.device}")
    return graphs


def use_invariance(model: Qwen35, invariant: bool | None, mtp: int = 0) -> bool:
    """Batch-invariant steps (runtime/invariance.py): as asked; else as the model was set up
    (Qwen35.batch_invariant); else on with MTP (mtp > 0: a verify step then rounds as the decode steps it stands
    for, so greedy MTP output is greedy output - to compare the two, give the plain call invariant=True too), off
    without, and off on several devices (their expert-parallel exchange sizes its kernels by the step: not shown
    invariant yet). Only where the Triton kernels run, GPU or NPU: elsewhere the references run, which the setting
    does not change (exact enough in float32 / float64 on CPU)."""
    if not runs_triton(model.device):
        return False
    if invariant is not None:
        return invariant
    if model.batch_invariant is not None:
        return model.batch_invariant
    return mtp > 0 and not model.parallel.active


def planned_rows(batch: int) -> int:
    """The rows batch-invariant steps of a call of `batch` requests are planned for (runtime/invariance.py): the
    longest verify step any k could make, so that a plain and a speculative call take the same paths."""
    return batch * (MAX_DRAFTS + 1)


# Capacities are rounded up to this many positions, so that calls with prompts of other lengths find the same
# states and captured steps.
CAPACITY_STEP = 256


_KEPT_STEPS_LOCK = threading.Lock()  # guards creating a model's lock for its kept steps


@contextlib.contextmanager
def reusable_steps(model: Qwen35, batch: int, capacity: int, mtp: int, graphs: bool,
                   invariant_rows: int | None = None) -> Iterator[Steps]:
    """Steps over fresh target (and, with mtp, MTP head) states for `batch` requests of `capacity` positions.
    With graphs, the last call's states and captured steps are reset and reused when the shapes match (one set
    kept per model): a generate call then replays graphs instead of capturing them again (tens of ms a call).
    A call that finds the kept set in use by another thread gets fresh states of its own."""
    with _KEPT_STEPS_LOCK:
        lock = model.__dict__.setdefault("_kept_steps_lock", threading.Lock())
    if not graphs or not lock.acquire(blocking=False):
        mtp_state = model.new_mtp_state(batch, capacity) if mtp else None
        yield Steps(model, model.new_state(batch, capacity, spec_tokens=mtp), mtp_state, graphs)
        return
    try:
        capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
        key = (batch, capacity, mtp, model.dtype, invariant_rows)  # steps captured in another mode do not serve
        kept = model.__dict__.get("_kept_steps")
        if kept is None or kept[0] != key:
            model.__dict__["_kept_steps"] = None  # the old set's memory goes before the new one is made
            mtp_state = model.new_mtp_state(batch, capacity) if mtp else None
            kept = (key, Steps(model, model.new_state(batch, capacity, spec_tokens=mtp), mtp_state, graphs))
            model.__dict__["_kept_steps"] = kept
        steps = kept[1]
        for state in (steps.state, steps.mtp_state):
            if state is not None:
                reset_state(state)
        yield steps
    finally:
        lock.release()


@mirrored
@torch.no_grad()
def generate(model: Qwen35, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], *, mtp: int = 0,
             sampling: SamplingParams | None = None, stop_tokens: Iterable[int] = (),
             prefill_chunk: int | None = None, graphs: bool | None = None,
             should_stop: StopCheck | None = None, invariant: bool | None = None,
             on_tokens: TokenSink | None = None, on_finish: FinishSink | None = None) -> GenerationResult:
    """Generate up to max_new_tokens for each prompt (token ids; a batch may mix lengths; one limit for all, or
    one per prompt), with MTP speculative decoding of `mtp` drafts per round (0 = plain decoding). Greedy at
    temperature 0. graphs: capture each decode / verify / draft step as a device graph (default: see use_graphs).
    should_stop(index, tokens): called every STOP_CHECK_EVERY new tokens of request `index` with all it has
    produced; True ends that request ("stop"), e.g. once its text holds a stop string. The tokens it produced
    up to then are the same as without the check (requests of a batch do not affect each other).
    on_tokens(index, new): the tokens request `index` has just produced, as the host sees them (every few steps),
    up to its end: a stream's source. on_finish(index, tokens, reason): request `index` has ended, with all of
    its tokens, as soon as the host knows (a batch's other requests may still run).
    invariant: batch-invariant decode and verify steps (default: see use_invariance), meant to make greedy MTP
    output greedy output bit for bit."""
    sampling = sampling or SamplingParams()
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if not 0 <= mtp <= MAX_DRAFTS:
        raise NpuportError(f"--mtp must be between 0 and {MAX_DRAFTS}, got {mtp}")
    if len(limits) != len(prompts):
        raise NpuportError(f"{len(limits)} max_new_tokens for {len(prompts)} prompts")
    if any(n < 1 for n in limits):
        raise NpuportError("max_new_tokens must be at least 1")
    if mtp and model.mtp is None:
        raise NpuportError("this checkpoint has no MTP head (mtp.*); speculative decoding needs one")
    device = model.device
    tokens, lengths = pad_prompts(prompts, device)
    batch = len(prompts)
    graphs = use_graphs(model, graphs)
    generator = make_generator(sampling.seed, device)
    rows = planned_rows(batch) if use_invariance(model, invariant, mtp) else None
    capacity = tokens.shape[1] + max(limits) + mtp + 1
    out = _Outputs(limits, stop_tokens, should_stop, on_tokens, on_finish)
    with reusable_steps(model, batch, capacity, mtp, graphs, rows) as steps, batch_invariant(rows):
        return _generate(model, steps, tokens, lengths, out, mtp, sampling, generator, prefill_chunk)


def _generate(model: Qwen35, steps: Steps, tokens: torch.Tensor, lengths: torch.Tensor, out: _Outputs, mtp: int,
              sampling: SamplingParams, generator: torch.Generator, prefill_chunk: int | None) -> GenerationResult:
    """generate's rounds over the states of `steps`: prefill, then decode or MTP rounds until every request of
    `out` ends."""
    device, batch = model.device, tokens.shape[0]
    rows = torch.arange(batch, device=device)

    hidden = steps.prefill(tokens, lengths, prefill_chunk)
    next_tok = sample(model.logits(hidden[rows, lengths - 1]), sampling, generator)
    out.add(next_tok[:, None], torch.ones_like(lengths))

    if mtp == 0:
        while out.running():
            progress, rounds = DeviceProgress(out, device), []
            for _ in range(out.rounds_before_sync()):
                next_tok = steps.decode(next_tok, progress, sampling, generator)
                rounds.append(next_tok[:, None])
            for new in torch.stack(rounds).cpu():  # the one host synchronisation of these rounds
                out.add(new, out.active(new.device).long())
        return GenerationResult(out.tokens, out.reasons)

    shifted = tokens.roll(-1, dims=1)
    shifted[rows, lengths - 1] = next_tok
    with batch_invariant(None):  # the head's prefill is no step either
        mtp_logits, mtp_hidden = steps.mtp_prefill(shifted, hidden, lengths, prefill_chunk)
    stats = AcceptanceStats.empty(batch, mtp)
    while out.running():
        progress, rounds = DeviceProgress(out, device), []
        for _ in range(out.rounds_before_sync()):
            next_tok, round_, mtp_logits, mtp_hidden = steps.mtp_round(next_tok, mtp_logits, mtp_hidden, mtp,
                                                                       progress, sampling, generator)
            rounds.append(round_)
        for round_ in torch.stack(rounds).cpu():  # the one host synchronisation of these rounds
            emitted, accepted = round_[:, :-1], round_[:, -1]
            active = out.active(round_.device)
            out.add(emitted, (accepted + 1) * active)
            stats.record(accepted, active)
    return GenerationResult(out.tokens, out.reasons, stats)


@mirrored
@torch.no_grad()
def forward_logits(model: Qwen35, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One prefill from empty caches, for fidelity checks: logits [B, T, V] (rows past a prompt's length
    are padding) and the hidden states transformers' output_hidden_states gives (embeddings, outputs of
    layers 0..n-2, final normed hidden), each [B, T, hidden]."""
    hidden_states: list[torch.Tensor] = []
    return model.logits(prefilled_hidden(model, prompts, hidden_states)), hidden_states


@mirrored
@torch.no_grad()
def logits_in_chunks(model: Qwen35, sequence: list[int], start: int, chunk: int,
                     reduce: Callable[[torch.Tensor, int], object]) -> list:
    """reduce(logits [n, V], s) for each chunk of up to `chunk` positions s.. of `sequence` from `start` (>= 1),
    the logits those of the positions before (s - 1..), after one prefill from empty caches: never the whole
    sequence's [T, V] at once. On a split model every rank makes the call (its prefill and the logits' gathers
    are collectives); reduce must pickle (a module-level function or a partial of one)."""
    hidden = prefilled_hidden(model, [sequence])[0]  # [T, hidden]
    return [reduce(model.logits(hidden[s - 1 : min(s + chunk, len(sequence)) - 1]), s)
            for s in range(start, len(sequence), chunk)]


def prefilled_hidden(model: Qwen35, prompts: Sequence[Sequence[int]],
                     hidden_states: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The final-normed hidden [B, T, hidden] of one chunked prefill from empty caches (rows past a prompt's
    length are padding): what the logits are computed from, a chunk of positions at a time where [T, V] logits
    would not fit."""
    tokens, lengths = pad_prompts(prompts, model.device)
    return prefill(model, model.new_state(len(prompts), tokens.shape[1]), tokens, lengths,
                   hidden_states=hidden_states)
