"""Fidelity where a model is only known through what an OpenAI-compatible server returns: each model's greedy
tokens, and at each position the log-probability of the token there and the top-k. Either side is an endpoint
(sglang, vllm-ascend, `npuport serve`) or the built-in runtime.

Per prompt: both generate greedily (greedy token agreement, as the built-in fidelity counts it); then both score the
prompt followed by the reference's tokens, teacher-forced (`echo` with `logprobs`): at every position, top-1
agreement (the most likely token of each top-k) and the top-k KL estimate (topk_kl.topk_kl_estimate). A server
that refuses `echo` gets the same measures over the positions where both generations still agree - the only
positions whose contexts are the same without teacher forcing - and the report says which estimate ran.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from npuport.errors import EndpointError
from npuport.runtime.completion import TOKEN_ID_PREFIX
from npuport.runtime.text_completions import RuntimeCompletions, TextRequest
from npuport.runtime.validation.endpoint import CompletionsEndpoint, QuestionFailed
from npuport.runtime.validation.report import Fidelity, topk_kl_method
from npuport.runtime.validation.topk_kl import topk_kl_estimate

DEFAULT_TOP_K = 5  # the most the OpenAI API gives for completions: what any server takes
TEACHER_FORCED = "teacher-forced on the reference's tokens (echo)"
SHARED_PREFIX = "over the tokens both generations share (the server refused echo)"

TokenKey = int | str  # a token id where the server names tokens by id, else the token's text
LOGPROB_ROUNDING = 1e-3  # how far above 0 a server's rounding may put a log-probability


@dataclass(frozen=True)
class Scored:
    """One position: the token there and the top-k {token: log-probability} before it."""

    token: TokenKey
    top: dict[TokenKey, float]


class EchoRefused(EndpointError):
    """The server answered a scoring request (echo + logprobs) with a refusal."""


class LogprobSource(Protocol):
    name: str

    def generate(self, prompt: list[int], max_tokens: int, stop: Sequence[str], top_k: int) -> list[Scored]:
        """Greedy tokens after `prompt`, each with its top-k."""

    def score(self, sequence: list[int], top_k: int) -> list[Scored]:
        """Positions 1.. of `sequence`, teacher-forced."""


def token_key(name: str) -> TokenKey:
    """A token as a server names it: `token_id:<id>` -> the id, else the text. ValueError for anything else."""
    if not isinstance(name, str):
        raise ValueError(f"a token named {_short(name)}, not by a string")
    if not name.startswith(TOKEN_ID_PREFIX):
        return name
    digits = name[len(TOKEN_ID_PREFIX):]
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 18):  # int() takes ' 7', '+7', '٧' and more
        raise ValueError(f"token {_short(name)} names no token id")
    return int(digits)


def _logprob(value: object) -> float:
    """A log-probability as a server gives it; ValueError unless a finite number <= 0 (rounding aside), what
    the KL estimate's exp() and log() can take."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value > LOGPROB_ROUNDING):
        raise ValueError(f"log-probability {_short(value)} is not a finite number <= 0")
    return float(value)


def _top(top: object) -> dict[TokenKey, float]:
    """One position's top-k {token: log-probability}; None (echo's first position) is none."""
    if top is None:
        return {}
    if not isinstance(top, dict):
        raise ValueError(f"a top_logprobs entry is {_short(top)}, not an object")
    return {token_key(k): _logprob(v) for k, v in top.items()}


def _short(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class EndpointLogprobs:
    """A LogprobSource over a server's /v1/completions (asking for tokens by id, vLLM's and npuport's
    `return_tokens_as_token_ids`; a server that ignores it names them by text)."""

    def __init__(self, endpoint: CompletionsEndpoint) -> None:
        self.endpoint, self.name = endpoint, endpoint.url

    def _logprobs(self, fields: dict) -> dict:
        answer = self.endpoint.request({"temperature": 0, "return_tokens_as_token_ids": True, **fields})
        logprobs = answer["choices"][0].get("logprobs")
        if not isinstance(logprobs, dict) or not isinstance(logprobs.get("tokens"), list):
            raise EndpointError(f"{self.name}: answered without log-probabilities; fidelity needs `logprobs`")
        return logprobs

    def _positions(self, logprobs: dict) -> list[Scored]:
        """Every position of a `logprobs` answer; EndpointError naming the server for anything but a token and
        its top-k of log-probabilities at each."""
        tokens, tops = logprobs["tokens"], logprobs.get("top_logprobs", [])  # absent: right for no tokens only
        try:
            if not isinstance(tops, list) or len(tops) != len(tokens):
                raise ValueError(f"{len(tokens)} tokens but top_logprobs is not a list of as many")
            return [Scored(token_key(t), _top(top)) for t, top in zip(tokens, tops, strict=True)]
        except ValueError as e:
            raise EndpointError(f"{self.name}: answered unusable log-probabilities ({e})") from None

    def generate(self, prompt: list[int], max_tokens: int, stop: Sequence[str], top_k: int) -> list[Scored]:
        return self._positions(self._logprobs({"prompt": prompt, "max_tokens": max_tokens, "stop": list(stop),
                                               "logprobs": top_k}))

    def score(self, sequence: list[int], top_k: int) -> list[Scored]:
        try:
            logprobs = self._logprobs({"prompt": sequence, "max_tokens": 1, "echo": True, "logprobs": top_k})
        except QuestionFailed as e:
            if "HTTP 400" in e.reason or "HTTP 422" in e.reason:
                raise EchoRefused(str(e)) from None
            raise
        echoed = self._positions(logprobs)[:len(sequence)]
        tokens = [s.token for s in echoed]
        if len(tokens) < len(sequence) or (all(isinstance(t, int) for t in tokens) and tokens != sequence):
            raise EndpointError(f"{self.name}: an echo answer does not repeat the {len(sequence)} tokens it was sent")
        return echoed[1:]


class RuntimeLogprobs:
    """A LogprobSource over the built-in runtime; names tokens by id, or by text (`by_text`) to meet a server
    that does."""

    def __init__(self, runner: RuntimeCompletions, by_text: bool = False) -> None:
        self.runner, self.by_text, self.name = runner, by_text, "built-in runtime"

    def _scored(self, sequence: list[int], top_k: int, start: int) -> list[Scored]:
        key = self.runner.token_text if self.by_text else (lambda t: t)
        return [Scored(key(p.token), {key(t): lp for t, lp in p.top})
                for p in self.runner.logprobs(sequence, top_k, start)]

    def generate(self, prompt: list[int], max_tokens: int, stop: Sequence[str], top_k: int) -> list[Scored]:
        (result,), _ = self.runner.run([TextRequest(prompt, max_tokens, tuple(stop))])
        taken = result.token_ids[:result.completion.completion_tokens]
        return self._scored(prompt + taken, top_k, len(prompt)) if taken else []

    def score(self, sequence: list[int], top_k: int) -> list[Scored]:
        return self._scored(sequence, top_k, 1)


@dataclass
class LogprobFidelity:
    """The measures, and the token sequences the teacher-forced scores were taken on (prompt + the reference's
    tokens; empty when the shared-prefix estimate ran)."""

    fidelity: Fidelity
    sequences: list[list[int]]


def _ids(scored: Sequence[Scored], side: str) -> list[int]:
    if not all(isinstance(s.token, int) for s in scored):
        raise EchoRefused(f"{side} names tokens by text, not by id: its tokens cannot be sent back as a prompt")
    return [int(s.token) for s in scored]


def _compare(reference: Sequence[Scored], candidate: Sequence[Scored]) -> tuple[int, int, float]:
    """(positions, positions whose most likely tokens agree, summed KL estimate)."""
    same, kl = 0, 0.0
    for r, c in zip(reference, candidate, strict=True):
        if not r.top or not c.top:
            raise EndpointError("a server answered a position without its top log-probabilities")
        same += max(r.top, key=r.top.get) == max(c.top, key=c.top.get)
        kl += topk_kl_estimate(r.top, c.top)
    return len(reference), same, kl


def _named_by_id(scored: Sequence[Scored]) -> bool | None:
    return isinstance(scored[0].token, int) if scored else None


def _generations(candidate: LogprobSource, reference: LogprobSource, prompts: Sequence[list[int]], max_tokens: int,
                 stop: Sequence[str], top_k: int) -> list[tuple[list[Scored], list[Scored]]]:
    """(reference's, candidate's) greedy tokens per prompt, both naming tokens alike: the built-in runtime names
    them by text when the other side is a server that does."""
    def run() -> list[tuple[list[Scored], list[Scored]]]:
        return [(reference.generate(p, max_tokens, stop, top_k), candidate.generate(p, max_tokens, stop, top_k))
                for p in prompts]

    generated = run()
    kinds = {k for pair in generated for k in map(_named_by_id, pair) if k is not None}
    if len(kinds) > 1:
        runtimes = [s for s in (candidate, reference) if isinstance(s, RuntimeLogprobs)]
        if not runtimes:
            raise EndpointError(f"{candidate.name} and {reference.name} name tokens differently (one by id, one by "
                                "text): their log-probabilities cannot be compared")
        for source in runtimes:
            source.by_text = True
        generated = run()
    return generated


def logprob_fidelity(candidate: LogprobSource, reference: LogprobSource, prompts: Sequence[list[int]],
                     max_tokens: int, stop: Sequence[str] = (), top_k: int = DEFAULT_TOP_K) -> LogprobFidelity:
    """The candidate against the reference on `prompts` (token ids), `max_tokens` greedy tokens each (ended by
    `stop` as the protocol ends them), from top_k log-probabilities (see the module's docstring)."""
    if not prompts:
        raise ValueError("fidelity needs at least one prompt")
    generated = _generations(candidate, reference, prompts, max_tokens, stop, top_k)
    total = sum(len(r) for r, _ in generated)
    if not total:
        raise EndpointError(f"{reference.name} generated no tokens for the fidelity prompts")
    agreement = sum(r.token == c.token for ref, cand in generated for r, c in zip(ref, cand, strict=False)) / total
    positions = same = 0
    kl = 0.0
    sequences: list[list[int]] = []
    try:
        for prompt, (ref, _) in zip(prompts, generated, strict=True):
            sequence = prompt + _ids(ref, reference.name)
            n, s, k = _compare(reference.score(sequence, top_k), candidate.score(sequence, top_k))
            positions, same, kl = positions + n, same + s, kl + k
            sequences.append(sequence)
        how = TEACHER_FORCED
    except EchoRefused:
        positions, same, kl, sequences = 0, 0, 0.0, []
        for ref, cand in generated:
            shared = next((j for j, (r, c) in enumerate(zip(ref, cand, strict=False)) if r.token != c.token),
                          min(len(ref), len(cand)) - 1) + 1  # up to the first differing token: same context
            n, s, k = _compare(ref[:shared], cand[:shared])
            positions, same, kl = positions + n, same + s, kl + k
        how = SHARED_PREFIX
    if not positions:
        raise EndpointError("no position could be compared for fidelity")
    return LogprobFidelity(Fidelity(greedy_token_agreement=agreement, top1_agreement=same / positions,
                                    mean_kl=kl / positions, num_prompts=len(prompts), num_tokens=positions,
                                    kl_method=f"{topk_kl_method(top_k)}, {how}"), sequences)
