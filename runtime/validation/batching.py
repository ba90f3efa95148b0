"""Requests in flight batched together for `npuport serve`: one worker thread owns the model; requests wait in a
queue, and each time the model is free the worker takes every waiting request that can share a generate call -
greedy ones always, sampled ones with the same temperature and top-p and no seed of their own - up to the batch
size, and runs them as one batch, each row with its own limit and stop strings. A request that arrives while a
batch runs joins the next batch (a batch is one generate call; rows do not join mid-call). The log-probabilities a
request asks for are computed by the same worker after its batch, so the model is never used by two threads.

A request with a seed runs in a batch of its own: its draws then do not depend on what else was waiting.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from npuport.runtime.sampling import SamplingParams
from npuport.runtime.validation.completions import RuntimeCompletions, TextRequest, TextResult
from npuport.runtime.validation.logprobs import PositionLogprobs

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


@dataclass
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

    def __post_init__(self) -> None:
        s = self.sampling
        self.key = ("greedy",) if s.greedy else ("sampled", s.temperature, s.top_p,
                                                 next(_SOLO) if s.seed is not None else None)

    def cancel(self) -> None:
        self.cancelled = True


class RequestBatcher:
    """The worker thread and its queue over `runner`, batches of at most `max_rows` rows."""

    def __init__(self, runner: RuntimeCompletions, max_rows: int) -> None:
        self.runner, self.max_rows = runner, max_rows
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._waiting: list[Job] = []  # taken from the queue, not yet run (another key than the batch's)
        self._worker = threading.Thread(target=self._work, name="npuport-batcher", daemon=True)
        self._worker.start()

    def submit(self, job: Job) -> Future:
        self._queue.put(job)
        return job.future

    def close(self) -> None:
        """Stop the worker once the jobs already queued are done."""
        self._queue.put(None)
        self._worker.join()

    def _next_batch(self) -> list[Job] | None:
        """The jobs of the next generate call (waits for one); None once closed."""
        while not self._waiting:
            job = self._queue.get()
            if job is None:
                return None
            self._waiting.append(job)
        while True:  # everything that arrived meanwhile
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self._queue.put(None)  # close after this batch
                break
            self._waiting.append(job)
        first = self._waiting[0]
        batch, rows = [], 0
        for job in list(self._waiting):
            if job.key == first.key and (not batch or rows + len(job.rows) <= self.max_rows):
                batch.append(job)
                rows += len(job.rows)
                self._waiting.remove(job)
        return batch

    def _work(self) -> None:
        while (batch := self._next_batch()) is not None:
            live = [job for job in batch if job.future.set_running_or_notify_cancel()]
            try:
                answers = self._run(live)
            except Exception as e:  # noqa: BLE001 - every job of the batch hears of it; the worker goes on
                for job in live:
                    job.future.set_exception(e)
                continue
            for job, rows in zip(live, answers, strict=True):
                job.future.set_result(rows)

    def _run(self, jobs: Sequence[Job]) -> list[list[RowAnswer]]:
        """The jobs' rows in generate calls of at most max_rows (one, unless a single job has more), then the
        log-probabilities each job asked for."""
        owners = [(job, i) for job in jobs for i in range(len(job.rows))]
        results: list[TextResult] = []
        for first in range(0, len(owners), self.max_rows):
            part = owners[first:first + self.max_rows]

            def on_tokens(row: int, new: list[int], part=part) -> None:
                job, i = part[row]
                if job.on_tokens is not None:
                    job.on_tokens(i, new)

            done, _ = self.runner.run([job.rows[i] for job, i in part], jobs[0].sampling, on_tokens,
                                      lambda row, part=part: part[row][0].cancelled)
            results += done
        answers: list[list[RowAnswer]] = []
        for job in jobs:
            mine, results = results[:len(job.rows)], results[len(job.rows):]
            answers.append([self._answer(job, row, result) for row, result in zip(job.rows, mine, strict=True)])
        return answers

    def _answer(self, job: Job, row: TextRequest, result: TextResult) -> RowAnswer:
        spec = job.logprobs
        if spec is None:
            return RowAnswer(result)
        taken = result.token_ids[:result.completion.completion_tokens]
        sequence = row.prompt_ids + taken
        start = 1 if spec.prompt_too else len(row.prompt_ids)
        return RowAnswer(result, self.runner.logprobs(sequence, spec.top_k, start) if start < len(sequence) else [])
