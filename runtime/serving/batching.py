"""Requests in flight batched together for `npuport serve`: one worker thread owns the model and runs generate
calls over the rows (a prompt x n each) of the requests waiting in line. A call takes rows that can share it -
greedy ones always, sampled ones with the same temperature and top-p and no seed of their own; the first request in
line decides - one row of each request in turn, up to the batch size, so a request with many rows leaves room for
those behind it. A request is answered as soon as its rows end (one that wants log-probabilities once the call is
over), while the call goes on with the others.

Rows do not join a call that runs, so a call does not run on while others wait: once its rows have made
ROUND_TOKENS tokens in it, each ends at its next stop check if a request the call does not serve is waiting (or one
it served waits only for its log-probabilities), and goes back in line, behind the requests that waited, to go on -
its prompt and tokens so far prefilled again - in a later call. A request arriving during a call thus waits for at
most ROUND_TOKENS tokens of it (and the prefill); a call nobody waits for runs to its end, no prefill repeated. A
request whose client went away (Job.cancel) ends its rows at their next stop check; they are reported "cancelled".

A request with a seed runs in calls of its own, in rounds of ROUND_TOKENS whether or not others wait, round r
drawing from the seed and r: its draws then do not depend on what else was waiting. The log-probabilities a request
asks for are computed by the same worker after the call, so the model is never used by two threads; a row of
max_tokens 0 (a prompt scored, echo) takes no call, only its log-probabilities.

Batch-invariant (`invariant`): every row runs in a call of its own and never gives way, so that its answer is the
one it gets alone, bit for bit - a batch's rows share a prefill whose float rounding follows the batch (its GEMMs'
shapes, its chunk width), and a resumed row prefills again what it had decoded. Requests then wait for each other
instead of sharing a batch.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from npuport.runtime.completion import CANCELLED, LENGTH, Completion
from npuport.runtime.sampling import SamplingParams
from npuport.runtime.text_completions import RuntimeCompletions, TextRequest, TextResult
from npuport.runtime.token_logprobs import PositionLogprobs

ROUND_TOKENS = 256  # tokens a call's rows make before it gives way to a request waiting (a newcomer's longest wait)
_SOLO = itertools.count()  # makes every seeded request's batch key unique


@dataclass(frozen=True)
class LogprobSpec:
    """What log-probabilities a request wants: the top-k per position, and whether its prompt's are included
    (echo) - else only the generated tokens'."""

    top_k: int
    prompt_too: bool = False


@dataclass(frozen=True)
class RowAnswer:
    """One row's result, and its log-probabilities when asked for (prompt positions from the second token when
    prompt_too, then the generated tokens the text took)."""

    result: TextResult
    logprobs: list[PositionLogprobs] | None = None


@dataclass(eq=False)
class Job:
    """One request: its rows (a prompt x n each), how they sample, the log-probabilities they want. on_tokens(row,
    new tokens) hears of a row's tokens as they come (a stream); `cancel()` ends the rows early (a client that
    went away). The future gets every row's RowAnswer, in order."""

    rows: list[TextRequest]
    sampling: SamplingParams
    logprobs: LogprobSpec | None = None
    on_tokens: Callable[[int, list[int]], None] | None = None
    future: Future = field(default_factory=Future)
    cancelled: bool = False
    key: tuple = field(init=False)  # jobs with the same key may share a generate call
    # the worker's record: what each row runs next (its tokens so far as `generated`), the rows waiting for a call
    # (in order: those to resume come first), each row's result once it ended, the rounds a seeded job has had
    next_requests: list[TextRequest] = field(init=False, repr=False)
    waiting: list[int] = field(init=False, repr=False)
    results: list[TextResult | None] = field(init=False, repr=False)
    rounds: int = field(init=False, default=0, repr=False)

    def __post_init__(self) -> None:
        s = self.sampling
        self.key = ("greedy",) if s.greedy else ("sampled", s.temperature, s.top_p,
                                                 next(_SOLO) if s.seed is not None else None)
        self.next_requests = list(self.rows)
        self.waiting = list(range(len(self.rows)))
        self.results = [None] * len(self.rows)

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def ended(self) -> bool:
        return all(r is not None for r in self.results)


def round_seed(seed: int, round_: int) -> int:
    """The seed of round `round_` of a seeded request: its own first (a request of one round draws as generate
    with its seed does), then one per round (each round a generator of its own, none repeating another's draws)."""
    return seed if round_ == 0 else (seed + round_ * 0x9E3779B97F4A7C15) % (1 << 64)


class Batcher:
    """What every batcher of `npuport serve` offers its service: requests submitted as Jobs and answered through
    their futures, counted while in flight, cancelled together, and one worker thread (`_work`, a subclass's) that
    owns the model and takes the jobs from a queue."""

    def __init__(self, runner: RuntimeCompletions) -> None:
        self.runner = runner
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._closing = False
        self._in_flight: set[Job] = set()  # submitted and not answered yet
        self._count_lock = threading.Lock()
        self.worker = threading.Thread(target=self._work, name="npuport-batcher", daemon=True)

    def _work(self) -> None:
        raise NotImplementedError

    def submit(self, job: Job) -> Future:
        with self._count_lock:
            self._in_flight.add(job)
        job.future.add_done_callback(lambda _: self._answered(job))
        self._queue.put(job)
        return job.future

    def _answered(self, job: Job) -> None:
        with self._count_lock:
            self._in_flight.discard(job)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not answered yet: 0 once the worker has nothing to do."""
        with self._count_lock:
            return len(self._in_flight)

    def cancel_all(self) -> int:
        """Cancel every request in flight (their rows end at their next stop check, reported cancelled); returns
        how many there were."""
        with self._count_lock:
            jobs = list(self._in_flight)
        for job in jobs:
            job.cancel()
        return len(jobs)

    def close(self, timeout_s: float | None = None) -> bool:
        """Stop the worker once the jobs already queued are done (waiting at most timeout_s; None: as long as
        they take); returns whether it stopped."""
        self._queue.put(None)
        self.worker.join(timeout_s)
        return not self.worker.is_alive()

    def _arrivals(self, block: bool, settle_s: float = 0.0, settle_most_s: float = 0.0) -> list[Job]:
        """The jobs submitted since the last look (waiting for one when `block`), each marked running; the queue's
        end mark sets _closing. With `settle_s`, once one has come, the jobs that go on arriving less than settle_s
        apart too, for at most settle_most_s."""
        jobs: list[Job] = []
        until = None  # while jobs settle: when they stop being waited for
        while not self._closing:
            wait = None if until is None else max(0.0, min(settle_s, until - time.monotonic()))
            try:
                job = self._queue.get(block=block) if wait is None else self._queue.get(timeout=wait)
            except queue.Empty:
                break
            block = False
            if settle_s > 0 and until is None:
                until = time.monotonic() + settle_most_s
            if job is None:
                self._closing = True  # once the jobs in line are done
            elif job.future.set_running_or_notify_cancel():
                jobs.append(job)
        return jobs

    def _answer_job(self, job: Job) -> None:
        """Answer `job` with every row's result, and the log-probabilities it asked for (the model computes them
        here, on the worker)."""
        try:
            answers = [self._answer(job, row, result) for row, result in zip(job.rows, job.results, strict=True)]
        except Exception as e:  # noqa: BLE001 - the job hears of it; the worker goes on
            job.future.set_exception(e)
            return
        job.future.set_result(answers)

    def _answer(self, job: Job, row: TextRequest, result: TextResult | None) -> RowAnswer:
        assert result is not None
        spec = job.logprobs
        if spec is None or job.cancelled:
            return RowAnswer(result)
        taken = result.token_ids[:result.completion.completion_tokens]
        sequence = row.prompt_ids + taken
        start = 1 if spec.prompt_too else len(row.prompt_ids)
        return RowAnswer(result, self.runner.logprobs(sequence, spec.top_k, start) if start < len(sequence) else [])


class RequestBatcher(Batcher):
    """The worker thread and its line over `runner`: calls of at most `max_rows` rows that give way to waiting
    requests after `round_tokens` tokens; with `invariant`, calls of one row that never give way (see above)."""

    def __init__(self, runner: RuntimeCompletions, max_rows: int, round_tokens: int = ROUND_TOKENS, *,
                 invariant: bool = False) -> None:
        super().__init__(runner)
        self.round_tokens, self.invariant = round_tokens, invariant
        self.max_rows = 1 if invariant else max_rows
        self._line: list[Job] = []  # jobs with rows waiting for a call, in the order they are served
        self.worker.start()

    # -- the worker -------------------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            self._take_arrivals(block=not self._line)
            self._end_cancelled()
            if self._line:
                self._run(self._next_call())
            elif self._closing:
                return

    def _take_arrivals(self, block: bool) -> None:
        """Put the jobs submitted since the last look in line (waiting for one when `block`)."""
        self._line += self._arrivals(block)

    def _end_cancelled(self) -> None:
        """The waiting rows of jobs whose client went away end without a call."""
        for job in [job for job in self._line if job.cancelled]:
            for i in job.waiting:
                generated = list(job.next_requests[i].generated)
                job.results[i] = TextResult(Completion(self.runner.decode(generated), len(generated), CANCELLED),
                                            generated)
            job.waiting.clear()
            self._line.remove(job)
            if job.ended:
                self._answer_job(job)

    def _next_call(self) -> list[tuple[Job, int]]:
        """The (job, row) pairs of the next generate call: the jobs in line that share the first one's key, one
        row of each in turn, up to max_rows."""
        sharing = [job for job in self._line if job.key == self._line[0].key]
        rows = [(job, job.waiting[turn]) for turn in range(max(len(job.waiting) for job in sharing))
                for job in sharing if turn < len(job.waiting)][:self.max_rows]
        for job, i in rows:
            job.waiting.remove(i)
        self._line = [job for job in self._line if job.waiting]
        return rows

    def _run(self, rows: Sequence[tuple[Job, int]]) -> None:
        """One generate call over `rows`; then the jobs that took part go behind those that waited, and those
        whose rows have all ended are answered with their log-probabilities."""
        jobs = list(dict.fromkeys(job for job, _ in rows))
        sampling = jobs[0].sampling
        if sampling.seed is not None:
            sampling = dataclasses.replace(sampling, seed=round_seed(sampling.seed, jobs[0].rounds))
            jobs[0].rounds += 1

        def on_tokens(row: int, new: list[int]) -> None:
            job, i = rows[row]
            if job.on_tokens is not None:
                job.on_tokens(i, new)

        def interrupted(row: int, made: int) -> bool:
            job = rows[row][0]
            if job.cancelled:
                return True
            if made < self.round_tokens:
                return False
            return job.sampling.seed is not None or (not self.invariant and self._wanted(jobs))

        for job, i in [(job, i) for job, i in rows if job.next_requests[i].max_tokens == 0]:
            self._row_ended(job, i, TextResult(Completion("", 0, LENGTH), []))  # scored, nothing to generate
        rows = [(job, i) for job, i in rows if job.next_requests[i].max_tokens > 0]
        try:
            if rows:
                self.runner.run([job.next_requests[i] for job, i in rows], sampling, on_tokens, interrupted,
                                lambda row, result: self._row_ended(*rows[row], result))
        except Exception as e:  # noqa: BLE001 - every job of the call hears of it; the worker goes on
            for job in jobs:
                if job in self._line:
                    self._line.remove(job)
                if not job.future.done():
                    job.future.set_exception(e)
            return
        for job in jobs:
            if job in self._line:  # rows to go on with, or rows that did not fit
                self._line.remove(job)
                self._line.append(job)
            elif job.ended and not job.future.done():
                self._answer_job(job)

    def _wanted(self, call: Sequence[Job]) -> bool:
        """Whether a request that `call` does not serve is waiting, or one it served waits only for its
        log-probabilities (which the model computes once the call is over)."""
        self._take_arrivals(block=False)
        return (any(job not in call and not job.cancelled for job in self._line)
                or any(job.ended and not job.future.done() for job in call))

    def _row_ended(self, job: Job, i: int, result: TextResult) -> None:
        """Row i of `job` ended in a call: finished, or interrupted (finish reason None) - then it goes back in
        line to go on from its tokens, unless its client went away. A job whose rows have all ended is answered
        at once unless it wants log-probabilities (the model is busy with the call)."""
        if result.completion.finish_reason is None:
            if not job.cancelled:
                job.next_requests[i] = dataclasses.replace(job.next_requests[i], generated=tuple(result.token_ids))
                bisect.insort(job.waiting, i)
                if job not in self._line:
                    self._line.append(job)
                return
            result = TextResult(dataclasses.replace(result.completion, finish_reason=CANCELLED), result.token_ids)
        job.results[i] = result
        if job.ended and (job.logprobs is None or job.cancelled):
            self._answer_job(job)
