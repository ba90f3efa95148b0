"""Generation's steps run eagerly or captured as device graphs: `Steps` holds a call's target and MTP-head states
and runs the prefill, the decode steps and the MTP rounds on them - with graphs, a greedy decode step or MTP round
is one graph (its body over a DirectRound), a sampled one runs its body over a CapturedRound (each part a graph,
the sampler's draws eager), and a short prefill is padded to a fixed width and captured per chunk. The states and
their graphs are kept per model and reused by the next call of the same shapes (reusable_steps)."""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from npuport.devices import DeviceGraph, PauseCount, graphs_supported
from npuport.kernels.gated_delta_rule import VerifyLog
from npuport.runtime.model import Qwen35
from npuport.runtime.prefill import (
    GRAPH_PREFILL_POSITIONS,
    mtp_prefill,
    mtp_prefill_chunk,
    pad_to_width,
    padded_prefill,
    prefill,
    prefill_width,
    rounded_capacity,
    static_prefill_chunk,
)
from npuport.runtime.rounds import Accept, Choose, DirectRound, decode_round, mtp_round
from npuport.runtime.sampling import greedy_accept
from npuport.runtime.state import ModelState, commit_accepted, reset_state


def scratch_copy(state: ModelState) -> ModelState:
    """The same state with every tensor cloned: a step can be warmed up on it without touching the caches."""
    layers = []
    for layer in state.layers:
        twin = copy.copy(layer)
        for name, value in vars(layer).items():
            if isinstance(value, torch.Tensor | VerifyLog):
                setattr(twin, name, value.clone())
        layers.append(twin)
    return ModelState(state.positions.clone(), layers, state.capacity)


CAPTURES = PauseCount()  # the device graphs captured (the warm-up run included)


class CapturedStep:
    """fn(*states, *inputs) captured once as a device graph over `states` and static copies of `inputs`
    (CUDA graphs: the launches of a whole step replayed at once). A call copies the new inputs in, replays and
    returns fresh outputs; fn must leave nothing on the host that a replay would not redo."""

    def __init__(self, fn: Callable, states: Sequence[ModelState], inputs: Sequence[torch.Tensor], pool=None) -> None:
        start = time.perf_counter()
        self.inputs = [x.clone() for x in inputs]
        self.graph = DeviceGraph(states[0].positions.device, pool)  # outputs are cloned out: pools can be shared
        # compiles kernels, makes workspaces
        self.graph.warm_up(lambda: fn(*(scratch_copy(state) for state in states), *self.inputs))
        self.outputs = self.graph.capture(lambda: fn(*states, *self.inputs))
        CAPTURES.add(time.perf_counter() - start)

    def __call__(self, *inputs: torch.Tensor):
        for buf, x in zip(self.inputs, inputs, strict=True):
            buf.copy_(x)
        self.graph.replay()
        if self.outputs is None or isinstance(self.outputs, torch.Tensor):
            return None if self.outputs is None else self.outputs.clone()
        return tuple(x.clone() for x in self.outputs)


class CapturedRound:
    """The Round protocol with each part a captured graph of DirectRound's (keyed by its shapes), on the states
    of `steps`."""

    def __init__(self, steps: Steps, k: int) -> None:
        self.steps, self.k = steps, k

    def _direct(self, state: ModelState, mtp_state: ModelState | None = None) -> DirectRound:
        return DirectRound(self.steps.model, state, mtp_state, self.k)

    def positions(self) -> torch.Tensor:
        return self.steps.state.positions

    def verify(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.steps.run(("verify", tokens.shape[1]), lambda state, tok: self._direct(state).verify(tok),
                              (self.steps.state,), [tokens])

    def commit(self, n_new: torch.Tensor, step_tokens: int) -> None:
        self.steps.run(("commit", step_tokens), lambda state, n: commit_accepted(state, n, step_tokens),
                       (self.steps.state,), [n_new])

    def draft(self, logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.steps.run(("draft", self.k), lambda head, lg, h: self._direct(self.steps.state, head).draft(lg, h),
                              (self.steps.mtp_state,), [logits, hidden])

    def catch_up(self, emitted: torch.Tensor, hidden: torch.Tensor, start: torch.Tensor, accepted: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        def fn(head, *inputs):
            return self._direct(self.steps.state, head).catch_up(*inputs)

        return self.steps.run(("catch up", emitted.shape[1]), fn, (self.steps.mtp_state,),
                              [emitted, hidden, start, accepted])

    def commit_head(self, n_new: torch.Tensor) -> None:
        commit_accepted(self.steps.mtp_state, n_new, 0)  # positions only: one launch, nothing to capture


class Steps:
    """A generate call's states - the target's and, with MTP, the head's - and the steps run on them, eagerly or
    (graphs) captured once per shape and replayed."""

    def __init__(self, model: Qwen35, state: ModelState, mtp_state: ModelState | None, graphs: bool) -> None:
        self.model, self.state, self.mtp_state, self.graphs = model, state, mtp_state, graphs
        self.captured: dict[tuple, CapturedStep] = {}
        self.prefill_pool = None  # one memory pool for the prefill graphs of every width: one runs at a time
        self.replaying = True  # False inside capture_only()

    def run(self, key: tuple, fn: Callable, states: tuple[ModelState, ...], inputs: Sequence[torch.Tensor],
            pool=None):
        """fn(*states, *inputs): directly, or with graphs as the step captured under `key` (captured on first use)."""
        if not self.graphs:
            return fn(*states, *inputs)
        if key not in self.captured:
            self.captured[key] = CapturedStep(fn, states, inputs, pool)
        step = self.captured[key]
        return step(*inputs) if self.replaying else step.outputs

    @contextlib.contextmanager
    def capture_only(self) -> Iterator[None]:
        """Inside the block a step met for the first time is captured and none is replayed: the states are not
        touched (a capture runs its warm-up on copies) and the outputs returned are the graph's own buffers,
        meaningless until a replay. With graphs only."""
        self.replaying = False
        try:
            yield
        finally:
            self.replaying = True

    def round_parts(self, k: int) -> DirectRound | CapturedRound:
        """The Round protocol on these states: each part captured with graphs, else direct."""
        return CapturedRound(self, k) if self.graphs else DirectRound(self.model, self.state, self.mtp_state, k)

    def decode(self, tok: torch.Tensor, progress: Sequence[torch.Tensor], choose: Choose | None
               ) -> tuple[torch.Tensor, ...]:
        """decode_round from tok [B] with progress = (active, produced, stop_tokens, max_new_tokens) [B] each;
        choose None: greedy. Greedy with graphs the whole step is one graph; otherwise the body runs over
        round_parts (a sampler's draws stay eager). Returns (next token [B], active, produced)."""
        if choose is None and self.graphs:
            def whole(state, *inputs):
                return decode_round(DirectRound(self.model, state, None, 0), argmax, *inputs)

            return self.run(("decode", progress[2].numel()), whole, (self.state,), [tok, *progress])
        return decode_round(self.round_parts(0), choose or argmax, tok, *progress)

    def mtp_round(self, k: int, tok: torch.Tensor, mtp_logits: torch.Tensor, mtp_hidden: torch.Tensor,
                  progress: Sequence[torch.Tensor], accept: Accept | None) -> tuple[torch.Tensor, ...]:
        """mtp_round of k drafts as decode runs decode_round (accept None: greedy matching): greedy with graphs
        the whole round over both states is one graph. Returns mtp_round's outputs."""
        if accept is None and self.graphs:
            def whole(state, mtp_state, *inputs):
                return mtp_round(DirectRound(self.model, state, mtp_state, k), greedy_accept, *inputs)

            return self.run(("mtp round", k, progress[2].numel()), whole, (self.state, self.mtp_state),
                            [tok, mtp_logits, mtp_hidden, *progress])
        return mtp_round(self.round_parts(k), accept or greedy_accept, tok, mtp_logits, mtp_hidden, *progress)

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, chunk_size: int | None) -> torch.Tensor:
        """prefill() of tokens [B, T] (lengths [B]) into the target state; padded to a fixed width with static
        shapes where prefill_padded says (each chunk a graph with `graphs`: the same kernels either way, so the
        same bits)."""
        width = prefill_width(tokens.shape[1], chunk_size)
        if not self.prefill_padded(tokens.shape[0], width):
            return prefill(self.model, self.state, tokens, lengths, chunk_size)
        direct = functools.partial(static_prefill_chunk, self.model)

        def run(state, chunk, n_valid):
            return self.run(("prefill", width), direct, (state,), [chunk, n_valid], self.prefill_pool)

        return padded_prefill(run, self.state, tokens, lengths, width)

    def mtp_prefill(self, next_tokens: torch.Tensor, hidden: torch.Tensor, lengths: torch.Tensor,
                    chunk_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """mtp_prefill() into the head's state, padded and captured as prefill() is (the head's chunks right-padded
        with token 0 and zero hidden rows, which it commits none of)."""
        direct = functools.partial(mtp_prefill_chunk, self.model)
        width = prefill_width(next_tokens.shape[1], chunk_size)
        if not self.prefill_padded(next_tokens.shape[0], width):
            return mtp_prefill(direct, self.mtp_state, next_tokens, hidden, lengths, chunk_size)

        def run(state, tokens, h, last, n_valid):
            return self.run(("mtp prefill", width), direct, (state,), [tokens, h, last, n_valid], self.prefill_pool)

        return mtp_prefill(run, self.mtp_state, pad_to_width(next_tokens, width), pad_to_width(hidden, width),
                           lengths, width)

    def prefill_padded(self, batch: int, width: int) -> bool:
        """Whether a prefill of `batch` rows in chunks of `width` runs padded with static shapes (each chunk a
        graph with `graphs`): where graphs can be captured and the prefill is small enough to be bound by its
        launches (GRAPH_PREFILL_POSITIONS). Makes the graphs' shared memory pool on first use."""
        if not graphs_supported(self.model.device) or batch * width > GRAPH_PREFILL_POSITIONS:
            return False
        if self.graphs and self.prefill_pool is None:
            self.prefill_pool = DeviceGraph.new_pool(self.model.device)
        return True


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy choice: logits [B, V] -> [B]."""
    return logits.argmax(-1)


_KEPT_STEPS_LOCK = threading.Lock()  # guards creating a model's lock for its kept steps


@contextlib.contextmanager
def reusable_steps(model: Qwen35, batch: int, capacity: int, mtp: int, graphs: bool,
                   invariant_rows: int | None = None) -> Iterator[Steps]:
    """Steps over fresh target (and, with mtp, MTP head) states for `batch` requests of `capacity` positions
    (rounded up to CAPACITY_STEP). With graphs, the last call's states and captured steps are reset and reused
    when the shapes match (one set kept per model): a generate call then replays graphs instead of capturing
    them again (tens of ms a call). A call that finds the kept set in use by another thread gets fresh states of
    its own."""
    capacity = rounded_capacity(capacity)
    with _KEPT_STEPS_LOCK:
        lock = model.__dict__.setdefault("_kept_steps_lock", threading.Lock())
    if not graphs or not lock.acquire(blocking=False):
        mtp_state = model.new_mtp_state(batch, capacity) if mtp else None
        yield Steps(model, model.new_state(batch, capacity, spec_tokens=mtp), mtp_state, graphs)
        return
    try:
        key = (batch, capacity, mtp, model.dtype, invariant_rows)  # steps captured in another mode do not serve
        kept = model.__dict__.get("_kept_steps")
        if kept is None or kept[0] != key:
            model.__dict__["_kept_steps"] = None  # the old set's memory goes before the new one is made
            mtp_state = model.new_mtp_state(batch, capacity) if mtp else None
            kept = (key, Steps(model, model.new_state(batch, capacity, spec_tokens=mtp), mtp_state, graphs))
            model.__dict__["_kept_steps"] = kept
        steps = kept[1]
        for state in (steps.state, steps.mtp_state):
            if state is not None:
                reset_state(state)
        yield steps
    finally:
        lock.release()
