"""What a validation run drives, behind one protocol: the model in the built-in runtime (RuntimeRunner) or behind an
OpenAI-compatible server (EndpointRunner). run_validation asks a runner what it can do, never which one it is."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from npuport.runtime.completion import Completion, CompletionBatch
from npuport.runtime.text_completions import RuntimeCompletions
from npuport.runtime.validation.endpoint import CompletionsEndpoint, EndpointGivenUp
from npuport.runtime.validation.endpoint_fidelity import EndpointLogprobs, LogprobSource, RuntimeLogprobs
from npuport.runtime.validation.gsm8k import GSM8KProtocol
from npuport.runtime.validation.report import FailedQuestions

Progress = Callable[[int], None]  # (questions done so far)


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
        """Its completions of `prompts`, within the protocol's new-token limit and stop strings; `progress(done)`
        as questions end. A runner whose answers arrive one by one also writes each to `answers` as it comes."""

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
                           progress: Progress) -> CompletionBatch:
        return self.complete(prompts, max_tokens=protocol.max_new_tokens, stop=protocol.stop, progress=progress)

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
        server loses nothing already answered. When the server is given up, the one-line error says where the
        answers received are."""
        answers.parent.mkdir(parents=True, exist_ok=True)
        with open(answers, "w", encoding="utf-8") as f:
            def keep(question: int, answer: Completion) -> None:
                f.write(json.dumps(answer_row(question, answer)) + "\n")
                f.flush()

            try:
                return self.complete(prompts, max_tokens=protocol.max_new_tokens, stop=protocol.stop,
                                     progress=progress, on_answer=keep)
            except EndpointGivenUp as e:
                raise EndpointGivenUp(f"{e}; what ended is in {answers}", e.answered) from None

    def failed_questions(self, label: str, batch: CompletionBatch) -> FailedQuestions:
        return FailedQuestions(label, len(batch.completions), batch.failures)

    def logprob_source(self) -> LogprobSource:
        return EndpointLogprobs(self)
