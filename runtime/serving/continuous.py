"""Continuous batching for `npuport serve`: one worker thread owns the model and its pool of slots
(runtime/slots.py) and runs, again and again, one iteration of

1. arrivals: the rows (a prompt x n each) of new requests wait in line, in order (an idle worker woken by a
   request first takes those that follow it less than SETTLE_S apart: clients answered together send again
   together);
2. admission: the rows in line that fit take staging slots, together (those admitted in one iteration form a
   group: they prefill side by side, in chunks of one width fixed when the group forms, so that a group's
   arithmetic does not depend on what else runs) - one row of each request in turn, the requests with the fewest
   rows in the batch first. When the batch is full, the row that has decoded longest since it took its slot (at
   least ROUND_TOKENS tokens, of a request with more rows in the batch than the next in line's) gives its slot
   back and goes in line, to go on later from its tokens (prompt and tokens prefilled again): a request of many
   long rows cannot hold every slot while another waits;
3. prefill: groups not started yet whose slots are adjacent merge (requests a few milliseconds apart prefill in
   one batch; while rows decode, a group that has just grown waits up to GATHER_ITERATIONS for more); chunks of
   the groups, at most `prefill_tokens` positions in all - the group closest to done first (a short prompt is not
   held behind a long one), each group at most one chunk; a group that got no chunk goes first next time, so that
   short prompts arriving without end cannot starve a long one. A row whose prompt is in takes its first token and
   moves to a decode slot;
4. decode: a few decode steps (MTP rounds with MTP) of every row that decodes - one while a group prefills, else
   at most SYNC_EVERY, fewer when a row needs fewer tokens - then the host looks at their tokens: streams them,
   ends rows at their stop tokens, stop strings or max_tokens, and a row that ended leaves its slot at once.

So a request joins the running batch at the next iteration, no request waits for another's whole prefill or
whole generation, and a long prompt's prefill is interleaved with everyone's decode steps. A request whose
client went away (Job.cancel) leaves at the next iteration, from the line, its prefill or its decode. A request
that asks for log-probabilities gets them computed by the worker once its rows have ended.

Each row samples with a generator of its own (seeded from the request's seed and the row's number, else from a
seed drawn here), so its draws do not depend on its neighbours. Decode steps batch every row: their rounding
follows the batch size unless the steps are batch-invariant (the run options); `serve --batch-invariant` keeps the
RequestBatcher's one row at a time.

Nothing is compiled or tuned while clients wait: where the Triton kernels run, the batcher prefills a chunk of
every shape class on scratch states when it starts (warm_up_shapes, the chunks padded to run as graphs included),
and it captures the decode step of every batch size whenever it makes or grows its pool
(slots.capture_decode_steps). A prefill chunk that runs as a graph (slots.graph_prefill_shape; the prefill
passes it the free staging slots after the group's) is captured the first time its shape is met.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from npuport.devices import graphs_supported, runs_triton
from npuport.runtime.completion import CANCELLED, Completion, stop_token_end
from npuport.runtime.generate import SYNC_EVERY
from npuport.runtime.incremental_text import StopStrings
from npuport.runtime.prefill import GRAPH_PREFILL_POSITIONS
from npuport.runtime.serving.batching import ROUND_TOKENS, Batcher, Job, round_seed
from npuport.runtime.slots import ChunkRow, RowSampling
from npuport.runtime.text_completions import RuntimeCompletions, TextRequest, TextResult

# Positions one iteration prefills at most, over all groups: on a CPU a chunk late in a 32k context costs about
# 0.6 ms a position on the tiny model, and the rows that decode wait for it (1,024: under a second), while a budget
# of one prompt an iteration starves 32 clients of short prompts (bench/RESULTS.md, "Serving benchmark"). On a
# device a prefill call costs tens of ms whatever its width (35B-A3B widths, 8 layers, H100: 3,277 positions a call
# took 101 ms, 8,192 took 68 ms), so 32 prompts of 512 take one or two calls at 16,384, not five: serve over HTTP
# made 0.72x the engine's batch-32 output at 16,384 against 0.39x at 4,096 in the same run (bench/RESULTS.md, run
# AA2).
PREFILL_TOKENS_CPU = 1024
PREFILL_TOKENS_DEVICE = 16384


# Iterations (one decode round each) a new group may wait for more arriving rows before its first chunk, while
# other rows decode (ContinuousBatcher._gathers).
GATHER_ITERATIONS = 2

# An idle worker woken by a request goes on taking the requests that arrive less than SETTLE_S apart, for at most
# SETTLE_MOST_S, before it starts: clients whose answers came together send again together, a few ms apart, and the
# first alone was a prefill call of its own (35B-A3B widths on an H100: one call in five, 23-31 ms each, while the
# other 31 prompts waited; bench/RESULTS.md, run Z2). A request to an idle server waits 2 ms more.
SETTLE_S, SETTLE_MOST_S = 0.002, 0.010

# Chunk widths are multiples of this (when at least this): Triton specialises compiled kernels on integer arguments
# divisible by 16, so a width of 1,365 (4,096 over 3 rows) would compile variants of its own while clients wait.
WIDTH_STEP = 16


def default_prefill_tokens(runner: RuntimeCompletions) -> int:
    return PREFILL_TOKENS_DEVICE if graphs_supported(runner.model.device) else PREFILL_TOKENS_CPU


def group_width(budget: int, rows: int) -> int:
    """The chunk width of a group of `rows`: its share of the prefill budget, rounded down to a multiple of
    WIDTH_STEP once it is that wide."""
    width = max(1, budget // rows)
    return width - width % WIDTH_STEP if width >= WIDTH_STEP else width


def warm_up_shapes(budget: int, padded: int = 0) -> list[tuple[int, int]]:
    """The (rows, width) prefill chunks run when a batcher starts where Triton kernels run (slots.warm_up_prefill),
    so that no chunk of `budget` positions at most, of any rows and width the batcher forms - nor one padded to run
    as a graph, of `padded` positions at most (slots.graph_prefill_shape) - meets a kernel to compile or a GEMM to
    tune while clients wait: Triton specialises an integer argument by whether it is 1 and whether 16 divides it
    (so rows 1, 2 and 16 stand for every count of rows), and the int8 GEMMs tune per power of two of their rows
    (rows x width here): for each, widths of every power of two of WIDTH_STEP and up that fits, and the widest
    multiple of WIDTH_STEP that does, within the larger of the two limits."""
    shapes = []
    for rows in (1, 2, 16):
        widest = group_width(max(budget, padded), rows)
        if widest < WIDTH_STEP:
            continue
        widths = {widest} | {WIDTH_STEP << i for i in range(widest.bit_length()) if WIDTH_STEP << i <= widest}
        shapes += [(rows, width) for width in sorted(widths)]
    return shapes


def chunk_width(group_width: int, longest: int) -> int:
    """The width one chunk runs at: the group's, or less when the longest part of a prompt left in the chunk is
    shorter (rounded up to a multiple of WIDTH_STEP): on a CPU a lone 512-token prompt in a 4,096-wide chunk took
    eight times as long as at its own width. It depends on the group's own prompts alone."""
    return min(group_width, max(1, -(-longest // WIDTH_STEP)) * WIDTH_STEP)


def decode_rounds(left: Sequence[int], prefilling: bool) -> int:
    """Decode steps (MTP rounds) an iteration runs for rows with `left` tokens still to make each: one while a
    group prefills - on a device a step of a few rows costs about what one of the whole batch does, so the rows
    waiting for their prompts should join the batch within a step or two, not eight - else SYNC_EVERY, fewer when a
    row needs fewer."""
    return 1 if prefilling else min(SYNC_EVERY, min(left))


@dataclass(eq=False)
class Row:
    """One row of a job on its way: the tokens it runs on (prompt, then what an earlier call made), its
    generated tokens, how much of its prompt is in, and how many tokens it has streamed."""

    job: Job
    index: int
    request: TextRequest
    prompt: list[int]
    tokens: list[int]
    stop_tokens: frozenset[int]
    order: int = 0  # arrival order: among rows of jobs equally present in the batch, the older goes first
    prefilled: int = 0
    streamed: int = 0
    since: int = 0  # tokens made since it last took a decode slot
    turns: int = 0  # times it gave its slot to a waiting request (a sampler's seed changes with each)
    ended: bool = False
    stops: StopStrings | None = None  # its tokens' text and the stop strings in it

    @property
    def left(self) -> int:
        """Tokens it may still make."""
        return self.request.max_tokens - len(self.tokens)


@dataclass(eq=False)
class Group:
    """Rows admitted together: staging slots first..first + len(rows), prefilled in chunks of `width`."""

    rows: list[Row]
    first: int
    width: int
    started: bool = False
    skipped: bool = False  # got no chunk last iteration: goes first in the next
    grew: bool = True  # rows joined it in this iteration's admission (it is new, or merged with a new one)
    gathered: int = 0  # iterations it has waited for more rows before its first chunk

    @property
    def remaining(self) -> int:
        return max((len(r.prompt) - r.prefilled for r in self.rows if not r.ended), default=0)

    @property
    def positions(self) -> int:
        """The prompt positions its next chunk prefills."""
        return sum(min(self.width, len(r.prompt) - r.prefilled) for r in self.rows if not r.ended)


@dataclass
class Slots:
    """The host's record of the pool: which row decodes in each decode slot, which staging slots are free."""

    rows: int
    decoding: list[Row] = field(default_factory=list)
    staging_free: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.staging_free = [True] * self.rows

    def free_run(self) -> tuple[int, int]:
        """The longest run of free staging slots: (its first slot, its length)."""
        best, start = (0, 0), None
        for i, free in enumerate([*self.staging_free, False]):
            if free and start is None:
                start = i
            elif not free and start is not None:
                best = max(best, (start, i - start), key=lambda run: run[1])
                start = None
        return self.rows + best[0], best[1]

    def free_after(self, slot: int) -> int:
        """The free staging slots from `slot` (a pool number) on, up to the first taken one."""
        run = 0
        for free in self.staging_free[slot - self.rows:]:
            if not free:
                break
            run += 1
        return run

    def mark_staging(self, first: int, count: int, free: bool) -> None:
        """Staging slots first..first + count (pool numbers) taken by a group, or freed."""
        self.staging_free[first - self.rows:first - self.rows + count] = [free] * count


class StepObserver(Protocol):
    """Hears of the batch's model calls (serve's /metrics): each prefill call's prompt tokens, and each decode
    call's rows and rounds, with the seconds each took (from the call to its tokens on the host)."""

    def prefilled(self, tokens: int, seconds: float) -> None: ...

    def decoded(self, rows: int, rounds: int, seconds: float) -> None: ...


class ContinuousBatcher(Batcher):
    """The worker and its iterations (see the module's docstring) over `runner`'s model: at most `max_rows` rows
    in the batch (prefilling or decoding), at most `prefill_tokens` prompt positions prefilled per iteration;
    `steps` hears of each prefill and decode call."""

    def __init__(self, runner: RuntimeCompletions, max_rows: int, prefill_tokens: int | None = None,
                 steps: StepObserver | None = None) -> None:
        super().__init__(runner)
        self.steps = steps
        self.max_rows = max_rows
        self.prefill_tokens = prefill_tokens or default_prefill_tokens(runner)
        k = runner.options.mtp
        self.slack = SYNC_EVERY * (k + 1) + k + 1  # positions a row may run past its last token before the host looks
        self.capacity = 0
        self.waiting: deque[Row] = deque()
        self.groups: list[Group] = []
        self.slots = Slots(max_rows)
        self.round_tokens = ROUND_TOKENS
        self.gather_iterations = GATHER_ITERATIONS
        self.settle_s, self.settle_most_s = SETTLE_S, SETTLE_MOST_S
        self._seeds = random.Random()
        self._arrived = itertools.count()
        if runs_triton(runner.model.device):  # kernels to compile, GEMM tiles to tune: now, not while clients wait
            # chunks are padded where graphs can be captured, with graphs off too (slots.graph_prefill_shape)
            padded = GRAPH_PREFILL_POSITIONS if graphs_supported(runner.model.device) else 0
            runner.warm_up_prefill(warm_up_shapes(self.prefill_tokens, padded))
        self.worker.start()

    # -- the worker -------------------------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            while True:
                busy = bool(self.waiting or self.groups or self.slots.decoding)
                self._line_up(self._arrivals(block=not busy, settle_s=0.0 if busy else self.settle_s,
                                             settle_most_s=self.settle_most_s))
                if self._closing and not (self.waiting or self.groups or self.slots.decoding):
                    return
                try:
                    self._iterate()
                except Exception as e:  # noqa: BLE001 - every request in the batch hears of it; the worker goes on
                    self._fail_all(e)
        finally:
            if self.capacity:
                self.runner.close_slots()

    def _iterate(self) -> None:
        self._leave_cancelled()
        self._admit()
        self._prefill()
        self._decode()

    def _line_up(self, jobs: Sequence[Job]) -> None:
        """The rows of new jobs go in line; a row with no token left to make (a prompt scored, echo) ends at once."""
        for job in jobs:
            for i, request in enumerate(job.rows):
                row = Row(job, i, request, [*request.prompt_ids, *request.generated], list(request.generated),
                          self.runner.stop_set(request), next(self._arrived),
                          stops=StopStrings(self.runner.decode, request.stop, request.min_tokens))
                if row.left > 0:
                    self.waiting.append(row)
                else:
                    self._end(row)

    def _fail_all(self, error: Exception) -> None:
        """A model call failed: every request in the batch or in line is answered with the error, the pool goes."""
        for job in {row.job for row in [*self.waiting, *self.slots.decoding, *self._prefilling()]}:
            if not job.future.done():
                job.future.set_exception(error)
        self.waiting.clear()
        self.groups.clear()
        self.slots = Slots(self.max_rows)
        self.runner.close_slots()
        self.capacity = 0

    # -- rows in and out --------------------------------------------------------------------------------------

    def _leave_cancelled(self) -> None:
        """Rows of requests whose client went away end where they are: in line, in a prefill, or decoding."""
        for row in [row for row in self.waiting if row.job.cancelled]:
            self.waiting.remove(row)
            self._end(row, cancelled=True)
        for group in self.groups:
            for row in group.rows:
                if row.job.cancelled and not row.ended:
                    self._end(row, cancelled=True)
        self._drop_prefilled_groups()
        if any(row.job.cancelled for row in self.slots.decoding):
            for row in self.slots.decoding:
                if row.job.cancelled:
                    self._end(row, cancelled=True)
            self._compact()

    def _room(self) -> int:
        """Rows the batch can take: max_rows less those decoding and those in groups (their slots held)."""
        return self.max_rows - len(self.slots.decoding) - len(self._prefilling())

    def _prefilling(self) -> list[Row]:
        """The rows of every group, in order."""
        return [row for group in self.groups for row in group.rows]

    def _in_batch(self) -> dict[Job, int]:
        """Each job's rows in the batch (prefilling or decoding)."""
        count: dict[Job, int] = {}
        for row in [*self.slots.decoding, *(r for r in self._prefilling() if not r.ended)]:
            count[row.job] = count.get(row.job, 0) + 1
        return count

    def _next_in_line(self, count: int) -> list[Row]:
        """The `count` rows in line to go next, taken from it: one row of each job in turn, the jobs with the fewest
        rows in the batch first (a new request is not held behind the rest of a request of many rows)."""
        present = self._in_batch()
        chosen = []
        for _ in range(count):
            row = min(self.waiting, key=lambda r: (present.get(r.job, 0), r.order))
            self.waiting.remove(row)
            present[row.job] = present.get(row.job, 0) + 1
            chosen.append(row)
        return chosen

    def _make_way(self) -> None:
        """With the batch full and rows in line, the row that has decoded longest since it took its slot - at least
        round_tokens tokens, and of a job with more rows in the batch than the next in line's - gives its slot
        back and goes in line, to go on from its tokens (its prompt and tokens prefilled again) in a later turn."""
        if not self.waiting:
            return
        present = self._in_batch()
        waiting = min(present.get(r.job, 0) for r in self.waiting)
        candidates = [r for r in self.slots.decoding if r.since >= self.round_tokens and present[r.job] > waiting]
        if not candidates:
            return
        row = max(candidates, key=lambda r: r.since)
        row.prompt, row.prefilled, row.since = [*row.request.prompt_ids, *row.tokens], 0, 0
        row.turns += 1
        self.waiting.append(row)
        self._compact(leaving={row})

    def _admit(self) -> None:
        """The rows in line that fit (the batch's rows, a contiguous run of staging slots) form a new group."""
        if self._room() <= 0:
            self._make_way()
        room = self._room()
        first, run = self.slots.free_run()
        count = min(room, run, len(self.waiting))
        if count <= 0:
            return
        rows = self._next_in_line(count)
        need = max(len(r.prompt) + r.left for r in rows) + self.slack
        if need > self.capacity:  # a new pool (or a grown one, its graphs dropped): every decode graph now
            self.capacity = self.runner.open_slots(self.max_rows, max(need, 2 * self.capacity))
            self.runner.capture_decode_steps()
        self.slots.mark_staging(first, count, free=False)
        self.groups.append(Group(rows, first, group_width(self.prefill_tokens, count)))

    def _merge_unstarted(self) -> None:
        """Groups that have not started and hold adjacent staging slots become one (as if admitted together):
        requests that arrive a few milliseconds apart prefill in one batch."""
        merged: list[Group] = []
        for group in sorted(self.groups, key=lambda g: g.first):
            last = merged[-1] if merged else None
            if (last is not None and not last.started and not group.started
                    and last.first + len(last.rows) == group.first):
                rows = last.rows + group.rows
                merged[-1] = Group(rows, last.first, group_width(self.prefill_tokens, len(rows)),
                                   grew=last.grew or group.grew, gathered=max(last.gathered, group.gathered))
            else:
                merged.append(group)
        self.groups = merged

    def _prefill(self) -> None:
        """One chunk of each group that fits this iteration's budget (see the module's docstring)."""
        self._merge_unstarted()
        budget, ran = self.prefill_tokens, False
        for group in sorted(self.groups, key=lambda g: (not g.skipped, g.remaining)):
            if self._gathers(group):
                continue
            if ran and group.positions > budget:
                group.skipped = True
                continue
            self._prefill_chunk(group)
            group.skipped, ran = False, True
            budget -= group.positions
        self._drop_prefilled_groups()

    def _gathers(self, group: Group) -> bool:
        """Whether a group that has not started waits this iteration for the rows still arriving: while rows
        decode (the device has their work meanwhile) and the batch has room, a group that grew in this iteration's
        admission waits - at most gather_iterations, one decode round each - so that requests whose clients come
        back a few milliseconds apart prefill as one chunk, not as many small ones each costing its launches."""
        grew, group.grew = group.grew, False
        if (group.started or not grew or group.gathered >= self.gather_iterations or not self.slots.decoding
                or self._room() <= 0):
            return False
        group.gathered += 1
        return True

    def _prefill_chunk(self, group: Group) -> None:
        chunk = []
        for row in group.rows:
            if row.ended or row.prefilled >= len(row.prompt):
                chunk.append(ChunkRow([], None))
                continue
            end = row.prefilled + group.width
            chunk.append(ChunkRow(row.prompt[row.prefilled:end], row.prompt[end] if end < len(row.prompt) else None))
            row.prefilled = min(end, len(row.prompt))
        samplers = None if group.started else [self._sampler(row) for row in group.rows]
        group.started = True
        width = chunk_width(group.width, max(len(part.tokens) for part in chunk))
        began = time.perf_counter()
        spare = self.slots.free_after(group.first + len(group.rows))
        firsts = self.runner.prefill_slots(group.first, chunk, width, samplers, spare)
        if self.steps is not None:
            self.steps.prefilled(sum(len(part.tokens) for part in chunk), time.perf_counter() - began)
        moving = []
        for i, (row, first) in enumerate(zip(group.rows, firsts, strict=True)):
            if first is None or row.ended:
                continue
            self._take(row, [first])
            if not row.ended:
                moving.append((group.first + i, len(self.slots.decoding)))
                self.slots.decoding.append(row)
        self.runner.move_slots([s for s, _ in moving], [t for _, t in moving])

    def _sampler(self, row: Row) -> RowSampling:
        params = row.job.sampling
        if params.greedy:
            return RowSampling(params)
        seed = (self._seeds.getrandbits(63) if params.seed is None
                else round_seed(round_seed(params.seed, row.index), row.turns))
        return RowSampling(params, seed)

    def _drop_prefilled_groups(self) -> None:
        """Groups none of whose rows has prompt left free their staging slots."""
        for group in [g for g in self.groups if all(r.ended or r.prefilled >= len(r.prompt) for r in g.rows)]:
            self.groups.remove(group)
            self.slots.mark_staging(group.first, len(group.rows), free=True)

    def _decode(self) -> None:
        """A few decode steps of every row that decodes; rows that ended leave their slots."""
        decoding = self.slots.decoding
        if not decoding:
            return
        rounds = decode_rounds([row.left for row in decoding], prefilling=bool(self.groups))
        began = time.perf_counter()
        results = self.runner.decode_slots(len(decoding), rounds)
        if self.steps is not None:
            self.steps.decoded(len(decoding), rounds, time.perf_counter() - began)
        for result in results:
            for row, new in zip(decoding, result.tokens, strict=True):
                if not row.ended:
                    row.since += len(new)
                    self._take(row, new)
        self._compact()

    def _compact(self, leaving: set[Row] = frozenset()) -> None:
        """The rows that decode fill slots [0, n) again: each slot a row that ended (or is `leaving`) left below n
        gets one of the rows above."""
        decoding = self.slots.decoding
        gone = [row.ended or row in leaving for row in decoding]
        n = gone.count(False)
        holes = [slot for slot in range(n) if gone[slot]]
        fillers = [slot for slot in range(n, len(decoding)) if not gone[slot]]
        self.runner.move_slots(fillers, holes)
        for hole, filler in zip(holes, fillers, strict=True):
            decoding[hole] = decoding[filler]
        del decoding[n:]

    def _take(self, row: Row, new: list[int]) -> None:
        """Add `new` tokens to `row`, stream what its answer keeps, and end it if they end it."""
        request = row.request
        row.tokens += new
        stop = stop_token_end(row.tokens, row.stop_tokens, max(request.min_tokens, len(row.tokens) - len(new)))
        keep = min(request.max_tokens, len(row.tokens) if stop is None else stop)
        if row.job.on_tokens is not None and keep > row.streamed:
            row.job.on_tokens(row.index, row.tokens[row.streamed:keep])
            row.streamed = keep
        if keep < len(row.tokens) or keep >= request.max_tokens or row.stops.found(row.tokens):
            del row.tokens[keep:]
            self._end(row)

    def _end(self, row: Row, cancelled: bool = False) -> None:
        """Row's result is in; its job is answered once every row's is."""
        row.ended = True
        job = row.job
        if cancelled:
            result = TextResult(Completion(self.runner.decode(row.tokens), len(row.tokens), CANCELLED), row.tokens)
        else:
            result = self.runner.finish(row.request, row.tokens)
        job.results[row.index] = result
        if job.ended and not job.future.done():
            self._answer_job(job)
