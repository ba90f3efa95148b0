"""Several ranks, one driver: rank 0 runs a command's code unchanged (generate, validate), and every model load,
generate and forward_logits call it makes is first sent to the other ranks, which make the same call on their part
of the model - so the collectives inside the model meet. Only rank 0 reads prompts and data and writes reports.

The calls travel as torch.distributed.broadcast_object_list from rank 0, each with rank 0's dispatch setting
(runtime/dispatch.py), under which the others make it: every rank sends its tokens in the form the others expect. A
generate call's stop check (a host function of the decoded text) runs on rank 0 only; each of its answers is
broadcast, so every rank ends each request at the same step. A stream's token sink runs on rank 0 only. The driver
is the process's (a rank process has one role), so calls from any thread of rank 0 are mirrored - a server's request
threads too - one call at a time.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from npuport.runtime.dispatch import current_dispatch, dispatch
from npuport.runtime.parallel import Parallel

_CALLS: dict[str, Callable] = {}  # name -> the undecorated function, for the followers
_LOAD, _STOP = "load", "stop"
_STOP_CHECK = "should_stop"
_RANK_0_ONLY = ("on_tokens", "on_finish")  # host callbacks that only rank 0 runs (sinks); the others get None


class _Driver:
    """Rank 0's side: what it sends, and the models it loaded (a call names its model by index)."""

    def __init__(self, parallel: Parallel) -> None:
        self.parallel, self.models = parallel, []
        self.turn = threading.RLock()  # one mirrored call at a time: the ranks' collectives must meet in order

    def send(self, message: Any) -> None:
        dist.broadcast_object_list([message], src=0, group=self.parallel.group)

    def index(self, model: torch.nn.Module) -> int:
        return next(i for i, m in enumerate(self.models) if m is model)

    def shared_stop_check(self, check: Callable[[int, list[int]], bool]) -> Callable[[int, list[int]], bool]:
        def decide(index: int, tokens: list[int]) -> bool:
            answer = bool(check(index, tokens))
            self.send(answer)
            return answer
        return decide


class _Current:
    driver: _Driver | None = None




def _receive(parallel: Parallel) -> Any:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=parallel.group)
    return box[0]


@contextmanager
def driving(parallel: Parallel) -> Iterator[None]:
    """On rank 0 of several: loads and calls inside the block are mirrored on the other ranks (follow), which
    stop when the block ends, an exception included."""
    driver = _Current.driver = _Driver(parallel)
    try:
        yield
    finally:
        _Current.driver = None
        with driver.turn:
            driver.send((_STOP,))


def driver_parallel() -> Parallel | None:
    """The Parallel of the driving() block this call is in, else None."""
    driver = _Current.driver
    return None if driver is None else driver.parallel


def mirrored_load(load: Callable) -> Callable:
    """For load_model(path, device, dtype, parallel): inside driving(), the other ranks load their parts too (on
    their own devices) and the model becomes one that calls can name."""
    @functools.wraps(load)
    def call(path, device=None, dtype=torch.bfloat16, parallel=None):
        driver = _Current.driver
        if driver is None or parallel is not None:
            return load(path, device, dtype, parallel)
        with driver.turn:
            driver.send((_LOAD, str(path), dtype))
            model = load(path, device, dtype, driver.parallel)
            driver.models.append(model)
        return model
    return call


def mirrored(fn: Callable) -> Callable:
    """For fn(model, ...) that runs a split model's collectives: inside driving(), the other ranks make the
    same call on their parts first."""
    _CALLS[fn.__qualname__] = fn

    @functools.wraps(fn)
    def call(model, *args, **kwargs):
        driver = _Current.driver
        if driver is None or not model.parallel.active:
            return fn(model, *args, **kwargs)
        with driver.turn:
            check = kwargs.get(_STOP_CHECK)
            if check is not None:
                kwargs = {**kwargs, _STOP_CHECK: driver.shared_stop_check(check)}
            sent = {**kwargs, _STOP_CHECK: check is not None} if _STOP_CHECK in kwargs else kwargs
            sent = {name: None if name in _RANK_0_ONLY else value for name, value in sent.items()}
            driver.send((fn.__qualname__, driver.index(model), args, sent, current_dispatch().bf16))
            return fn(model, *args, **kwargs)
    return call


def follow(load: Callable, parallel: Parallel, device: torch.device) -> None:
    """On ranks 1..world-1: load and call what rank 0 sends, until it stops. load: the undecorated load_model."""
    models = []
    while True:
        message = _receive(parallel)
        if message[0] == _STOP:
            return
        if message[0] == _LOAD:
            models.append(load(message[1], device, message[2], parallel))
            continue
        name, index, args, kwargs, bf16 = message
        if kwargs.get(_STOP_CHECK):
            kwargs = {**kwargs, _STOP_CHECK: lambda index, tokens: bool(_receive(parallel))}
        elif _STOP_CHECK in kwargs:
            kwargs = {**kwargs, _STOP_CHECK: None}
        with dispatch(bf16=bf16):
            _CALLS[name](models[index], *args, **kwargs)
