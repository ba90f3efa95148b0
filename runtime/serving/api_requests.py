"""The requests of the OpenAI API as `npuport serve` reads them: `/v1/completions` and `/v1/chat/completions`
bodies read into checked requests (every field that sizes work bounded before anything is allocated), and the
errors it answers. No HTTP here (http_handler.py) and no model (service.py): plain data in, plain data out."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from npuport.runtime.completion import MAX_TOP_LOGPROBS
from npuport.runtime.sampling import SamplingParams

DEFAULT_MAX_TOKENS = 16  # the OpenAI API's (and vLLM's) default for /v1/completions; chat's is the context's room
DEFAULT_TEMPERATURE = 1.0  # likewise; clients that want greedy send temperature 0
MAX_PROMPTS = 128  # prompts in one request's list: each costs a tokenization and a slot in a batch
MAX_CHOICES = 16  # `n`: completions per prompt (each a row of the batch)
MAX_ROWS = 128  # prompts x n of one request
MAX_STOP_STRINGS = 16  # each is searched for in the text every few tokens
MAX_STOP_TOKEN_IDS = 1024  # vLLM's stop_token_ids: a set looked up once per token
MAX_MESSAGES = 256
MAX_TEMPLATE_KWARGS_CHARS = 64 * 1024  # of chat_template_kwargs as JSON: a template may write a value per message
# apply_chat_template's own arguments (and the messages it renders): the server sets them; from a request they fail
# the rendering or change what it returns, so they are not template variables a request may set
RENDERER_ARGUMENTS = frozenset({
    "conversation", "messages", "add_generation_prompt", "continue_final_message", "tokenize", "return_dict",
    "return_tensors", "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs",
    "sanitize_control_tokens"})
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes
SHOWN_CHARS = 100  # of a client's own text (a path, a model name) quoted back in an error
# Fields of the OpenAI API (and vLLM's sampling extras) that this server does not implement -> the values that ask
# for nothing (what the field's absence means): a request giving any other value is refused, naming the fields,
# rather than answered as if the field were not there. Fields that only describe the request (`user`, `metadata`,
# `store`, `service_tier`, `prompt_cache_key`, `safety_identifier`) change no answer and are accepted.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
    "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False), "functions": ([],),
    "function_call": ("none",), "response_format": ({"type": "text"},), "suffix": ("",), "best_of": (1,),
    "audio": (), "modalities": (["text"],), "prediction": (), "reasoning_effort": (), "web_search_options": (),
    "top_k": (-1, 0), "min_p": (0,), "use_beam_search": (False,), "length_penalty": (1,),
    "skip_special_tokens": (True,), "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "structured_outputs": (), "logits_processors": ()}


class RequestError(Exception):
    """A request the server refuses: the HTTP status, the message it answers, the request field at fault
    (OpenAI's `param`) and a machine-readable `code`."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


def error_body(status: HTTPStatus, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI API's error object: `{"error": {"message", "type", "param", "code"}}`."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def shown(text: str) -> str:
    """A client's own text, cut short, for quoting back in an error."""
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how a JSON body spells a UTF-16 surrogate (\ud800-\udfff)


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (or object key) in `value` holding a lone surrogate, None if none does."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else str(key)
            if _lone_surrogate(key, inner) is not None:
                return inner
            if (found := _lone_surrogate(item, inner)) is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, (str, list, dict)) and (found := _lone_surrogate(item, f"{path}[{i}]")):
                return found
    return None


def check_text(raw: bytes | bytearray, body: Any) -> None:
    """Refuse a body whose strings hold a lone surrogate (JSON's "\\ud800" with no pair): no text the tokenizer
    reads, nor UTF-8 the answer could be written in. Refused with a 400 naming the field (its path); the body is
    only walked when its bytes spell a surrogate at all."""
    if not SURROGATE_ESCAPE.search(raw):
        return
    try:
        path = _lone_surrogate(body, "")
    except RecursionError:
        raise RequestError(HTTPStatus.BAD_REQUEST, "the body is nested too deep") from None
    if path is not None:
        field = shown(path)
        raise RequestError(HTTPStatus.BAD_REQUEST, f"'{field}' holds a lone surrogate (an unpaired \\ud800-\\udfff "
                           "escape), which is not text", field, "invalid_value")


def refuse(name: str, message: str) -> RequestError:
    return RequestError(HTTPStatus.BAD_REQUEST, message, name, "invalid_value")


def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise RequestError(HTTPStatus.BAD_REQUEST, f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}",
                           name, "invalid_type")
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestError(HTTPStatus.BAD_REQUEST, f"'{name}' must be a finite number", name, "invalid_value")
    return value


def _bounded_int(body: dict[str, Any], name: str, default: int | None, low: int, high: int) -> Any:
    value = _field(body, name, (int,), default)
    if value is not None and not low <= value <= high:
        raise refuse(name, f"'{name}' is {value}; it must be between {low} and {high}")
    return value


Prompt = str | list[int]  # text, or token ids as the API also takes them


@dataclass(frozen=True)
class Generation:
    """What every kind of request asks of the model: how many tokens, when to stop, how to sample, how many
    choices per prompt, log-probabilities (top-k per token, None: none), and whether to stream; and the most
    tokens its prompts may have (`max_prompt_tokens`, the server's limit; None: only the model's context), for
    the check once they are tokenized (`check_prompt_tokens`). `to_context`: max_tokens was not asked for, and is
    the server's limit - generation goes as far as the model's context leaves room for, at most that
    (`within_context`), where an asked-for max_tokens beyond the room is refused. max_tokens 0 (with echo): the
    prompt is scored, nothing generated."""

    max_tokens: int
    stop: list[str]
    sampling: SamplingParams
    n: int = 1
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: tokens spelled `token_id:N`
    max_prompt_tokens: int | None = None
    to_context: bool = False
    # vLLM's sampling extras, as the serving benchmarks send them: stop tokens of the request's own, the model's EOS
    # ids not ending it, the fewest tokens before any stop ends it, the stop string kept in the text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop: bool = False


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[Prompt]
    generation: Generation
    echo: bool = False


@dataclass(frozen=True)
class ChatRequest:
    """`template_kwargs`: vLLM's chat_template_kwargs, with the request's own template as `chat_template` when
    the server allows one; `template_field`: the request field that template came from (None: the model's)."""

    messages: list[dict[str, str]]
    generation: Generation
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    template_field: str | None = None


def _check_model(body: dict[str, Any], served_model: str, aliases: Sequence[str]) -> None:
    """`model`: absent, the served name, or one of its aliases (the MODEL path as the server was started with)."""
    model = body.get("model")
    if model is not None and model != served_model and model not in aliases:
        raise RequestError(HTTPStatus.NOT_FOUND, f"model {shown(str(model))!r} is not served here; this server "
                                                 f"serves {served_model!r}", "model", "model_not_found")


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether `value` is null or one of `neutral` (a boolean only as itself: false is no penalty of 0)."""
    def same(n: Any) -> bool:
        return value is n if isinstance(n, bool) or isinstance(value, bool) else value == n

    return value is None or any(same(n) for n in neutral)


def check_unsupported(body: dict[str, Any]) -> None:
    """Refuse a request that asks for what this server does not implement (NEUTRAL_VALUES: penalties, tools,
    response formats, logit bias, ...), naming every such field; their neutral values are accepted."""
    asked = [name for name, neutral in NEUTRAL_VALUES.items() if name in body and not _is_neutral(body[name], neutral)]
    if asked:
        names = ", ".join(f"'{name}'" for name in asked)
        raise RequestError(HTTPStatus.BAD_REQUEST, f"{names} {'is' if len(asked) == 1 else 'are'} not implemented by "
                           "this server; leave them out (or give their neutral value)", asked[0],
                           "unsupported_parameter")


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in value)


def _prompt_too_long(what: str, tokens: int, max_prompt_tokens: int, param: str) -> RequestError:
    return RequestError(HTTPStatus.BAD_REQUEST, f"{what} has {tokens} tokens; this server takes at most "
                        f"{max_prompt_tokens} (npuport serve --max-prompt-tokens)", param, "prompt_too_long")


def check_prompt_tokens(prompt_ids: Sequence[Sequence[int]], max_prompt_tokens: int | None, chat: bool) -> None:
    """Refuse prompts, once tokenized, of more than max_prompt_tokens tokens (None: no limit of the server's):
    a completion's `prompt`s, or a chat's `messages` as rendered (`chat`)."""
    for i, ids in enumerate(prompt_ids):
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            what, param = ("the rendered chat", "messages") if chat else (f"prompt {i}", "prompt")
            raise _prompt_too_long(what, len(ids), max_prompt_tokens, param)


def _prompts(body: dict[str, Any], max_prompt_tokens: int) -> list[Prompt]:
    """`prompt`: a string, a list of strings, a list of token ids or a list of such lists (the API's four forms).
    Token ids are counted here, before anything is tokenized or allocated; text once it is tokenized."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise refuse("prompt", "'prompt' must be a string, a list of strings, a list of token ids or a list of "
                               "such lists, not empty")
    if len(prompts) > MAX_PROMPTS:
        raise refuse("prompt", f"'prompt' lists {len(prompts)} prompts; this server takes at most {MAX_PROMPTS} "
                               "per request")
    for i, p in enumerate(prompts):
        if not isinstance(p, str) and len(p) > max_prompt_tokens:
            raise _prompt_too_long(f"prompt {i}", len(p), max_prompt_tokens, "prompt")
    return prompts


def _generation(body: dict[str, Any], max_tokens_limit: int, max_prompt_tokens: int, prompts: int,
                max_tokens_names: Sequence[str], logprobs: int | None, default_max_tokens: int | None,
                echo: bool = False) -> Generation:
    """The generation a body asks for. default_max_tokens: max_tokens when the body gives none (None: up to the
    context's room, at most max_tokens_limit); 0 is taken with echo alone (the prompt scored, as vLLM does)."""
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise refuse("stop", f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings")
    name = next((n for n in max_tokens_names if body.get(n) is not None), max_tokens_names[0])
    to_context = body.get(name) is None and default_max_tokens is None
    max_tokens = _field(body, name, (int,), max_tokens_limit if to_context else default_max_tokens)
    if max_tokens < (0 if echo else 1):
        raise refuse(name, f"'{name}' is {max_tokens}; need {name} >= 1 (0 only with echo: the prompt scored, "
                           "nothing generated)")
    if max_tokens > max_tokens_limit:
        raise refuse(name, f"'{name}' is {max_tokens}, more than this server's limit of {max_tokens_limit} "
                           "(npuport serve --max-tokens-limit)")
    temperature = float(_field(body, "temperature", (int, float), DEFAULT_TEMPERATURE))
    if temperature < 0:
        raise refuse("temperature", "'temperature' must be >= 0")
    top_p = float(_field(body, "top_p", (int, float), 1.0))
    if not 0 < top_p <= 1:
        raise refuse("top_p", "'top_p' must be in (0, 1]")
    seed = _field(body, "seed", (int,), None)
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise refuse("seed", "'seed' must be a 64-bit integer")
    n = _bounded_int(body, "n", 1, 1, MAX_CHOICES)
    if n * prompts > MAX_ROWS:
        raise refuse("n", f"{prompts} prompts x n = {n} make {n * prompts} completions; this server makes at most "
                          f"{MAX_ROWS} per request")
    stream = _field(body, "stream", (bool,), False)
    options = _field(body, "stream_options", (dict,), {})
    if options and not stream:
        raise refuse("stream_options", "'stream_options' is only for stream: true")
    stop_token_ids = _field(body, "stop_token_ids", (list,), [])
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_token_ids):
        raise refuse("stop_token_ids", f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids "
                                       "(integers >= 0)")
    min_tokens = _bounded_int(body, "min_tokens", 0, 0, max_tokens)
    return Generation(max_tokens, list(stop), SamplingParams(temperature, top_p, seed), n, logprobs, stream,
                      bool(options.get("include_usage")), _field(body, "return_tokens_as_token_ids", (bool,), False),
                      max_prompt_tokens, to_context, tuple(stop_token_ids), _field(body, "ignore_eos", (bool,), False),
                      min_tokens, _field(body, "include_stop_str_in_output", (bool,), False))


def parse_completion_request(body: Any, served_model: str, max_tokens_limit: int, *, max_prompt_tokens: int,
                             aliases: Sequence[str] = ()) -> CompletionRequest:
    """A /v1/completions body: `prompt` (see _prompts; token ids at most max_prompt_tokens), `max_tokens` (1 to
    max_tokens_limit, DEFAULT_MAX_TOKENS when absent; 0 with echo: the prompt's log-probabilities alone),
    `temperature`, `top_p`, `seed`, `stop`, `n`, `stream` (+ `stream_options.include_usage`), `echo`, `logprobs`
    (0 to MAX_TOP_LOGPROBS; 0: the chosen token's entry alone, as vLLM answers), `model` (absent, the served name
    or an alias), and vLLM's `ignore_eos`, `min_tokens` (0 to max_tokens), `stop_token_ids` (at most
    MAX_STOP_TOKEN_IDS) and `include_stop_str_in_output` (chat takes them too). Fields of the API this server does not
    implement are refused unless neutral (check_unsupported); others are ignored, as the engines ignore unknown
    ones. The model's context (`check_context`) and max_prompt_tokens (`check_prompt_tokens`) are checked again
    once the prompts are tokenized."""
    if not isinstance(body, dict):
        raise RequestError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
    _check_model(body, served_model, aliases)
    check_unsupported(body)
    prompts = _prompts(body, max_prompt_tokens)
    logprobs = _bounded_int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    echo = _field(body, "echo", (bool,), False)
    generation = _generation(body, max_tokens_limit, max_prompt_tokens, len(prompts), ("max_tokens",), logprobs,
                             DEFAULT_MAX_TOKENS, echo)
    if echo and generation.stream:
        raise refuse("echo", "'echo' is not streamed by this server; ask without stream")
    return CompletionRequest(prompts, generation, echo)


def _message(value: Any, i: int) -> dict[str, str]:
    """One chat message: `role` and `content` (a string, or a list of text parts, which are joined)."""
    if not isinstance(value, dict) or not isinstance(value.get("role"), str):
        raise refuse("messages", f"message {i} must be an object with a 'role'")
    content = value.get("content", "")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise refuse("messages", f"message {i}: only text content parts are served here")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise refuse("messages", f"message {i}: 'content' must be a string or a list of text parts")
    return {"role": value["role"], "content": content}


def _template_kwargs(body: dict[str, Any], allow_chat_template: bool) -> tuple[dict[str, Any], str | None]:
    """`chat_template_kwargs` (vLLM's: variables of the chat template, e.g. {"enable_thinking": false}) as the
    renderer takes them, and the request field that brought a template of the request's own (None: none).

    Refused: a renderer's argument (RENDERER_ARGUMENTS); more than MAX_TEMPLATE_KWARGS_CHARS of variables - a
    template may write a variable once per message (many write eos_token, which a variable overrides), so their
    size multiplies; and a template of the request's own - `chat_template_kwargs.chat_template` or, as vLLM also
    reads it, `chat_template` - unless allow_chat_template: a template is code the server runs, and Jinja builds
    a string of gigabytes from one expression."""
    kwargs = dict(_field(body, "chat_template_kwargs", (dict,), {}))
    for name in kwargs:
        if name in RENDERER_ARGUMENTS:
            raise refuse(f"chat_template_kwargs.{name}", f"'chat_template_kwargs.{name}' is set by this server, "
                                                         "not by a request")
    given = {"chat_template_kwargs.chat_template": kwargs.pop("chat_template", None),
             "chat_template": body.get("chat_template")}
    templates = {name: value for name, value in given.items() if value is not None}
    for name in templates:
        if not allow_chat_template:
            raise refuse(name, f"'{name}' replaces the model's chat template, which this server does not let a "
                               "request do (npuport serve --allow-client-chat-template allows it)")
    size = len(json.dumps(kwargs))
    if size > MAX_TEMPLATE_KWARGS_CHARS:
        raise refuse("chat_template_kwargs", f"'chat_template_kwargs' is {size:,} characters of JSON; this server "
                                             f"takes at most {MAX_TEMPLATE_KWARGS_CHARS:,}")
    if not templates:
        return kwargs, None
    if len(templates) > 1:
        raise refuse("chat_template", "'chat_template' and 'chat_template_kwargs.chat_template' are both given; "
                                      "give the template once")
    [(name, template)] = templates.items()
    if not isinstance(template, str) or not template:
        raise RequestError(HTTPStatus.BAD_REQUEST, f"'{name}' must be a non-empty string", name, "invalid_type")
    return {**kwargs, "chat_template": template}, name


def parse_chat_request(body: Any, served_model: str, max_tokens_limit: int, *, max_prompt_tokens: int,
                       allow_chat_template: bool = False, aliases: Sequence[str] = ()) -> ChatRequest:
    """A /v1/chat/completions body: `messages` (at most MAX_MESSAGES), `max_completion_tokens` or `max_tokens`
    (absent: as far as the model's context leaves room for, at most max_tokens_limit, as OpenAI and vLLM do),
    `logprobs` (true/false) with `top_logprobs` (0 to MAX_TOP_LOGPROBS), `chat_template_kwargs` (see
    _template_kwargs; the request's own template only with allow_chat_template), and the fields completions take
    (`n`, `stop`, `stream`, sampling, `model`, unimplemented fields refused). The rendered prompt is checked
    against max_prompt_tokens once tokenized."""
    if not isinstance(body, dict):
        raise RequestError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
    _check_model(body, served_model, aliases)
    check_unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise refuse("messages", f"'messages' must be a list of 1 to {MAX_MESSAGES} messages")
    messages = [_message(m, i) for i, m in enumerate(messages)]
    top = _bounded_int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    wants = _field(body, "logprobs", (bool,), False)
    if top is not None and not wants:
        raise refuse("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    generation = _generation(body, max_tokens_limit, max_prompt_tokens, 1, ("max_completion_tokens", "max_tokens"),
                             (top or 0) if wants else None, None)
    kwargs, template_field = _template_kwargs(body, allow_chat_template)
    return ChatRequest(messages, generation, kwargs, template_field)


def within_context(generation: Generation, prompt_ids: Sequence[Sequence[int]], context_tokens: int) -> Generation:
    """`generation` with a max_tokens it did not ask for (to_context) cut to the room the model's context leaves
    after its longest prompt (at least 1: a prompt that fills the context is refused by check_context)."""
    if not generation.to_context:
        return generation
    room = context_tokens - max(map(len, prompt_ids))
    return dataclasses.replace(generation, max_tokens=max(1, min(generation.max_tokens, room)))


def check_context(prompt_ids: list[list[int]], max_tokens: int, context_tokens: int, vocab: int) -> None:
    """Refuse a request whose prompt and `max_tokens` do not fit the model's context (`max_position_embeddings`
    tokens) - the runtime sizes its caches by prompt + max_tokens, so this bounds the memory a request takes -
    or whose token ids lie outside the vocabulary."""
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise refuse("prompt", f"prompt {i} has no tokens; a prompt needs at least one token")
        if not all(0 <= t < vocab for t in ids):
            raise refuse("prompt", f"prompt {i} has token ids outside the vocabulary of {vocab}")
        room = context_tokens - len(ids)
        if room < 1:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"prompt {i} has {len(ids)} tokens; the model's context is "
                               f"{context_tokens} tokens", "prompt", "context_length_exceeded")
        if max_tokens > room:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"'max_tokens' is {max_tokens}, but the model's context of "
                               f"{context_tokens} tokens leaves {room} after the {len(ids)} tokens of prompt {i}",
                               "max_tokens", "context_length_exceeded")
