"""Per-request inference state: static KV caches of the full-attention layers (target and MTP), the GDN
recurrent states with a verify log of k + 1 token updates and conv windows of (W - 1) + k columns, and
`commit_accepted`, which keeps what a verify step accepted.

A forward writes the tokens it is given at positions `state.positions + t`; every forward is followed by
`commit_accepted(state, n_new, step_tokens)`, which advances each request by the tokens it keeps. What a commit
does depends only on its arguments - how many tokens the decode / verify step before it took (0 after a prefill)
- never on a count the forward left behind: a replayed graph and a direct call commit alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from npuport.kernels.gated_delta_rule import VerifyLog, replay_pending
from npuport.kernels.gdn_gating import state_dtype
from npuport.runtime.config import FULL_ATTENTION, ModelConfig


class KVCache:
    """Keys and values of one full-attention layer: k, v [B, S, Hkv, D]. Entries past a request's
    committed length are scratch: a rejected draft's entry is simply overwritten later."""

    def __init__(self, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.k = torch.zeros(batch, capacity, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def update(self, start: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, T, Hkv, D] at positions start[b] + t (those past the capacity are dropped: only
        padding goes there); returns the cache up to the furthest position written, [B, S', Hkv, D]."""
        b, t = k.shape[:2]
        pos = start[:, None] + torch.arange(t, device=k.device)
        rows = torch.arange(b, device=k.device)[:, None].expand(b, t)
        ok = pos < self.capacity
        self.k[rows[ok], pos[ok]] = k[ok].to(self.k.dtype)
        self.v[rows[ok], pos[ok]] = v[ok].to(self.v.dtype)
        used = min(self.capacity, int(start.max()) + t)
        return self.k[:, :used], self.v[:, :used]


class GDNState:
    """One GatedDeltaNet layer's state.

    recurrent [B, HV, K, V] fp32: each request's state S [K, V] (see kernels/gated_delta_rule/).
    log: with k > 0 drafts, the VerifyLog of the last verify step (k + 1 slots): a verify step leaves
    `recurrent` at its start and records each token's update; committing n tokens marks the first n entries
    pending, and the next step replays them before its own tokens - no state is copied or rolled back.
    conv [B, conv_dim, (W - 1) + k]: the last inputs of the conv, newest last; a verify appends its T
    inputs and committing n of them shifts the window right by T - n, so the W - 1 newest columns end at
    the last kept input.
    """

    def __init__(self, batch: int, slots: int, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        hv, kd, vd = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
        self.recurrent = torch.zeros(batch, hv, kd, vd, dtype=state_dtype(dtype), device=device)
        self.log = None if slots == 1 else VerifyLog.empty(batch, slots, config.linear_num_key_heads, hv, kd, vd,
                                                           state_dtype(dtype), device)
        width = config.linear_conv_kernel_dim - 1 + slots - 1
        self.conv = torch.zeros(batch, config.conv_dim, width, dtype=dtype, device=device)

    @property
    def slots(self) -> int:
        """The most tokens one decode / verify step may take."""
        return 1 if self.log is None else self.log.slots

    def current(self, graph_safe: bool = False) -> torch.Tensor:
        """Each request's committed state, [B, HV, K, V] (a new tensor when entries are pending). graph_safe:
        without a host synchronisation (every log slot replayed, masked by what each request keeps)."""
        if self.log is None:
            return self.recurrent
        return replay_pending(self.recurrent, self.log, self.log.slots if graph_safe else None)

    def set_current(self, state: torch.Tensor) -> None:
        """Store committed states [B, HV, K, V] (after a prefill)."""
        self.recurrent.copy_(state)
        if self.log is not None:
            self.log.clear()

    def commit(self, n_new: torch.Tensor, step_tokens: int) -> None:
        """Keep the first n_new[b] of the step_tokens tokens the last decode / verify step staged (step_tokens 0:
        the last forward was a prefill, which leaves nothing staged)."""
        if not step_tokens:
            return
        if step_tokens > self.slots:
            raise ValueError(f"a commit of a {step_tokens}-token step; the state holds steps of {self.slots}")
        if self.log is not None:
            self.log.keep(n_new.clamp(0, step_tokens))
        if step_tokens == 1:  # one staged token: every request keeps it (or has finished), the window stays
            return
        # A request that keeps nothing (it has finished) shifts its window as if it kept one token: unused.
        keep = n_new.clamp(1, step_tokens)
        width = self.conv.shape[-1]
        cols = (torch.arange(width, device=keep.device)[None, :] - (step_tokens - keep)[:, None]).clamp_min(0)
        self.conv.copy_(self.conv.gather(-1, cols[:, None, :].expand(-1, self.conv.shape[1], -1)))


LayerState = KVCache | GDNState


@dataclass
class ModelState:
    """positions [B]: tokens committed per request; layers: one state per decoder layer; capacity: the
    positions each request has room for (its KV caches' rows; positions beyond are padding, never read)."""

    positions: torch.Tensor
    layers: list[LayerState]
    capacity: int


def new_target_state(config: ModelConfig, batch: int, capacity: int, spec_tokens: int, dtype: torch.dtype,
                     device: torch.device) -> ModelState:
    """State for the target model: room for `capacity` positions and verify steps of spec_tokens + 1."""
    layers: list[LayerState] = [
        KVCache(batch, capacity, config.num_key_value_heads, config.head_dim, dtype, device)
        if kind == FULL_ATTENTION else GDNState(batch, spec_tokens + 1, config, dtype, device)
        for kind in config.layer_types
    ]
    return ModelState(torch.zeros(batch, dtype=torch.long, device=device), layers, capacity)


def new_mtp_state(config: ModelConfig, batch: int, capacity: int, dtype: torch.dtype,
                  device: torch.device) -> ModelState:
    """State for the MTP head: one KV cache per MTP layer."""
    layers: list[LayerState] = [
        KVCache(batch, capacity, config.num_key_value_heads, config.head_dim, dtype, device)
        for _ in range(config.mtp_num_hidden_layers)
    ]
    return ModelState(torch.zeros(batch, dtype=torch.long, device=device), layers, capacity)


def reset_state(state: ModelState) -> None:
    """Back to empty caches, in place (the same tensors, so graphs captured over them stay valid): no position
    committed, zero GDN and conv states, nothing pending. KV entries are left: no query sees past its position."""
    state.positions.zero_()
    for layer in state.layers:
        if isinstance(layer, GDNState):
            layer.recurrent.zero_()
            layer.conv.zero_()
            if layer.log is not None:
                layer.log.clear()


def commit_accepted(state: ModelState, n_new: torch.Tensor, step_tokens: int) -> None:
    """Keep the first n_new[b] tokens of the last forward for request b (0 for a finished request): KV length
    p -> p + n_new; after a decode / verify step of step_tokens tokens, GDN log entries 0..n_new - 1 pending
    and the conv window rolled back over the rest (step_tokens = 0 after a prefill, which staged nothing)."""
    state.positions += n_new
    for layer in state.layers:
        if isinstance(layer, GDNState):
            layer.commit(n_new, step_tokens)
