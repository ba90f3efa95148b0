"""The objects the OpenAI API answers, as `npuport serve` writes them: completions, chat completions, their
stream chunks (and the text a stream may send so far), log-probabilities, the model list. No HTTP here
(http_handler.py) and no model (service.py): plain data in, plain data out."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from npuport.runtime.completion import TOKEN_ID_PREFIX, stop_token_end
from npuport.runtime.incremental_text import StopStrings
from npuport.runtime.token_logprobs import PositionLogprobs

TokenText = Callable[[int], str]  # a token id -> its text as the API shows a token


def token_texter(decode_one: TokenText, as_ids: bool) -> TokenText:
    return (lambda t: f"{TOKEN_ID_PREFIX}{t}") if as_ids else decode_one


def completion_logprobs(positions: Sequence[PositionLogprobs], texter: TokenText, offset: int = 0) -> dict:
    """The `logprobs` object of a /v1/completions choice: tokens, their log-probabilities, top-k as {token:
    log-probability}, each token's offset in the text (the first's: `offset`, e.g. of a stream chunk's token)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for position in positions:
        text = texter(position.token)
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        token_logprobs.append(position.logprob)
        # logprobs=0 (no alternatives): the chosen token's own entry, as vLLM answers (and the API's "up to
        # logprobs + 1" allows)
        top.append({texter(t): lp for t, lp in position.top or [(position.token, position.logprob)]})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def with_first_token(first: int, rest: dict, texter: TokenText) -> dict:
    """`completion_logprobs` of an echoed prompt: its first token leads, with no log-probability (nothing comes
    before it)."""
    text = texter(first)
    return {"tokens": [text, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [0, *(o + len(text) for o in rest["text_offset"])]}


def chat_logprobs(positions: Sequence[PositionLogprobs], texter: TokenText) -> dict:
    """The `logprobs` object of a chat choice: `content`, one entry per token with its bytes and top-k."""

    def entry(token: int, logprob: float) -> dict:
        text = texter(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(p.token, p.logprob), "top_logprobs": [entry(t, lp) for t, lp in p.top]}
                        for p in positions]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass(frozen=True)
class Answer:
    """One choice as the model gave it: the text (cut at a stop string), why it ended, and its log-probabilities
    object (None: not asked for)."""

    text: str
    finish_reason: str | None
    logprobs: dict | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_object(served_model: str, answers: Sequence[Answer], prompt_tokens: int,
                      completion_tokens: int) -> dict:
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": served_model,
            "choices": [{"index": i, "text": a.text, "logprobs": a.logprobs, "finish_reason": a.finish_reason}
                        for i, a in enumerate(answers)],
            "usage": usage(prompt_tokens, completion_tokens)}


def chat_object(served_model: str, answers: Sequence[Answer], prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
            "model": served_model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": a.text}, "logprobs": a.logprobs,
                         "finish_reason": a.finish_reason} for i, a in enumerate(answers)],
            "usage": usage(prompt_tokens, completion_tokens)}


@dataclass
class ChunkMaker:
    """The stream chunks of one request, all with the same id and time: completions' `text_completion` chunks
    or chat's `chat.completion.chunk` ones (the first of a chat choice carries the assistant role)."""

    served_model: str
    chat: bool
    id: str = field(init=False)
    created: int = field(init=False)

    def __post_init__(self) -> None:
        self.id = new_id("chatcmpl" if self.chat else "cmpl")
        self.created = int(time.time())
        self._started: set[int] = set()

    def _wrap(self, choices: list[dict], extra: dict | None = None) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.served_model,
                "choices": choices, **(extra or {})}

    def text(self, index: int, text: str, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
        """A chunk of choice `index`: its next piece of text, with the log-probabilities of the token it carries
        (completions' or chat's object for that one token; None: not asked for, or no token)."""
        if not self.chat:
            return self._wrap([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}])
        delta: dict[str, str] = {} if index in self._started else {"role": "assistant"}
        self._started.add(index)
        if text or not delta:
            delta["content"] = text
        return self._wrap([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return self._wrap([], {"usage": usage(prompt_tokens, completion_tokens)})


def sse(data: dict | str) -> bytes:
    """One server-sent event: `data: <json>` (or the literal [DONE]) and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def models_object(served_model: str) -> dict:
    return {"object": "list", "data": [{"id": served_model, "object": "model", "created": 0, "owned_by": "npuport"}]}


class StreamedText:
    """The text of one streamed choice as its tokens come: each `add` gives the part that may be sent now - never
    what could still turn out to be part of a stop string (the last len(longest stop) - 1 characters wait), nor a
    character whose bytes have not all come, nor anything from the row's first stop token past its min_tokens on
    (`stop_tokens`: the tokens past it are ones the row made before its stop check caught it) - and `finish` the
    rest of the final answer, so that the chunks add up to the answer a request without stream gets (the rules
    of finish_completion: a stop string counts once it ends past the text of the first min_tokens tokens, and
    with include_stop the answer keeps it, and the stop token's text)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str],
                 stop_tokens: frozenset[int] = frozenset(), min_tokens: int = 0, include_stop: bool = False) -> None:
        self.stop = list(stop)
        self.stop_tokens, self.min_tokens, self.include_stop = stop_tokens, min_tokens, include_stop
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.ended = False  # a stop token came: nothing after it counts
        self.sent = ""
        self.shown = StopStrings(decode, self.stop, min_tokens)  # the text shown so far and its stop strings

    def _send(self, safe: str) -> str:
        if not safe.startswith(self.sent):  # a tokenizer whose text of more tokens rewrites the end: wait
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def add(self, new: Sequence[int]) -> str:
        if self.ended:
            return ""
        checked = len(self.tokens)  # none of these is a stop token that counts
        self.tokens += new
        end = stop_token_end(self.tokens, self.stop_tokens, max(self.min_tokens, checked))
        if end is not None:
            self.tokens, self.ended = self.tokens[:end], True
        shown = self.tokens[:-1] if self.ended and not self.include_stop else self.tokens
        text, found = self.shown.search(shown)
        if found is not None:
            i, s = found
            safe = text[:i + len(s)] if self.include_stop else text[:i]
        else:
            safe = text[:len(text) - self.hold] if self.hold else text
        return self._send(safe.rstrip("\ufffd"))

    def finish(self, answer: str) -> str:
        return self._send(answer)
