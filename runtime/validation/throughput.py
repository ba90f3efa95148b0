"""Timing the runtime: prefill and decode tokens/s and time per output token of one batch, with or without MTP
speculative decoding, through the public `generate` (no stop tokens, so every request makes all its tokens)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from npuport.errors import NpuportError
from npuport.runtime.generate import generate
from npuport.runtime.model import Qwen35
from npuport.runtime.validation.report import ThroughputRun

WARMUP_TOKENS = 2  # a warm-up call reaches every code path a timed one takes (prefill, decode or verify)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` when it is the machine's accelerator (torch.accelerator: CUDA, NPU
    and the rest alike); a host device runs synchronously."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None and device.type == accelerator.type:
        torch.accelerator.synchronize(device)


def _timed_generate(model: Qwen35, prompts: Sequence[Sequence[int]], new_tokens: int, mtp: int,
                    invariant: bool | None) -> float:
    synchronize(model.device)
    start = time.perf_counter()
    generate(model, prompts, new_tokens, mtp=mtp, invariant=invariant)
    synchronize(model.device)
    return time.perf_counter() - start


def measure_throughput(model: Qwen35, prompts: Sequence[Sequence[int]], new_tokens: int, *, mtp: int = 0,
                       label: str, repeats: int = 1, invariant: bool | None = None) -> ThroughputRun:
    """Time one batch of `prompts` (token ids), greedy, `new_tokens` per request, after one warm-up call.

    Prefill is a call that makes one token: the target's prefill and first token, and with MTP the head's
    prefill too. Decode is the rest of a call that makes `new_tokens`: (new_tokens - 1) tokens per request.
    Each call is timed `repeats` times and the fastest kept (other work on the machine only adds time).
    prefill tok/s = prompt tokens / prefill s; decode tok/s = batch x (new_tokens - 1) / decode s; time per
    output token = decode s / (new_tokens - 1); output tok/s = batch x new_tokens / full call s. The decode
    figures are None when the full call was not slower than the prefill call (noise larger than the decode)."""
    if new_tokens < 2:
        raise NpuportError("throughput needs at least 2 new tokens per request (one prefill, one decode)")
    if repeats < 1:
        raise NpuportError("throughput needs at least one timed repeat")
    generate(model, prompts, min(new_tokens, WARMUP_TOKENS), mtp=mtp, invariant=invariant)
    prefill_s = min(_timed_generate(model, prompts, 1, mtp, invariant) for _ in range(repeats))
    total_s = min(_timed_generate(model, prompts, new_tokens, mtp, invariant) for _ in range(repeats))
    decode_s = total_s - prefill_s
    batch, steps = len(prompts), new_tokens - 1
    return ThroughputRun(
        label=label,
        mtp=mtp > 0,
        batch_size=batch,
        prefill_tokens_per_s=sum(len(p) for p in prompts) / prefill_s,
        decode_tokens_per_s=batch * steps / decode_s if decode_s > 0 else None,
        time_per_output_token_ms=decode_s / steps * 1000 if decode_s > 0 else None,
        output_tokens_per_s=batch * new_tokens / total_s,
        num_speculative_tokens=mtp or None,
    )
