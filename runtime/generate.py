"""Generation: prefill, then plain decode steps or MTP speculative rounds (rounds.py) until every request stops,
with stop tokens, max tokens, stop checks, streaming sinks and acceptance statistics per draft position. The
device runs SYNC_EVERY rounds between two looks of the host at their tokens; prefill.py pads and chunks the
prompts, graphs.py captures the steps."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from npuport.errors import NpuportError
from npuport.runtime.dispatch import dispatch
from npuport.runtime.graphs import Steps, reusable_steps
from npuport.runtime.invariance import batch_invariant
from npuport.runtime.lockstep import mirrored
from npuport.runtime.model import Qwen35
from npuport.runtime.prefill import pad_prompts, prefilled_hidden
from npuport.runtime.run_options import RunOptions, run_options
from npuport.runtime.sampling import SamplingParams, accept_drafts, make_generator, sample


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
    max_new_tokens - kept on the device, so the rounds need not ask the host. The host then replays the rounds'
    tokens through _Outputs, which decides exactly as before (stop checks included); a request the host
    finds finished earlier than the device did only ran a few steps more, on its own state, whose tokens
    are dropped."""

    def __init__(self, out: _Outputs, device: torch.device) -> None:
        self.active = out.active(device)
        self.produced = torch.tensor([len(t) for t in out.tokens], device=device)
        self.stop_tokens = torch.tensor(sorted(out.stop_tokens) or [-1], device=device)
        # a tensor [B], so that steps captured once serve calls with any max_new_tokens
        self.max_new_tokens = torch.tensor(out.max_new_tokens, device=device)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """(active, produced, stop_tokens, max_new_tokens): what a round body takes after its own inputs."""
        return self.active, self.produced, self.stop_tokens, self.max_new_tokens

    def take(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """A round body's outputs without the (active, produced) they end with, which are kept."""
        *rest, self.active, self.produced = outputs
        return tuple(rest)


@mirrored
@torch.no_grad()
def generate(model: Qwen35, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
             options: RunOptions | None = None, *, mtp: int = 0, graphs: bool | None = None,
             invariant: bool | None = None, sampling: SamplingParams | None = None, stop_tokens: Iterable[int] = (),
             prefill_chunk: int | None = None, should_stop: StopCheck | None = None,
             on_tokens: TokenSink | None = None, on_finish: FinishSink | None = None) -> GenerationResult:
    """Generate up to max_new_tokens for each prompt (token ids; a batch may mix lengths; one limit for all, or
    one per prompt), greedy at temperature 0. options: how to run (RunOptions, resolved once by the command);
    without them, mtp / graphs / invariant are resolved here by run_options (MTP speculative decoding of `mtp`
    drafts per round, 0 = plain decoding; graphs: decode / verify / draft steps captured as device graphs;
    invariant: batch-invariant decode and verify steps, meant to make greedy MTP output greedy output bit for bit).
    should_stop(index, tokens): called every STOP_CHECK_EVERY new tokens of request `index` with all it has
    produced; True ends that request ("stop"), e.g. once its text holds a stop string. The tokens it produced
    up to then are the same as without the check (requests of a batch do not affect each other).
    on_tokens(index, new): the tokens request `index` has just produced, as the host sees them (every few steps),
    up to its end: a stream's source. on_finish(index, tokens, reason): request `index` has ended, with all of
    its tokens, as soon as the host knows (a batch's other requests may still run)."""
    if options is None:
        options = run_options(model, mtp, graphs, invariant)
    elif (mtp, graphs, invariant) != (0, None, None):
        raise NpuportError("generate: give either options or mtp / graphs / invariant, not both")
    sampling = sampling or SamplingParams()
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(limits) != len(prompts):
        raise NpuportError(f"{len(limits)} max_new_tokens for {len(prompts)} prompts")
    if any(n < 1 for n in limits):
        raise NpuportError("max_new_tokens must be at least 1")
    tokens, lengths = pad_prompts(prompts, model.device)
    batch, k = len(prompts), options.mtp
    rows = options.planned_rows(batch)
    capacity = tokens.shape[1] + max(limits) + k + 1
    out = _Outputs(limits, stop_tokens, should_stop, on_tokens, on_finish)
    with (reusable_steps(model, batch, capacity, k, options.graphs, rows) as steps, batch_invariant(rows),
          dispatch(bf16=options.dispatch.bf16)):
        return _generate(model, steps, tokens, lengths, out, k, sampling, prefill_chunk)


def _generate(model: Qwen35, steps: Steps, tokens: torch.Tensor, lengths: torch.Tensor, out: _Outputs, k: int,
              sampling: SamplingParams, prefill_chunk: int | None) -> GenerationResult:
    """generate's rounds over the states of `steps`: prefill, then decode steps or MTP rounds of k drafts until
    every request of `out` ends."""
    device, batch = model.device, tokens.shape[0]
    rows = torch.arange(batch, device=device)
    generator = make_generator(sampling.seed, device)

    hidden = steps.prefill(tokens, lengths, prefill_chunk)
    next_tok = sample(model.logits(hidden[rows, lengths - 1]), sampling, generator)
    out.add(next_tok[:, None], torch.ones_like(lengths))

    if k == 0:
        choose = None if sampling.greedy else functools.partial(sample, params=sampling, generator=generator)
        while out.running():
            progress, rounds = DeviceProgress(out, device), []
            for _ in range(out.rounds_before_sync()):
                (next_tok,) = progress.take(steps.decode(next_tok, progress.tensors(), choose))
                rounds.append(next_tok[:, None])
            for new in torch.stack(rounds).cpu():  # the one host synchronisation of these rounds
                out.add(new, out.active(new.device).long())
        return GenerationResult(out.tokens, out.reasons)

    accept = None if sampling.greedy else functools.partial(accept_drafts, params=sampling, generator=generator)
    shifted = tokens.roll(-1, dims=1)
    shifted[rows, lengths - 1] = next_tok
    with batch_invariant(None):  # the head's prefill is no step either
        mtp_logits, mtp_hidden = steps.mtp_prefill(shifted, hidden, lengths, prefill_chunk)
    stats = AcceptanceStats.empty(batch, k)
    while out.running():
        progress, rounds = DeviceProgress(out, device), []
        for _ in range(out.rounds_before_sync()):
            next_tok, round_, mtp_logits, mtp_hidden = progress.take(steps.mtp_round(
                k, next_tok, mtp_logits, mtp_hidden, progress.tensors(), accept))
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
