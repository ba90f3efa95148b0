"""What a completion is, whoever made it - the built-in runtime or a server behind the OpenAI API: its text, the
tokens it took and why it ended; a batch of them; stop strings cut as the servers cut them; and the spellings of
the OpenAI-compatible API that a server and its clients share. Standard library only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Why a completion ended, as the OpenAI API names it; CANCELLED is this project's word for a request whose client
# went away (the API has none: such a request gets no answer).
STOP = "stop"  # a stop token or a stop string
LENGTH = "length"  # its max_tokens
CANCELLED = "cancelled"  # its client went away before it ended

TOKEN_ID_PREFIX = "token_id:"  # vLLM's `return_tokens_as_token_ids` spelling of a token
MAX_TOP_LOGPROBS = 20  # vLLM's default most; the OpenAI API allows 5 for completions and 20 for chat


@dataclass(frozen=True)
class Completion:
    """One prompt's answer: the text and `usage.completion_tokens` (None when the server did not say), and why it
    ended (None: not said, or a row interrupted before it ended). A question that got no usable answer has `error`
    set (one line) and the empty text, which scores as wrong."""

    text: str
    completion_tokens: int | None
    finish_reason: str | None = None
    error: str | None = None

    @classmethod
    def failed(cls, error: str) -> Completion:
        return cls("", None, None, error)


@dataclass(frozen=True)
class CompletionBatch:
    """All answers, in prompt order, and the wall seconds from the first prompt sent to the last answer."""

    completions: list[Completion]
    latency_s: float

    @property
    def texts(self) -> list[str]:
        return [c.text for c in self.completions]

    @property
    def completion_tokens(self) -> int | None:
        """Total completion tokens of the answered questions, or None if any answer lacked a count."""
        counts = [c.completion_tokens for c in self.completions if c.error is None]
        return None if any(c is None for c in counts) else sum(counts)

    @property
    def failures(self) -> dict[int, str]:
        """Question index -> the error of each question that got no usable answer."""
        return {i: c.error for i, c in enumerate(self.completions) if c.error is not None}


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """`text` up to the earliest stop string, as a server applying `stop` returns it."""
    cut = len(text)
    for s in stop:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


def holds_stop(text: str, stop: Sequence[str]) -> bool:
    """Whether `text` holds any of the stop strings."""
    return any(s in text for s in stop)


def stop_at(text: str, stop: Sequence[str], after: int = 0) -> tuple[int, str] | None:
    """Where the earliest stop string in `text` that ends past its first `after` characters begins, and which it
    is; None when there is none."""
    found = None
    for s in stop:
        i = text.find(s, max(0, after - len(s) + 1))
        if i != -1 and (found is None or i < found[0]):
            found = i, s
    return found


def stop_token_end(tokens: Sequence[int], stop_tokens: frozenset[int], min_tokens: int = 0) -> int | None:
    """How many of `tokens` a row keeps when a stop token ends it: up to and with its first stop token that has at
    least min_tokens tokens before it; None when none does."""
    return next((i + 1 for i in range(min_tokens, len(tokens)) if tokens[i] in stop_tokens), None)
