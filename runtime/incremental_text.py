"""The text of a row's tokens as they grow, decoded a few tokens at a time, and the stop strings in it: decoding the
whole row again at every step costs time in its length, so a 1,000-token answer would cost the host half a million
token decodes, and with 32 rows streaming that rivals what the accelerator takes to make them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from npuport.runtime.completion import stop_at

Decode = Callable[[Sequence[int]], str]  # token ids -> their text, as the tokenizer decodes a whole answer

CONTEXT = 6  # tokens decoded before the unsettled ones, so that the tokenizer sees how they join (as vLLM does)
SETTLE_EVERY = 16  # unsettled tokens at most before the settled text grows


class IncrementalText:
    """decode(tokens) of a token list that only grows, in time independent of its length: the text of the first
    `settled` tokens is kept, and each call decodes only a window from CONTEXT tokens before them to the end,
    taking what the window's text adds to the text of its first CONTEXT tokens. A window whose text does not
    begin with theirs (a tokenizer that rewrites text across the join) is decoded whole instead, as is a list
    shorter than the one before."""

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.settled = 0  # tokens whose text is settled_text
        self.settled_text = ""
        self.context_text = ""  # decode(tokens[max(0, settled - CONTEXT):settled])

    def text(self, tokens: Sequence[int]) -> str:
        """decode(tokens), where tokens extends the list of the call before (its first `settled` are the same)."""
        if len(tokens) < self.settled:
            self.settled, self.settled_text, self.context_text = 0, "", ""
        start = max(0, self.settled - CONTEXT)
        window = self.decode(tokens[start:])
        if not window.startswith(self.context_text):
            return self.decode(tokens)
        text = self.settled_text + window[len(self.context_text):]
        if len(tokens) - self.settled >= CONTEXT + SETTLE_EVERY:
            self._settle(tokens, start, len(tokens) - CONTEXT)
        return text

    def _settle(self, tokens: Sequence[int], start: int, end: int) -> None:
        """Settle the text of tokens[:end], if it ends on a whole character."""
        part = self.decode(tokens[start:end])
        if not part.startswith(self.context_text) or part.endswith("\ufffd"):
            return
        self.settled_text += part[len(self.context_text):]
        self.settled = end
        self.context_text = self.decode(tokens[max(0, end - CONTEXT):end])


class StopStrings:
    """A growing row's text and the earliest of its stop strings that counts in it, by finish_completion's rule: a
    stop string counts once it ends past the text of the row's first min_tokens tokens. One per row, fed the row's
    tokens as they grow (IncrementalText's contract)."""

    def __init__(self, decode: Decode, stop: Sequence[str], min_tokens: int = 0) -> None:
        self.decode, self.stop, self.min_tokens = decode, list(stop), min_tokens
        self.text = IncrementalText(decode)
        self.after: int | None = None if min_tokens else 0  # characters a stop string must end past, once known

    def search(self, tokens: Sequence[int]) -> tuple[str, tuple[int, str] | None]:
        """(decode(tokens), where the earliest stop string that counts begins and which it is, or None)."""
        text = self.text.text(tokens)
        if self.after is None and len(tokens) >= self.min_tokens:
            self.after = len(self.decode(tokens[:self.min_tokens]))
        return text, stop_at(text, self.stop, len(text) if self.after is None else self.after)

    def found(self, tokens: Sequence[int]) -> bool:
        """Whether a stop string that counts is in decode(tokens) (without stop strings, nothing is decoded)."""
        return bool(self.stop) and self.search(tokens)[1] is not None
