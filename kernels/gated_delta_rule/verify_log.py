"""What a verify step keeps of its tokens' state updates (VerifyLog) and how the accepted ones are applied
to the state afterwards (replay_pending): shared by the kernel and its reference."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class VerifyLog:
    """The per-token state updates of the last verify step, for up to S tokens per request (QWEN35.md: "the
    state after each of the k + 1 tokens"): the state after token t is
    S_t = exp(log_decay_t) S_{t-1} + keys_t writes_t^T, from the state the step started at.

    keys [2, B, S, H, K] (unit-norm), log_decay [2, B, S, HV], writes [2, B, S, HV, V], all fp32 (float64 for
    float64 states). Two halves: a step reads the entries of half `side` [1] (long) and writes its own into
    the other, so no kernel program overwrites an entry that another has still to read; `keep` flips it.
    pending [B] (long): how many of the recorded entries request b keeps; the next step replays those first.
    """

    keys: torch.Tensor
    log_decay: torch.Tensor
    writes: torch.Tensor
    side: torch.Tensor
    pending: torch.Tensor

    @classmethod
    def empty(cls, batch: int, slots: int, key_heads: int, value_heads: int, k_dim: int, v_dim: int,
              dtype: torch.dtype, device: torch.device) -> VerifyLog:
        def zeros(*shape):
            return torch.zeros(2, batch, slots, *shape, dtype=dtype, device=device)

        return cls(zeros(key_heads, k_dim), zeros(value_heads), zeros(value_heads, v_dim),
                   torch.zeros(1, dtype=torch.long, device=device), torch.zeros(batch, dtype=torch.long, device=device))

    @property
    def slots(self) -> int:
        return self.keys.shape[2]

    def keep(self, n: torch.Tensor) -> None:
        """After a verify step: request b keeps its first n[b] tokens (0..S); their entries become pending."""
        self.pending.copy_(n)
        self.side.bitwise_xor_(1)

    def clear(self) -> None:
        """Nothing pending: the state already is the committed one (after a prefill)."""
        self.pending.zero_()

    def clone(self) -> VerifyLog:
        return VerifyLog(*(getattr(self, f.name).clone() for f in fields(self)))


def log_storage_rows(log: VerifyLog) -> int:
    """The requests each half of `log` spans in its storage: its batch B for a log of its own, more for the rows
    of a larger log (a view of some of its requests: runtime/slots.py). The kernels need each half's requests
    contiguous, a half `rows x S` entries after the other; raises ValueError otherwise."""
    rows = None
    for x in (log.keys, log.log_decay, log.writes):
        per_request = x[0, 0].numel() if x.shape[1] else 1
        if not x[0].is_contiguous() or x.stride(1) != per_request or x.stride(0) % per_request:
            raise ValueError("the verify log's halves must each hold their requests contiguously")
        if rows not in (None, x.stride(0) // per_request):
            raise ValueError("the verify log's tensors span different storages")
        rows = x.stride(0) // per_request
    return rows


def replay_pending(state: torch.Tensor, log: VerifyLog, slots: int | None = None) -> torch.Tensor:
    """state [B, HV, K, V] with each request's pending log entries applied (a new tensor): the committed
    state when a verify step's tokens were kept. slots: how many entries to go through, each applied where a
    request keeps it (default: as many as any request keeps, which the host reads off the device; log.slots
    needs no host synchronisation - a graph can capture it)."""
    if slots is None:
        slots = int(log.pending.max()) if log.pending.numel() else 0
    group = log.writes.shape[3] // log.keys.shape[3]
    keys_now, decay_now, writes_now = (x.index_select(0, log.side)[0] for x in (log.keys, log.log_decay, log.writes))
    out = state.clone()
    for j in range(slots):
        keys = keys_now[:, j].repeat_interleave(group, dim=1)  # [B, HV, K]
        stepped = out * decay_now[:, j].exp()[..., None, None]
        stepped = stepped + keys[..., :, None] * writes_now[:, j, :, None, :]
        out = torch.where((log.pending > j)[:, None, None, None], stepped, out)
    return out



def check_log_room(log: VerifyLog, tokens: int) -> None:
    if tokens > log.slots:
        raise ValueError(f"a verify step of {tokens} tokens needs {tokens} log slots, the log has {log.slots}")
