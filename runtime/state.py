"""Per-request inference state: static KV caches of the full-attention layers (target and MTP), the GDN
recurrent states with k + 1 verify slots and conv windows of (W - 1) + k columns, and `commit_accepted`,
which keeps what a verify step accepted.

A forward writes the tokens it is given at positions `state.positions + t`; every forward is followed by
`commit_accepted(state, n_new)`, which advances each request by the tokens it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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

    recurrent [B, k + 1, HV, K, V] fp32: slots of states S [K, V] (see kernels/gated_delta_rule.py);
    read_slot [B] says which slot holds each request's current state. A verify of T <= k + 1 tokens writes
    the state after token t into slot t; committing n tokens makes slot n - 1 current, no copy.
    conv [B, conv_dim, (W - 1) + k]: the last inputs of the conv, newest last; a verify appends its T
    inputs and committing n of them shifts the window right by T - n, so the W - 1 newest columns end at
    the last kept input.
    """

    def __init__(self, batch: int, slots: int, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        hv, kd, vd = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
        self.recurrent = torch.zeros(batch, slots, hv, kd, vd, dtype=state_dtype(dtype), device=device)
        self.read_slot = torch.zeros(batch, dtype=torch.long, device=device)
        width = config.linear_conv_kernel_dim - 1 + slots - 1
        self.conv = torch.zeros(batch, config.conv_dim, width, dtype=dtype, device=device)
        self.staged = 0  # tokens of a verify step awaiting commit

    @property
    def slots(self) -> int:
        return self.recurrent.shape[1]

    def current(self) -> torch.Tensor:
        """Each request's current state, [B, HV, K, V]."""
        return self.recurrent[torch.arange(self.recurrent.shape[0], device=self.read_slot.device), self.read_slot]

    def set_current(self, state: torch.Tensor) -> None:
        """Store a committed state [B, HV, K, V] (after a prefill) in slot 0."""
        self.recurrent[:, 0] = state
        self.read_slot.zero_()

    def commit(self, n_new: torch.Tensor) -> None:
        if not self.staged:
            return
        # A request that keeps nothing (it has finished) gets slot 0: its state is no longer used.
        keep = n_new.clamp(1, self.staged)
        self.read_slot.copy_(keep - 1)
        width = self.conv.shape[-1]
        cols = (torch.arange(width, device=keep.device)[None, :] - (self.staged - keep)[:, None]).clamp_min(0)
        self.conv.copy_(self.conv.gather(-1, cols[:, None, :].expand(-1, self.conv.shape[1], -1)))
        self.staged = 0


LayerState = KVCache | GDNState


@dataclass
class ModelState:
    """positions [B]: tokens committed per request; layers: one state per decoder layer."""

    positions: torch.Tensor
    layers: list[LayerState]


def new_target_state(config: ModelConfig, batch: int, capacity: int, spec_tokens: int, dtype: torch.dtype,
                     device: torch.device) -> ModelState:
    """State for the target model: room for `capacity` positions and verify steps of spec_tokens + 1."""
    layers: list[LayerState] = [
        KVCache(batch, capacity, config.num_key_value_heads, config.head_dim, dtype, device)
        if kind == FULL_ATTENTION else GDNState(batch, spec_tokens + 1, config, dtype, device)
        for kind in config.layer_types
    ]
    return ModelState(torch.zeros(batch, dtype=torch.long, device=device), layers)


def new_mtp_state(config: ModelConfig, batch: int, capacity: int, dtype: torch.dtype,
                  device: torch.device) -> ModelState:
    """State for the MTP head: one KV cache per MTP layer."""
    layers: list[LayerState] = [
        KVCache(batch, capacity, config.num_key_value_heads, config.head_dim, dtype, device)
        for _ in range(config.mtp_num_hidden_layers)
    ]
    return ModelState(torch.zeros(batch, dtype=torch.long, device=device), layers)


def commit_accepted(state: ModelState, n_new: torch.Tensor) -> None:
    """Keep the first n_new[b] tokens of the last forward for request b (0 for a finished request):
    KV length p -> p + n_new, GDN state slot n_new - 1, conv window rolled back over the rest."""
    state.positions += n_new
    for layer in state.layers:
        if isinstance(layer, GDNState):
            layer.commit(n_new)
