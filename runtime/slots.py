"""Slots of a continuous batch (runtime/serving/continuous.py): one set of target and MTP-head states whose rows -
slots - requests take and leave one at a time, while the others decode.

The pool has 2 x `rows` slots: decode slots [0, rows) and as many staging slots [rows, 2 rows). A prompt is
prefilled in chunks into staging slots (rows that arrived together prefill together, in a contiguous range), and
once its last chunk is in, its slot is moved (its rows of every state tensor copied) to the next decode slot. The
requests that decode hold slots [0, n): a decode step runs on the first `bucket(n)` slots - a view of the pool's
tensors, captured as a graph per bucket - so it never touches a staging slot, and a slot that a finished request
leaves is filled by moving the last one down. With graphs, a prefill chunk of slots from the first staging slot on
runs the same way where it can (graph_prefill_shape): padded to a bucket of rows and a width, on a view of the
staging slots, as a graph captured per shape. What a row needs between two steps lives in the pool: its last token,
and with MTP the head's logits and output for its next drafts; each slot has its own sampler.

Every function here that touches the model is mirrored (runtime/lockstep.py): on a split model the other ranks make
the same call on their parts of the pool, so the collectives inside meet; only rank 0 decides what to call.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from npuport.devices import DeviceGraph, graphs_supported
from npuport.kernels.gated_delta_rule import VerifyLog
from npuport.runtime.dispatch import dispatch
from npuport.runtime.graphs import Steps
from npuport.runtime.invariance import batch_invariant
from npuport.runtime.lockstep import mirrored
from npuport.runtime.model import Qwen35
from npuport.runtime.prefill import (
    GRAPH_PREFILL_POSITIONS,
    mtp_prefill_chunk,
    prefill,
    rounded_capacity,
)
from npuport.runtime.run_options import RunOptions
from npuport.runtime.sampling import (
    SamplingParams,
    greedy_accept,
    make_generator,
    rejection_sample,
    sample,
    target_probs,
)
from npuport.runtime.state import KVCache, ModelState, reset_state

NO_STOP = -1  # the device's stop-token list when the host ends every request itself
NO_LIMIT = 1 << 62  # the device's max_new_tokens when the host ends every request itself

# A prefill chunk captured as a graph runs with static shapes: its attention reads the slots' whole caches, and its
# capture warms up on copies of them, so a pool of more positions than this prefills eagerly.
GRAPH_PREFILL_CAPACITY = 8192
# The most shapes (rows, width) a pool pads prefill chunks to: each captured graph keeps its static inputs and
# outputs (a chunk of 16,384 positions: 64 MB of hidden states at a hidden size of 2,048); a chunk of another shape
# runs as it is.
GRAPH_PREFILL_SHAPES = 16


def state_rows(state: ModelState, start: int, stop: int) -> ModelState:
    """Slots start..stop of `state` as a state of their own: every tensor a view of the pool's (a write through it
    is a write to those slots), the GDN verify log's halves too (log_storage_rows tells its kernels the stride)."""
    layers = []
    for layer in state.layers:
        twin = copy.copy(layer)
        if isinstance(layer, KVCache):
            twin.k, twin.v = layer.k[start:stop], layer.v[start:stop]
        else:
            twin.recurrent, twin.conv = layer.recurrent[start:stop], layer.conv[start:stop]
            if layer.log is not None:
                log = layer.log
                twin.log = VerifyLog(log.keys[:, start:stop], log.log_decay[:, start:stop], log.writes[:, start:stop],
                                     log.side, log.pending[start:stop])
        layers.append(twin)
    return ModelState(state.positions[start:stop], layers, state.capacity)


def move_state_rows(state: ModelState, source: Sequence[int], target: Sequence[int]) -> None:
    """Copy slots `source` of `state` onto slots `target` (in order; none of target among source)."""
    src = torch.tensor(list(source), device=state.positions.device)
    dst = torch.tensor(list(target), device=state.positions.device)
    state.positions[dst] = state.positions[src]
    for layer in state.layers:
        if isinstance(layer, KVCache):
            layer.k[dst], layer.v[dst] = layer.k[src], layer.v[src]
            continue
        layer.recurrent[dst], layer.conv[dst] = layer.recurrent[src], layer.conv[src]
        if layer.log is not None:
            log = layer.log
            log.pending[dst] = log.pending[src]
            for x in (log.keys, log.log_decay, log.writes):
                x[:, dst] = x[:, src]


def grown_state(state: ModelState, capacity: int) -> ModelState:
    """`state` with room for `capacity` positions: new KV caches holding the old ones' entries (the GDN states
    have no length and are kept)."""
    layers = []
    for layer in state.layers:
        if isinstance(layer, KVCache):
            twin = copy.copy(layer)
            b, s, h, d = layer.k.shape
            twin.k = layer.k.new_zeros(b, capacity, h, d)
            twin.v = torch.zeros_like(twin.k)
            twin.k[:, :s], twin.v[:, :s] = layer.k, layer.v
            layer = twin
        layers.append(layer)
    return ModelState(state.positions, layers, capacity)


@dataclass(frozen=True)
class RowSampling:
    """How one slot chooses its tokens: greedy, or drawing at `params` from a generator of its own seeded with
    `seed` (a request's seed, else one rank 0 drew), so that its draws do not depend on its neighbours."""

    params: SamplingParams = SamplingParams()
    seed: int = 0


@dataclass(frozen=True)
class ChunkRow:
    """One row's share of a prefill chunk: the prompt tokens it prefills now and the prompt's token after them
    (None: the chunk ends the prompt, and the row's first generated token is chosen from its last position)."""

    tokens: list[int]
    after: int | None


@dataclass(frozen=True)
class DecodeRound:
    """What one decode step or MTP round gave each of the slots that decode: its new tokens (the verified drafts
    and the target's token; one token without MTP) and, with MTP, how many drafts were accepted."""

    tokens: list[list[int]]
    accepted: list[int] | None


@dataclass
class SlotPool:
    """The pool's states and what each slot carries between steps (see the module's docstring)."""

    model: Qwen35
    options: RunOptions
    rows: int
    state: ModelState
    mtp_state: ModelState | None
    tokens: torch.Tensor  # [2 rows] each slot's last token, not yet run through the target
    samplers: list[RowSampling | None]
    generators: list[torch.Generator | None]
    head_logits: torch.Tensor | None = None  # [2 rows, V] with MTP: the head's logits for each slot's next drafts
    head_hidden: torch.Tensor | None = None  # [2 rows, hidden] with MTP: the head's output there
    steps: dict[int, Steps] = field(default_factory=dict)  # decode bucket -> its steps over slots [0, bucket)
    staging: dict[int, Steps] = field(default_factory=dict)  # prefill bucket -> its steps over the first staging slots
    prefill_graphs: object = None  # with graphs, the memory pool the staging steps' prefill graphs share
    padded_shapes: set[tuple[int, int]] = field(default_factory=set)  # (rows, width) of the padded chunks run

    @property
    def capacity(self) -> int:
        return self.state.capacity

    def bucket(self, n: int) -> int:
        """The slots a decode step of n requests runs on: n itself, or with graphs graph_rows(n)."""
        return self.graph_rows(n) if self.options.graphs else n

    def graph_rows(self, n: int) -> int:
        """The rows a graph of n rows is captured for: powers of two up to 8, then multiples of 8, never more
        than the decode slots."""
        size = 1 << (n - 1).bit_length() if n <= 8 else -(-n // 8) * 8
        return min(size, self.rows)

    def steps_for(self, bucket: int) -> Steps:
        if bucket not in self.steps:
            self.steps[bucket] = self._steps_over(0, bucket)
        return self.steps[bucket]

    def staging_steps(self, bucket: int) -> Steps:
        """The steps over staging slots [rows, rows + bucket), whose padded prefill (Steps.prefill, mtp_prefill)
        runs a chunk as a graph; the prefill graphs of every bucket share one memory pool (one runs at a time)."""
        if bucket not in self.staging:
            steps = self._steps_over(self.rows, self.rows + bucket)
            if self.options.graphs:
                if self.prefill_graphs is None:
                    self.prefill_graphs = DeviceGraph.new_pool(self.model.device)
                steps.prefill_pool = self.prefill_graphs
            self.staging[bucket] = steps
        return self.staging[bucket]

    def _steps_over(self, start: int, stop: int) -> Steps:
        mtp = None if self.mtp_state is None else state_rows(self.mtp_state, start, stop)
        return Steps(self.model, state_rows(self.state, start, stop), mtp, self.options.graphs)

    def drop_steps(self) -> None:
        """Forget every captured step (their views would outlive the tensors of a grown state)."""
        self.steps.clear()
        self.staging.clear()
        self.padded_shapes.clear()


def graph_width(width: int) -> int:
    """The width a captured prefill chunk of `width` tokens runs at: rounded up to a multiple of 16 and of a
    quarter of the power of two at or below it (from 64 on at most a quarter wider; four widths an octave)."""
    step = max(16, (1 << (width.bit_length() - 1)) // 4)
    return -(-width // step) * step


def graph_prefill_shape(pool: SlotPool, first: int, rows: int, width: int, spare: int) -> tuple[int, int] | None:
    """The (rows, width) a prefill chunk of `rows` slots from `first`, `width` tokens wide, is padded to - as a
    captured graph with graphs, else run eagerly with the same static shapes, so that both give the same bits - or
    None when it runs as it is. It is padded (graph_rows, graph_width) where graphs can be captured, from the first
    staging slot (a graph runs on fixed slots), its padding rows within the `spare` free slots after it, its padded
    positions within GRAPH_PREFILL_POSITIONS (serve's warm-up tunes the GEMMs up to there), the pool within
    GRAPH_PREFILL_CAPACITY, and its shape met already or room for it (GRAPH_PREFILL_SHAPES). Padding rows and
    positions commit nothing: they leave the states of the free slots they run on as they were, and write only
    cache positions that no query reads."""
    if not graphs_supported(pool.model.device) or first != pool.rows or pool.capacity > GRAPH_PREFILL_CAPACITY:
        return None
    shape = pool.graph_rows(rows), graph_width(width)
    if shape[0] - rows > spare or shape[0] * shape[1] > GRAPH_PREFILL_POSITIONS:
        return None
    if shape not in pool.padded_shapes and len(pool.padded_shapes) >= GRAPH_PREFILL_SHAPES:
        return None
    return shape


def pool_of(model: Qwen35) -> SlotPool:
    pool = model.__dict__.get("_slot_pool")
    if pool is None:
        raise RuntimeError("no slot pool: open_slots first")
    return pool


@mirrored
@torch.no_grad()
def open_slots(model: Qwen35, options: RunOptions, rows: int, capacity: int) -> int:
    """Make the model's pool of 2 x rows slots of `capacity` positions (rounded up), or grow the one it has to at
    least that capacity (its slots kept, its captured steps dropped). Returns the pool's capacity."""
    capacity = rounded_capacity(capacity)
    pool = model.__dict__.get("_slot_pool")
    if pool is not None and pool.rows == rows and pool.options == options:
        if capacity > pool.capacity:
            pool.drop_steps()
            pool.state = grown_state(pool.state, capacity)
            if pool.mtp_state is not None:
                pool.mtp_state = grown_state(pool.mtp_state, capacity)
        return pool.capacity
    model.__dict__["_slot_pool"] = None  # the old pool's memory goes first
    k, total = options.mtp, 2 * rows
    mtp_state = model.new_mtp_state(total, capacity) if k else None
    state = model.new_state(total, capacity, spec_tokens=k)
    tokens = torch.zeros(total, dtype=torch.long, device=model.device)
    model.__dict__["_slot_pool"] = SlotPool(model, options, rows, state, mtp_state, tokens, [None] * total,
                                            [None] * total)
    return capacity


@mirrored
def close_slots(model: Qwen35) -> None:
    """Free the model's pool."""
    model.__dict__.pop("_slot_pool", None)


@mirrored
@torch.no_grad()
def prefill_slots(model: Qwen35, first: int, chunk: Sequence[ChunkRow], width: int,
                  samplers: Sequence[RowSampling] | None = None, spare: int = 0) -> list[int | None]:
    """One prefill chunk of slots first.. (len(chunk) of them, one ChunkRow each, at most `width` tokens; a row
    with none is left as it is), committed, the MTP head's cache filled over the same positions. samplers: given
    with a group's first chunk, the slots' samplers from then on (their states are reset: empty caches). spare: the
    free slots after the chunk's, which a chunk padded to run as a captured graph may run over (graph_prefill_shape).
    Returns each row's first generated token where its chunk ended its prompt, else None."""
    pool = pool_of(model)
    rows, device = len(chunk), model.device
    if samplers is not None:
        for slot, sampler in enumerate(samplers, start=first):
            pool.samplers[slot] = sampler
            pool.generators[slot] = None if sampler.params.greedy else make_generator(sampler.seed, device)
        for state in (pool.state, pool.mtp_state):
            if state is not None:
                reset_state(state_rows(state, first, first + rows))
    shape = graph_prefill_shape(pool, first, rows, width, spare)
    if shape is not None:
        pool.padded_shapes.add(shape)
    steps = None if shape is None else pool.staging_steps(shape[0])
    padded_rows, padded_width = shape or (rows, width)
    host_tokens = torch.zeros(padded_rows, padded_width, dtype=torch.long)  # padding rows: no real token
    for b, part in enumerate(chunk):
        host_tokens[b, :len(part.tokens)] = torch.tensor(part.tokens, dtype=torch.long)
    host_valid = torch.zeros(padded_rows, dtype=torch.long)
    host_valid[:rows] = torch.tensor([len(part.tokens) for part in chunk], dtype=torch.long)
    tokens, n_valid = host_tokens.to(device), host_valid.to(device)
    ending = [b for b, part in enumerate(chunk) if part.tokens and part.after is None]
    last = (n_valid - 1).clamp_min(0)
    with dispatch(bf16=pool.options.dispatch.bf16):
        if steps is None:
            hidden = prefill(model, state_rows(pool.state, first, first + rows), tokens, n_valid, width)
        else:  # one chunk of padded_width: Steps pads it with static shapes, as a graph with graphs
            hidden = steps.prefill(tokens, n_valid, padded_width)
        # hidden: [padded_rows, padded_width, hidden]
        firsts: list[int | None] = [None] * rows
        if ending:
            at = torch.tensor(ending, device=device)
            logits = model.logits(hidden[at, last[at]])  # [len(ending), V]
            chosen = _choose(pool, [first + b for b in ending], logits)
            pool.tokens[at + first] = chosen
            for b, token in zip(ending, chosen.tolist(), strict=True):
                firsts[b] = token
        if pool.mtp_state is not None:
            _prefill_head(pool, first, chunk, host_tokens, hidden, last, n_valid, firsts, steps)
    return firsts


def _prefill_head(pool: SlotPool, first: int, chunk: Sequence[ChunkRow], host_tokens: torch.Tensor,
                  hidden: torch.Tensor, last: torch.Tensor, n_valid: torch.Tensor, firsts: list[int | None],
                  steps: Steps | None) -> None:
    """The MTP head over a prefill chunk's positions (host_tokens [R, W] on the host, hidden [R, W, hidden], last
    and n_valid [R]; R >= len(chunk) rows: the chunk's, then padding rows): position t pairs the token after it
    (the prompt's, or the first generated token after the prompt's last) with the target's hidden there; for the
    rows whose prompt ended, its logits and output at the last position are kept for their first drafts. steps:
    the staging slots' steps when the chunk runs as a captured graph, else None."""
    rows = len(chunk)
    following = host_tokens.roll(-1, dims=1)
    for b, part in enumerate(chunk):
        if part.tokens:
            following[b, len(part.tokens) - 1] = part.after if part.after is not None else firsts[b]
    following = following.to(hidden.device)
    with batch_invariant(None):
        if steps is None:
            view = state_rows(pool.mtp_state, first, first + rows)
            logits, out = mtp_prefill_chunk(pool.model, view, following, hidden, last, n_valid)
        else:
            logits, out = steps.mtp_prefill(following, hidden, n_valid, following.shape[1])
    ending = [b for b in range(rows) if firsts[b] is not None]
    if not ending:
        return
    if pool.head_logits is None:
        total = pool.tokens.shape[0]
        pool.head_logits = logits.new_zeros(total, logits.shape[-1])
        pool.head_hidden = out.new_zeros(total, out.shape[-1])
    at = torch.tensor(ending, device=logits.device)
    pool.head_logits[at + first] = logits[at]
    pool.head_hidden[at + first] = out[at]


def _choose(pool: SlotPool, slots: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
    """The tokens slots [n] choose from their logits [n, V]: argmax, a sampler's own draw where it samples."""
    chosen = logits.argmax(-1)
    for i, slot in enumerate(slots):
        sampler = pool.samplers[slot]
        if sampler is not None and not sampler.params.greedy:
            chosen[i] = sample(logits[i:i + 1], sampler.params, pool.generators[slot])[0]
    return chosen


def _accept(pool: SlotPool, logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The verify rule of every slot of a round (logits [B, k + 1, V], drafts [B, k]): greedy matching, rejection
    sampling with its own generator where a slot samples."""
    accepted, token = greedy_accept(logits, drafts)
    for slot in range(drafts.shape[0]):
        sampler = pool.samplers[slot]
        if sampler is not None and not sampler.params.greedy:
            probs = target_probs(logits[slot:slot + 1], sampler.params)
            a, t = rejection_sample(probs, drafts[slot:slot + 1], pool.generators[slot])
            accepted[slot], token[slot] = a[0], t[0]
    return accepted, token


@mirrored
@torch.no_grad()
def decode_slots(model: Qwen35, n: int, rounds: int) -> list[DecodeRound]:
    """`rounds` decode steps (MTP rounds with MTP) of slots [0, n), each from its last token; the host ends the
    requests (the device runs every slot to the last round). Returns what each round gave each slot."""
    pool = pool_of(model)
    bucket, k = pool.bucket(n), pool.options.mtp
    steps = pool.steps_for(bucket)
    progress = _progress(bucket, n, model.device)
    sampled = any(s is not None and not s.params.greedy for s in pool.samplers[:n])
    records = []
    with dispatch(bf16=pool.options.dispatch.bf16), batch_invariant(pool.options.planned_rows(bucket)):
        tok = pool.tokens[:bucket]
        if k == 0:
            choose = (lambda logits: _choose(pool, range(bucket), logits)) if sampled else None
            for _ in range(rounds):
                tok, *_ = steps.decode(tok, progress, choose)
                records.append(tok[:, None])
        else:
            accept = (lambda logits, drafts: _accept(pool, logits, drafts)) if sampled else None
            logits, hidden = pool.head_logits[:bucket], pool.head_hidden[:bucket]
            for _ in range(rounds):
                tok, record, logits, hidden, *_ = steps.mtp_round(k, tok, logits, hidden, progress, accept)
                records.append(record)
            pool.head_logits[:bucket], pool.head_hidden[:bucket] = logits, hidden
        pool.tokens[:bucket] = tok
    out = []
    for record in torch.stack(records).cpu()[:, :n].tolist():  # the one host synchronisation
        if k == 0:
            out.append(DecodeRound(record, None))
        else:
            out.append(DecodeRound([row[:row[-1] + 1] for row in record], [row[-1] for row in record]))
    return out


def _progress(bucket: int, n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """decode_round's progress for slots [0, bucket) of which the first n run: (active, produced, stop tokens,
    max new tokens); the host ends the requests, so no stop token and no limit."""
    return (torch.arange(bucket, device=device) < n, torch.zeros(bucket, dtype=torch.long, device=device),
            torch.tensor([NO_STOP], device=device), torch.full((bucket,), NO_LIMIT, dtype=torch.long, device=device))


@mirrored
@torch.no_grad()
def capture_decode_steps(model: Qwen35) -> int:
    """With graphs, capture the greedy decode step (MTP round with MTP) of every bucket the pool can run, so that
    no client waits for a capture later (a sampled step's parts are captured when first met). Runs no step: the
    slots, their tokens and states are untouched. Returns the number of buckets whose steps it captured."""
    pool = pool_of(model)
    if not pool.options.graphs:
        return 0
    k, device = pool.options.mtp, model.device
    buckets = sorted({pool.bucket(n) for n in range(1, pool.rows + 1)})
    with dispatch(bf16=pool.options.dispatch.bf16):
        for bucket in buckets:
            steps = pool.steps_for(bucket)
            tok, progress = pool.tokens[:bucket], _progress(bucket, bucket, device)
            with batch_invariant(pool.options.planned_rows(bucket)), steps.capture_only():
                if k == 0:
                    steps.decode(tok, progress, None)
                else:
                    hidden = torch.zeros(bucket, model.config.hidden_size, dtype=model.dtype, device=device)
                    steps.mtp_round(k, tok, model.logits(hidden), hidden, progress, None)  # the shapes prefill gives
    return len(buckets)


@mirrored
@torch.no_grad()
def warm_up_prefill(model: Qwen35, options: RunOptions, shapes: Sequence[tuple[int, int]]) -> int:
    """Prefill chunks of these (rows, width) shapes - and the MTP head's over them, with MTP - through scratch
    states of their own (the pool is not touched), so that the kernels they need are compiled and the GEMM tiles of
    their ranges of rows tuned (kernels/w8a8/gemm.py tunes on the first call of a shape) before any client waits.
    Returns the chunks run."""
    for rows in sorted({r for r, _ in shapes}):
        widths = [w for r, w in shapes if r == rows]
        capacity = rounded_capacity(max(widths))
        state = model.new_state(rows, capacity, spec_tokens=options.mtp)
        head = model.new_mtp_state(rows, capacity) if options.mtp else None
        with dispatch(bf16=options.dispatch.bf16):
            for width in widths:
                tokens = torch.zeros(rows, width, dtype=torch.long, device=model.device)
                n_valid = torch.full((rows,), width, device=model.device)
                hidden = prefill(model, state, tokens, n_valid, width)
                if head is not None:
                    with batch_invariant(None):
                        mtp_prefill_chunk(model, head, tokens, hidden, n_valid - 1, n_valid)
                for scratch in (state, head):
                    if scratch is not None:
                        reset_state(scratch)
    return len(shapes)


@mirrored
@torch.no_grad()
def move_slots(model: Qwen35, source: Sequence[int], target: Sequence[int]) -> None:
    """Move slots `source` onto slots `target`: their states, last tokens, head outputs and samplers."""
    if not source:
        return
    pool = pool_of(model)
    for state in (pool.state, pool.mtp_state):
        if state is not None:
            move_state_rows(state, source, target)
    src = torch.tensor(list(source), device=model.device)
    dst = torch.tensor(list(target), device=model.device)
    pool.tokens[dst] = pool.tokens[src]
    if pool.head_logits is not None:
        pool.head_logits[dst], pool.head_hidden[dst] = pool.head_logits[src], pool.head_hidden[src]
    samplers, generators = list(pool.samplers), list(pool.generators)
    for s, t in zip(source, target, strict=True):
        pool.samplers[t], pool.generators[t] = samplers[s], generators[s]
