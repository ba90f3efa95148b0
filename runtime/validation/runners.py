"""What a validation run drives, behind one protocol: the model in the built-in runtime (RuntimeRunner) or behind an
OpenAI-compatible server (EndpointRunner). run_validation asks a runner what it can do, never which one it is.
Both append each answer to the run's answers file as it is made, and take up from what that file holds: a
stopped run, continued, answers only the questions it had not (journal.py)."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from npuport.benchlog import Progress
from npuport.runtime.completion import Completion, CompletionBatch
from npuport.runtime.generate import AcceptanceStats
from npuport.runtime.text_completions import RuntimeBatch, RuntimeCompletions, TextRequest, merge_acceptance
from npuport.runtime.validation.endpoint import CompletionsEndpoint, EndpointGivenUp
from npuport.runtime.validation.endpoint_fidelity import EndpointLogprobs, LogprobSource, RuntimeLogprobs
from npuport.runtime.validation.gsm8k import GSM8KProtocol
from npuport.runtime.validation.journal import Appender, read_rows
from npuport.runtime.validation.report import FailedQuestions


class Runner(Protocol):
    """What a validation run asks of a model it measures."""

    @property
    def in_process(self) -> RuntimeCompletions | None:
        """The model itself, loaded in this process - for what only it can measure (full-vocabulary fidelity,
        throughput, MTP acceptance) - or None behind a server."""

    def where(self, device: str) -> str:
        """Where it runs, for the report's device line; `device` describes this machine's device."""

    def complete_questions(self, protocol: GSM8KProtocol, prompts: Sequence[str], answers: Path,
                           progress: Progress) -> CompletionBatch:
        """Its completions of `prompts`, within the protocol's new-token limit and stop strings, `progress` told as
        questions end. Each answer is appended to `answers` as it is made; what `answers` already holds (a stopped
        run's) is taken as done, and only the rest is asked."""

    def failed_questions(self, label: str, batch: CompletionBatch) -> FailedQuestions | None:
        """The questions of `batch` that got no usable answer, for the report and its gate; None for a runner
        whose questions cannot fail one by one."""

    def logprob_source(self) -> LogprobSource:
        """Its log-probabilities, for fidelity measured where a side is a server."""


class RuntimeRunner(RuntimeCompletions):
    """A Runner on the built-in runtime: the model in this process, its questions answered a batch at a time."""

    @property
    def in_process(self) -> RuntimeCompletions:
        return self

    def where(self, device: str) -> str:
        parallel = self.model.parallel
        return f"{device} x {parallel.world} (tensor + expert parallel)" if parallel.active else device

    def complete_questions(self, protocol: GSM8KProtocol, prompts: Sequence[str], answers: Path,
                           progress: Progress) -> RuntimeBatch:
        """A batch of `batch_size` questions per generate call, as `complete` makes them; each batch's answers are
        appended to `answers` when it ends, with a line closing the batch (its latency and MTP acceptance). A
        batch closed there is not asked again; one that was not is asked whole, so that every batch holds the
        same questions as in a run never stopped (batch composition may change greedy output)."""
        prompt_ids = [self.encode(p) for p in prompts]
        kept = _kept_batches(read_rows(answers), len(prompts), self.batch_size)
        progress.skip(sum(len(rows) for rows, _ in kept.values()))
        results: list[tuple[Completion, list[int]]] = []
        stats: list[AcceptanceStats] = []
        latency = 0.0
        with Appender(answers) as journal:
            for first in range(0, len(prompts), self.batch_size):
                end = min(first + self.batch_size, len(prompts))
                if first in kept:
                    rows, closing = kept[first]
                    done = [(Completion(r["text"], r["completion_tokens"], r["finish_reason"]), r["token_ids"])
                            for r in rows]
                    acceptance = (AcceptanceStats(**closing["acceptance"]) if closing.get("acceptance") is not None
                                  else None)
                    seconds = float(closing["latency_s"])
                else:
                    start = time.perf_counter()
                    made, acceptance = self.run([TextRequest(ids, protocol.max_new_tokens, tuple(protocol.stop))
                                                 for ids in prompt_ids[first:end]])
                    seconds = time.perf_counter() - start
                    done = [(r.completion, r.token_ids) for r in made]
                    for question, (answer, tokens) in enumerate(done, start=first):
                        journal.write({**answer_row(question, answer), "token_ids": tokens})
                    journal.write({"batch": first, "end": end, "latency_s": seconds,
                                   "acceptance": None if acceptance is None else _acceptance_row(acceptance)})
                    progress.update(advance=end - first, tokens=sum(len(t) for _, t in done))
                results += done
                latency += seconds
                if acceptance is not None:
                    stats.append(acceptance)
        return RuntimeBatch([c for c, _ in results], latency, prompt_ids, [t for _, t in results],
                            merge_acceptance(stats))

    def failed_questions(self, label: str, batch: CompletionBatch) -> FailedQuestions | None:
        return None

    def logprob_source(self) -> LogprobSource:
        return RuntimeLogprobs(self)

    def without_mtp(self) -> RuntimeRunner:
        """The same model, tokenizer, batches and kernels, decoding without MTP drafts: what greedy output with MTP
        must equal."""
        plain = copy.copy(self)
        plain.options = dataclasses.replace(self.options, mtp=0)
        return plain


def _acceptance_row(stats: AcceptanceStats) -> dict[str, Any]:
    return {"k": stats.k, "rounds": stats.rounds, "accepted": stats.accepted, "accepted_at": stats.accepted_at}


def _kept_batches(rows: Sequence[dict[str, Any]], n: int,
                  size: int) -> dict[int, tuple[list[dict[str, Any]], dict[str, Any]]]:
    """first question -> (its batch's answer rows, the line closing it), for each batch an answers file closed: the
    batches of `size` questions of a run of `n`. Answers of a batch not closed (a run stopped during it) are not
    kept."""
    latest: dict[int, dict[str, Any]] = {}
    kept = {}
    for row in rows:
        if "question" in row:
            latest[row["question"]] = row
        elif "batch" in row:
            first, end = row["batch"], row["end"]
            if first % size == 0 and end == min(first + size, n) and all(q in latest for q in range(first, end)):
                kept[first] = ([latest[q] for q in range(first, end)], row)
    return kept


def answer_row(question: int, answer: Completion) -> dict[str, Any]:
    """One line of an answers file: the question number and the raw answer, or the error that ended it."""
    if answer.error is not None:
        return {"question": question, "error": answer.error}
    return {"question": question, "text": answer.text, "completion_tokens": answer.completion_tokens,
            "finish_reason": answer.finish_reason}


class EndpointRunner(CompletionsEndpoint):
    """A Runner on an OpenAI-compatible server: each answer written down as it arrives, a question that gets no
    usable answer failed on its own."""

    @property
    def in_process(self) -> None:
        return None

    def where(self, device: str) -> str:
        return f"endpoint {self.url}"

    def complete_questions(self, protocol: GSM8KProtocol, prompts: Sequence[str], answers: Path,
                           progress: Progress) -> CompletionBatch:
        """Each answer is appended to `answers` (one JSON line, flushed) as it arrives, so that a crash or a lost
        server loses nothing already answered; what the file holds answered is not asked again, a question that
        failed there is. When the server is given up, the one-line error says where the answers received are.
        Latency: each run's wall time to its last answer written, summed over the runs that made the file."""
        rows = read_rows(answers)
        latest = {r["question"]: r for r in rows if "question" in r and r["question"] < len(prompts)}
        answered = {q: Completion(r["text"], r.get("completion_tokens"), r.get("finish_reason"))
                    for q, r in latest.items() if "error" not in r}
        ends: dict[int, float] = {}  # each earlier run's seconds to its last answer
        for r in rows:
            ends[r.get("segment", 0)] = max(ends.get(r.get("segment", 0), 0.0), float(r.get("at_s", 0.0)))
        segment = max(ends, default=-1) + 1
        todo = [q for q in range(len(prompts)) if q not in answered]
        progress.skip(len(answered))
        answers.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with Appender(answers) as journal:
            def keep(index: int, answer: Completion) -> None:
                row = {**answer_row(todo[index], answer), "segment": segment, "at_s": time.perf_counter() - start}
                journal.write(row)
                progress.update(advance=1, tokens=answer.completion_tokens or 0)

            try:
                batch = (self.complete([prompts[q] for q in todo], max_tokens=protocol.max_new_tokens,
                                       stop=protocol.stop, on_answer=keep) if todo else CompletionBatch([], 0.0))
            except EndpointGivenUp as e:
                raise EndpointGivenUp(f"{e}; what ended is in {answers} (continue with --resume)",
                                      {todo[i]: a for i, a in e.answered.items()}) from None
        answered.update(zip(todo, batch.completions, strict=True))
        return CompletionBatch([answered[q] for q in range(len(prompts))], sum(ends.values()) + batch.latency_s)

    def failed_questions(self, label: str, batch: CompletionBatch) -> FailedQuestions:
        return FailedQuestions(label, len(batch.completions), batch.failures)

    def logprob_source(self) -> LogprobSource:
        return EndpointLogprobs(self)
