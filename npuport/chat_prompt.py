"""A conversation rendered into a prompt by the model's own chat template, with bounds: a template comes with the
model and is code, so it renders in a thread of its own, stopped after a time, and its text is refused past a size.
Standard library only; what a server (serving) and a harness (validation's GSM8K) both use."""

from __future__ import annotations

import ctypes
import threading
import traceback
from pathlib import Path
from typing import Any, Protocol

from npuport.errors import NpuportError

CHAT_TEMPLATE_TIMEOUT_S = 5.0  # a real chat template renders in milliseconds
MAX_CHAT_PROMPT_CHARS = 1 << 20  # about the text a 262,144-token context holds


class ChatTemplate(Protocol):
    """Anything with a transformers-style chat template (a tokenizer loaded from the artifact)."""

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


# A chat template comes with the artifact and is code (Jinja, run by transformers in its sandboxed environment,
# which stops file and attribute access but neither loops nor large strings): rendered with a time and a size bound.

class _RenderStopped(BaseException):
    """Raised inside a chat template's rendering thread once its time is up; a BaseException, so that no
    `except Exception` on the way (Jinja's own) swallows it."""


def chat_template_source(template: ChatTemplate) -> str:
    """Where `template`'s chat template was read from, for errors: chat_template.jinja (or chat_template.json,
    tokenizer_config.json) in the tokenizer's folder; else the kind of object it is."""
    folder = str(getattr(template, "name_or_path", "") or "")
    if folder:
        for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
            if (Path(folder) / name).is_file():
                return str(Path(folder) / name)
    return f"the chat template of {folder or type(template).__name__}"


def _template_failure(error: BaseException) -> str:
    """One line for an error raised while rendering: its type, the first line of its message (cut short) and
    the line of the template it came from, when Jinja's traceback names one."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    message = message if len(message) <= 200 else message[:200] + "..."
    line = getattr(error, "lineno", None) or next(
        (f.lineno for f in reversed(traceback.extract_tb(error.__traceback__)) if f.filename == "<template>"), None)
    return f"{type(error).__name__}: {message}" + (f" (template line {line})" if line else "")


def _stop_thread(thread: threading.Thread, wait_s: float = 1.0) -> None:
    """Raise _RenderStopped in `thread` (CPython delivers it at the thread's next bytecode, so a template
    looping for ever stops at once rather than burning a core until the process exits) and wait for it."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_RenderStopped))
    thread.join(wait_s)


def render_chat_prompt(template: ChatTemplate, conversation: list[dict[str, str]],
                       template_kwargs: dict[str, Any] | None = None, *, timeout_s: float = CHAT_TEMPLATE_TIMEOUT_S,
                       max_chars: int = MAX_CHAT_PROMPT_CHARS) -> str:
    """`template.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **template_kwargs)`
    with bounds: rendered in a worker thread, stopped after `timeout_s` seconds, and refused when the text is
    longer than `max_chars`. Every failure - a template error, its sandbox refusing an access, either bound - is
    one NpuportError naming where the template comes from (`chat_template_source`)."""
    outcome: list[Any] = []

    def render() -> None:
        try:
            outcome.append(template.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                                        **(template_kwargs or {})))
        except BaseException as e:  # handed to the caller's thread, _RenderStopped included
            outcome.append(e)

    worker = threading.Thread(target=render, name="chat-template", daemon=True)
    worker.start()
    worker.join(timeout_s)
    source = chat_template_source(template)
    if worker.is_alive() or not outcome:
        _stop_thread(worker)
        raise NpuportError(f"{source}: the chat template did not render within {timeout_s:g} s (stopped)")
    result = outcome[0]
    if isinstance(result, BaseException):
        raise NpuportError(f"{source}: the chat template failed: {_template_failure(result)}")
    if not isinstance(result, str):
        raise NpuportError(f"{source}: the chat template gave a {type(result).__name__}, not text")
    if len(result) > max_chars:
        raise NpuportError(f"{source}: the chat template rendered {len(result):,} characters, more than the "
                           f"{max_chars:,} a prompt may have")
    return result
