"""How tokens travel to MoE experts - BF16, or int8 with per-token scales - as a context-scoped setting.

`with dispatch(bf16=True): ...` applies to the current thread or asyncio task only and is restored on
exit, exceptions included; the MoE layers read it on every call. Nothing here writes the environment:
the engines' variables (SGLANG_DEEPEP_BF16_DISPATCH, DEEP_NORMAL_MODE_USE_INT8_QUANT) only seed the
default, once, at import.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from npuport.errors import NpuportError

BF16_ENV = "SGLANG_DEEPEP_BF16_DISPATCH"
INT8_ENV = "DEEP_NORMAL_MODE_USE_INT8_QUANT"
_TRUE = {"1", "true", "yes", "on"}


class DispatchError(NpuportError):
    """Tokens were to be dispatched in a form the experts cannot take."""


@dataclass(frozen=True)
class DispatchConfig:
    """bf16: True = BF16 tokens, False = int8 tokens + per-token scales (W8A8 experts only), None = follow
    the experts (int8 into W8A8 experts, BF16 into BF16 experts)."""

    bf16: bool | None = None


def config_from_env(environ: Mapping[str, str]) -> DispatchConfig:
    """The default an engine's environment asks for; BF16 wins when both variables are set."""
    if environ.get(BF16_ENV, "").strip().lower() in _TRUE:
        return DispatchConfig(bf16=True)
    if environ.get(INT8_ENV, "").strip().lower() in _TRUE:
        return DispatchConfig(bf16=False)
    return DispatchConfig()


_ENV_DEFAULT = config_from_env(os.environ)
_current: contextvars.ContextVar[DispatchConfig | None] = contextvars.ContextVar("npuport_moe_dispatch", default=None)


def current_dispatch() -> DispatchConfig:
    """The setting of the innermost `dispatch` block of this thread / task, else the environment's default."""
    return _current.get() or _ENV_DEFAULT


@contextmanager
def dispatch(*, bf16: bool | None) -> Iterator[DispatchConfig]:
    """Dispatch tokens as BF16 (True), int8 (False) or as the experts need (None) inside the block."""
    token = _current.set(DispatchConfig(bf16=bf16))
    try:
        yield current_dispatch()
    finally:
        _current.reset(token)


def int8_dispatch(experts_quantized: bool, layer: str) -> bool:
    """Whether the MoE layer `layer` sends int8 tokens to its experts under the current setting."""
    bf16 = current_dispatch().bf16
    if bf16 is None:
        return experts_quantized
    if not bf16 and not experts_quantized:
        raise DispatchError(
            f"{layer}: int8 dispatch was forced, but the experts of this layer are BF16 and cannot take int8 tokens "
            "(run it under dispatch(bf16=True), or leave the dispatch to follow the experts)"
        )
    return not bf16
