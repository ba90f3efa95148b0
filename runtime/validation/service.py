"""What `npuport serve` does with a request between its body and its answer: prompts tokenized (chat messages
through the model's chat template) and checked against the model's context and vocabulary, rows - a prompt x n -
handed to the batcher, and the rows' results put together as the OpenAI objects, whole or as stream chunks
written as they come. No HTTP here: serve.py reads bodies and writes bytes."""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus

from npuport.errors import NpuportError
from npuport.runtime.validation.batching import Job, LogprobSpec, RequestBatcher, RowAnswer
from npuport.runtime.validation.completions import RuntimeCompletions, TextRequest
from npuport.runtime.validation.gsm8k import render_chat_prompt
from npuport.runtime.validation.openai_api import (
    Answer,
    ChatRequest,
    ChunkMaker,
    CompletionRequest,
    Generation,
    RequestError,
    StreamedText,
    chat_logprobs,
    chat_object,
    check_context,
    completion_logprobs,
    completion_object,
    sse,
    token_texter,
    with_first_token,
)

Write = Callable[[bytes], None]


@dataclass(frozen=True)
class Prepared:
    """A request made ready for the model: its prompts' token ids (and texts, for echo), what to generate, and
    whether it is a chat."""

    prompt_ids: list[list[int]]
    prompt_texts: list[str]
    generation: Generation
    chat: bool
    echo: bool = False


class OpenAIService:
    """The served model (`runner`, named `served_model` to clients) behind a RequestBatcher of `max_rows` rows."""

    def __init__(self, runner: RuntimeCompletions, served_model: str, max_rows: int) -> None:
        if runner.context_tokens is None:
            raise NpuportError("the model's config.json states no max_position_embeddings; serve needs the "
                               "model's context to bound what a request may ask for")
        self.runner, self.served_model = runner, served_model
        self.batcher = RequestBatcher(runner, max_rows)

    def close(self) -> None:
        self.batcher.close()

    # -- requests in ------------------------------------------------------------------------------------------

    def prepare_completion(self, request: CompletionRequest) -> Prepared:
        ids = [self.runner.encode(p) if isinstance(p, str) else list(p) for p in request.prompts]
        self._check(ids, request.generation)
        texts = [p if isinstance(p, str) else self.runner.decode(p) for p in request.prompts] if request.echo else []
        return Prepared(ids, texts, request.generation, chat=False, echo=request.echo)

    def prepare_chat(self, request: ChatRequest) -> Prepared:
        try:
            text = render_chat_prompt(self.runner.tokenizer, request.messages, request.template_kwargs)
        except NpuportError as e:
            raise RequestError(HTTPStatus.BAD_REQUEST, str(e), "messages", "chat_template") from None
        ids = [self.runner.encode(text)]
        self._check(ids, request.generation)
        return Prepared(ids, [], request.generation, chat=True)

    def _check(self, ids: list[list[int]], generation: Generation) -> None:
        check_context(ids, generation.max_tokens, self.runner.context_tokens, self.runner.vocab_size)

    def _job(self, prepared: Prepared, on_tokens: Callable[[int, list[int]], None] | None = None) -> Job:
        g = prepared.generation
        rows = [TextRequest(ids, g.max_tokens, tuple(g.stop)) for ids in prepared.prompt_ids for _ in range(g.n)]
        spec = None if g.logprobs is None else LogprobSpec(g.logprobs, prompt_too=prepared.echo)
        return Job(rows, g.sampling, spec, on_tokens)

    # -- answers out ------------------------------------------------------------------------------------------

    def answer(self, prepared: Prepared) -> dict:
        """The whole answer object, once every row is done."""
        rows = self.batcher.submit(self._job(prepared)).result()
        answers = [self._answer(prepared, i, row) for i, row in enumerate(rows)]
        make = chat_object if prepared.chat else completion_object
        return make(self.served_model, answers, sum(map(len, prepared.prompt_ids)), _completion_tokens(rows))

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

    def stream(self, prepared: Prepared, write: Write) -> None:
        """The answer as server-sent events, each row's text as it is generated, then each row's last piece
        with its finish reason, the usage (if asked for) and [DONE]. If writing fails (the client went away),
        the rows are cancelled and the error raised. If the model fails, an error event ends the stream and the
        error is raised, for the caller to report."""
        events: queue.SimpleQueue[tuple[int, list[int]] | None] = queue.SimpleQueue()
        job = self._job(prepared, on_tokens=lambda row, new: events.put((row, new)))
        future = self.batcher.submit(job)
        future.add_done_callback(lambda _: events.put(None))
        chunks = ChunkMaker(self.served_model, prepared.chat)
        texts = [StreamedText(self.runner.decode, prepared.generation.stop) for _ in job.rows]
        try:
            while (event := events.get()) is not None:
                row, new = event
                if delta := texts[row].add(new):
                    write(sse(chunks.text(row, delta)))
            rows = future.result()
            for row, (text, answer) in enumerate(zip(texts, rows, strict=True)):
                write(sse(chunks.text(row, text.finish(answer.result.completion.text),
                                      answer.result.completion.finish_reason)))
            if prepared.generation.include_usage:
                write(sse(chunks.usage(sum(map(len, prepared.prompt_ids)), _completion_tokens(rows))))
            write(sse("[DONE]"))
        except (ConnectionError, TimeoutError):
            job.cancel()
            raise


def _completion_tokens(rows: Sequence[RowAnswer]) -> int:
    return sum(r.result.completion.completion_tokens or 0 for r in rows)
