"""What `npuport serve` does with a request between its body and its answer: prompts tokenized (chat messages
through the model's chat template) and checked against the model's context and vocabulary, rows - a prompt x n -
handed to the batcher, and the rows' results put together as the OpenAI objects, whole or as stream chunks
written as they come. No HTTP here: http_handler.py reads bodies and writes bytes, and tells whether its client is
there (`client_gone`, e.g. `peer_closed` of the connection) - a request whose client left is cancelled.

A text prompt is refused by its size before it is tokenized (its tokens cannot be counted without tokenizing it,
which takes seconds and gigabytes for megabytes of text), and tokenized in the request's own thread, next to the
others': no request waits for another's prompt to be tokenized."""

from __future__ import annotations

import queue
import select
import socket
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from http import HTTPStatus

from npuport.chat_prompt import render_chat_prompt
from npuport.errors import NpuportError
from npuport.runtime.serving.api_answers import (
    Answer,
    ChunkMaker,
    StreamedText,
    TokenText,
    chat_logprobs,
    chat_object,
    completion_logprobs,
    completion_object,
    sse,
    token_texter,
    with_first_token,
)
from npuport.runtime.serving.api_requests import (
    ChatRequest,
    CompletionRequest,
    Generation,
    RequestError,
    check_context,
    check_prompt_tokens,
    within_context,
)
from npuport.runtime.serving.batching import Job, LogprobSpec, RequestBatcher, RowAnswer
from npuport.runtime.serving.continuous import ContinuousBatcher
from npuport.runtime.serving.metrics import Request, ServeMetrics
from npuport.runtime.text_completions import RuntimeCompletions, TextRequest
from npuport.runtime.token_logprobs import PositionLogprobs

Write = Callable[[bytes], None]
ClientGone = Callable[[], bool]  # whether the client of a request has gone away
CLIENT_CHECK_S = 0.25  # seconds between two looks at whether the client of a request waiting for the model is there
# A text prompt of more bytes than this per token it may have (--max-prompt-tokens, else the model's context) is
# refused untokenized: text averages about 4 bytes a token; 16 leaves room for text of long tokens (indentation,
# rules of dashes), while 15 MB of text, which took 22 s and 2.6 GB to tokenize, is refused at once.
PROMPT_BYTES_PER_TOKEN = 16


class RequestCancelled(ConnectionAbortedError):
    """The client of a request went away (or stopped reading its answer) while it was served: its rows are
    cancelled - they end with finish reason CANCELLED - and nothing more is written to it. `reason`: what the
    client did, for the log."""

    def __init__(self, reason: str = "the client went away") -> None:
        super().__init__(f"{reason}; its request is cancelled")
        self.reason = reason


def peer_closed(connection: socket.socket) -> bool:
    """Whether the peer of `connection` has closed or reset it: what a server waiting on the model for a request
    can ask of its connection, without waiting. Bytes sent and not read yet (a next request) do not count as
    closed; a client that closes its sending side while it waits for the answer does."""
    try:
        if hasattr(select, "poll"):  # any descriptor; select() takes none past 1023
            poller = select.poll()
            poller.register(connection, select.POLLIN)
            readable = bool(poller.poll(0))
        else:
            readable = bool(select.select([connection], [], [], 0)[0])
        # readable: a peek returns at once - b"" at the end of the stream - where a socket with a timeout would
        # otherwise wait for data first
        return readable and connection.recv(1, socket.MSG_PEEK) == b""
    except (BlockingIOError, InterruptedError, TimeoutError):
        return False
    except (OSError, ValueError):  # reset, or closed on this side
        return True


@dataclass(frozen=True)
class Prepared:
    """A request made ready for the model: its prompts' token ids (and texts, for echo), what to generate, and
    whether it is a chat."""

    prompt_ids: list[list[int]]
    prompt_texts: list[str]
    generation: Generation
    chat: bool
    echo: bool = False
    arrived: float = field(default_factory=time.monotonic)  # when it began to be prepared (for the metrics)


class OpenAIService:
    """The served model (`runner`, named `served_model` to clients, who may also name it by one of `aliases`)
    behind a ContinuousBatcher of `max_rows` rows prefilling at most `prefill_tokens` positions an iteration (None:
    its default for the device) - with `invariant`, a RequestBatcher of one row per call. max_prompt_bytes:
    the most bytes of text a prompt may have to be tokenized (None: PROMPT_BYTES_PER_TOKEN for each token the
    request's prompts may have)."""

    def __init__(self, runner: RuntimeCompletions, served_model: str, max_rows: int, *,
                 max_prompt_bytes: int | None = None, aliases: Sequence[str] = (), invariant: bool = False,
                 prefill_tokens: int | None = None) -> None:
        if runner.context_tokens is None:
            raise NpuportError("the model's config.json states no max_position_embeddings; serve needs the "
                               "model's context to bound what a request may ask for")
        if max_prompt_bytes is not None and max_prompt_bytes < 1:
            raise NpuportError(f"the most bytes of a text prompt must be positive, got {max_prompt_bytes}")
        self.runner, self.served_model, self.max_prompt_bytes = runner, served_model, max_prompt_bytes
        self.aliases = tuple(a for a in aliases if a != served_model)
        self.metrics = ServeMetrics(served_model)
        self.batcher = (RequestBatcher(runner, max_rows, invariant=True) if invariant
                        else ContinuousBatcher(runner, max_rows, prefill_tokens, steps=self.metrics))

    def close(self) -> None:
        self.batcher.close()

    # -- requests in ------------------------------------------------------------------------------------------

    def prepare_completion(self, request: CompletionRequest) -> Prepared:
        arrived = time.monotonic()
        ids: list[list[int]] = []
        for i, prompt in enumerate(request.prompts):
            ids.append(self._tokenized(prompt, request.generation, f"prompt {i}", "prompt")
                       if isinstance(prompt, str) else list(prompt))
            check_prompt_tokens(ids, request.generation.max_prompt_tokens, chat=False)
        generation = self._check(ids, request.generation)
        texts = [p if isinstance(p, str) else self.runner.decode(p) for p in request.prompts] if request.echo else []
        return Prepared(ids, texts, generation, chat=False, echo=request.echo, arrived=arrived)

    def prepare_chat(self, request: ChatRequest) -> Prepared:
        arrived = time.monotonic()
        try:
            text = render_chat_prompt(self.runner.tokenizer, request.messages, request.template_kwargs)
        except NpuportError as e:
            raise RequestError(HTTPStatus.BAD_REQUEST, str(e), "messages", "chat_template") from None
        ids = [self._tokenized(text, request.generation, "the rendered chat", "messages")]
        check_prompt_tokens(ids, request.generation.max_prompt_tokens, chat=True)
        return Prepared(ids, [], self._check(ids, request.generation), chat=True, arrived=arrived)

    def _tokenized(self, text: str, generation: Generation, what: str, param: str) -> list[int]:
        """The token ids of a text prompt (`what`, from request field `param`), refused untokenized when it has
        more bytes than max_prompt_bytes."""
        limit = self.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * (generation.max_prompt_tokens
                                                                  or self.runner.context_tokens)
        size = len(text.encode("utf-8"))
        if size > limit:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"{what} is {size:,} bytes of text; this server tokenizes at "
                               f"most {limit:,} bytes of a prompt", param, "prompt_too_long")
        return self.runner.encode(text)

    def _check(self, ids: list[list[int]], generation: Generation) -> Generation:
        """The generation of prompts `ids`, its max_tokens cut to the context's room when not asked for, checked
        against the model's context and vocabulary."""
        generation = within_context(generation, ids, self.runner.context_tokens)
        check_context(ids, generation.max_tokens, self.runner.context_tokens, self.runner.vocab_size)
        if generation.min_tokens > generation.max_tokens:  # max_tokens cut to the context's room
            raise RequestError(HTTPStatus.BAD_REQUEST, f"'min_tokens' is {generation.min_tokens}, more than the "
                               f"{generation.max_tokens} tokens the model's context leaves room for", "min_tokens",
                               "context_length_exceeded")
        return generation

    def _job(self, prepared: Prepared, tracked: Request,
             on_tokens: Callable[[int, list[int]], None] | None = None) -> Job:
        """The batcher's job for `prepared`; `tracked` hears of its first token (the metrics), on_tokens of every
        row's tokens as they come (a stream)."""

        def heard(row: int, new: list[int]) -> None:
            tracked.first_token()
            if on_tokens is not None:
                on_tokens(row, new)

        g = prepared.generation
        rows = [TextRequest(ids, g.max_tokens, tuple(g.stop), stop_token_ids=g.stop_token_ids, ignore_eos=g.ignore_eos,
                            min_tokens=g.min_tokens, include_stop=g.include_stop)
                for ids in prepared.prompt_ids for _ in range(g.n)]
        spec = None if g.logprobs is None else LogprobSpec(g.logprobs, prompt_too=prepared.echo)
        return Job(rows, g.sampling, spec, heard)

    # -- answers out ------------------------------------------------------------------------------------------

    def answer(self, prepared: Prepared, client_gone: ClientGone | None = None) -> dict:
        """The whole answer object, once every row is done. While it waits, client_gone() is asked every
        CLIENT_CHECK_S: once True, the rows are cancelled and RequestCancelled raised."""
        if client_gone is not None and client_gone():  # gone while its prompts were tokenized: no prefill
            raise RequestCancelled
        tracked = self.metrics.submitted(prepared.arrived)
        try:
            job = self._job(prepared, tracked)
            future = self.batcher.submit(job)
            while client_gone is not None and not futures.wait([future], CLIENT_CHECK_S).done:
                if client_gone():
                    job.cancel()
                    raise RequestCancelled
            rows = future.result()
            answers = [self._answer(prepared, i, row) for i, row in enumerate(rows)]
            make = chat_object if prepared.chat else completion_object
            usage = sum(map(len, prepared.prompt_ids)), _completion_tokens(rows)
            answer = make(self.served_model, answers, *usage)
        except BaseException:
            tracked.done()
            raise
        tracked.done(*usage, success=True)
        return answer

    def _answer(self, prepared: Prepared, row: int, answer: RowAnswer) -> Answer:
        completion = answer.result.completion
        prompt = row // prepared.generation.n
        text = (prepared.prompt_texts[prompt] if prepared.echo else "") + completion.text
        if answer.logprobs is None:
            return Answer(text, completion.finish_reason)
        texter = token_texter(self.runner.token_text, prepared.generation.tokens_as_ids)
        if prepared.chat:
            return Answer(text, completion.finish_reason, chat_logprobs(answer.logprobs, texter))
        logprobs = completion_logprobs(answer.logprobs, texter)
        if prepared.echo:
            logprobs = with_first_token(prepared.prompt_ids[prompt][0], logprobs, texter)
        return Answer(text, completion.finish_reason, logprobs)

    def stream(self, prepared: Prepared, write: Write, client_gone: ClientGone | None = None) -> tuple[int, int]:
        """The answer as server-sent events, each row's text as it is generated, then each row's last piece
        with its finish reason, the usage (if asked for) and [DONE]; returns the usage's (prompt, completion)
        tokens. With log-probabilities, each row's tokens come once it has ended (the model computes them after
        its generation call), a chunk per token with that token's log-probabilities. If writing fails, or
        client_gone() - asked every CLIENT_CHECK_S while nothing is written - says so, the client went away: the
        rows are cancelled and RequestCancelled raised. If the model fails, its error is raised, for the caller to
        end the stream with an error event and report it."""
        if client_gone is not None and client_gone():  # gone while its prompts were tokenized: no prefill
            raise RequestCancelled
        tracked = self.metrics.submitted(prepared.arrived)
        try:
            usage = self._stream(prepared, write, client_gone, tracked)
        except BaseException:
            tracked.done()
            raise
        tracked.done(*usage, success=True)
        return usage

    def _stream(self, prepared: Prepared, write: Write, client_gone: ClientGone | None,
                tracked: Request) -> tuple[int, int]:
        events: queue.SimpleQueue[tuple[int, list[int]] | None] = queue.SimpleQueue()
        with_logprobs = prepared.generation.logprobs is not None
        job = self._job(prepared, tracked,
                        on_tokens=None if with_logprobs else lambda row, new: events.put((row, new)))
        future = self.batcher.submit(job)
        future.add_done_callback(lambda _: events.put(None))
        chunks = ChunkMaker(self.served_model, prepared.chat)
        g = prepared.generation
        texts = [StreamedText(self.runner.decode, g.stop, self.runner.stop_set(row), g.min_tokens, g.include_stop)
                 for row in job.rows]
        texter = token_texter(self.runner.token_text, prepared.generation.tokens_as_ids)

        def send(event: dict | str) -> None:
            try:
                write(sse(event))
            except TimeoutError as e:
                raise RequestCancelled("the client stopped reading its answer") from e
            except ConnectionError as e:
                raise RequestCancelled from e

        try:
            while (event := self._next_event(events, client_gone)) is not None:
                row, new = event
                if delta := texts[row].add(new):
                    send(chunks.text(row, delta))
            rows = future.result()
            for row, (text, answer) in enumerate(zip(texts, rows, strict=True)):
                offset = 0  # of the token in the text, as the answer without stream gives it
                for position in answer.logprobs or []:
                    logprobs = self._chunk_logprobs(prepared, position, texter, offset)
                    offset += len(texter(position.token))
                    send(chunks.text(row, text.add([position.token]), logprobs=logprobs))
                send(chunks.text(row, text.finish(answer.result.completion.text),
                                 answer.result.completion.finish_reason))
            usage = sum(map(len, prepared.prompt_ids)), _completion_tokens(rows)
            if prepared.generation.include_usage:
                send(chunks.usage(*usage))
            send("[DONE]")
            return usage
        except RequestCancelled:
            job.cancel()
            raise

    @staticmethod
    def _chunk_logprobs(prepared: Prepared, position: PositionLogprobs, texter: TokenText, offset: int) -> dict:
        """The `logprobs` of a stream chunk carrying one token: chat's `content` entry, or completions' lists
        with the token's offset in the text (`offset`)."""
        if prepared.chat:
            return chat_logprobs([position], texter)
        return completion_logprobs([position], texter, offset)

    @staticmethod
    def _next_event(events: queue.SimpleQueue, client_gone: ClientGone | None) -> tuple[int, list[int]] | None:
        while True:
            try:
                return events.get(timeout=None if client_gone is None else CLIENT_CHECK_S)
            except queue.Empty:
                if client_gone is not None and client_gone():
                    raise RequestCancelled from None


def _completion_tokens(rows: Sequence[RowAnswer]) -> int:
    return sum(r.result.completion.completion_tokens or 0 for r in rows)
