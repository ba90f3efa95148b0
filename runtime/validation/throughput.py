"""Timing the runtime: prefill and decode tokens/s and time per output token of one batch, with or without MTP
speculative decoding, through the public `generate` (no stop tokens, so every request makes all its tokens),
repeated so that the report can tell a difference from timing noise."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from npuport.benchlog import Progress
from npuport.errors import NpuportError
from npuport.runtime.generate import generate
from npuport.runtime.model import Qwen35
from npuport.runtime.validation.report import THROUGHPUT_FIGURES, ThroughputRun

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


def throughput_figures(prompt_tokens: int, batch: int, new_tokens: int, prefill_s: float,
                       call_s: float) -> dict[str, float | None]:
    """The figures (THROUGHPUT_FIGURES names) of a prefill call and a full call: prefill tok/s = prompt tokens /
    prefill s; decode tok/s = batch x (new_tokens - 1) / decode s, where decode s = call s - prefill s; time per
    output token = decode s / (new_tokens - 1); output tok/s = batch x new_tokens / call s. The decode figures
    are None when the full call was not slower than the prefill call (noise larger than the decode)."""
    steps, decode_s = new_tokens - 1, call_s - prefill_s
    return {"prefill_tokens_per_s": prompt_tokens / prefill_s,
            "decode_tokens_per_s": batch * steps / decode_s if decode_s > 0 else None,
            "time_per_output_token_ms": decode_s / steps * 1000 if decode_s > 0 else None,
            "output_tokens_per_s": batch * new_tokens / call_s}


# Which end of a decode figure's range has no bound when a repeat's decode time was not positive: its rate was
# unbounded above, its time per output token at or below zero.
_UNBOUNDED_END = {"decode_tokens_per_s": 1, "time_per_output_token_ms": 0}


def repeat_ranges(repeats: Sequence[dict[str, float | None]]) -> dict[str, list[float | None]]:
    """Each figure's [lowest, highest] over the repeats' figures (throughput_figures of each); a figure some
    repeat could not measure gets None at the end it left without a bound, and no range if no repeat measured it."""
    ranges: dict[str, list[float | None]] = {}
    for figure in THROUGHPUT_FIGURES:
        values = [r[figure] for r in repeats if r[figure] is not None]
        if not values:
            continue
        bounds: list[float | None] = [min(values), max(values)]
        if len(values) < len(repeats):
            bounds[_UNBOUNDED_END[figure]] = None
        ranges[figure] = bounds
    return ranges


def measure_throughput(model: Qwen35, prompts: Sequence[Sequence[int]], new_tokens: int, *, mtp: int = 0,
                       label: str, repeats: int = 1, invariant: bool | None = None,
                       model_label: str | None = None) -> ThroughputRun:
    """Time one batch of `prompts` (token ids), greedy, `new_tokens` per request, after one warm-up call.

    Prefill is a call that makes one token: the target's prefill and first token, and with MTP the head's
    prefill too. Decode is the rest of a call that makes `new_tokens`: (new_tokens - 1) tokens per request.
    Each repeat times a prefill call and then a full call. The figures (throughput_figures) are those of the
    median prefill time and the median decode time (full call - prefill call, per repeat), output tok/s that of
    the median full call; `ranges` holds each figure's lowest and highest over the repeats (repeat_ranges): the
    spread the report weighs differences against.
    `model_label` names the model timed, so that the report compares runs of one model only. Progress goes to
    stderr (benchlog.Progress: a bar on a terminal, else a line every few seconds)."""
    if new_tokens < 2:
        raise NpuportError("throughput needs at least 2 new tokens per request (one prefill, one decode)")
    if repeats < 1:
        raise NpuportError("throughput needs at least one timed repeat")
    batch, prompt_tokens = len(prompts), sum(len(p) for p in prompts)
    prefill_s, call_s = [], []
    with Progress(f"timing {label}", 1 + 2 * repeats, "calls", tokens=True) as bar:
        generate(model, prompts, min(new_tokens, WARMUP_TOKENS), mtp=mtp, invariant=invariant)
        bar.update(advance=1, tokens=batch * min(new_tokens, WARMUP_TOKENS))
        for _ in range(repeats):
            prefill_s.append(_timed_generate(model, prompts, 1, mtp, invariant))
            bar.update(advance=1, tokens=batch)
            call_s.append(_timed_generate(model, prompts, new_tokens, mtp, invariant))
            bar.update(advance=1, tokens=batch * new_tokens)
    # The medians of the prefill and the decode time: one call slowed by other work on the machine moves neither.
    median_prefill = statistics.median(prefill_s)
    median_decode = statistics.median(c - p for p, c in zip(prefill_s, call_s, strict=True))
    figures = throughput_figures(prompt_tokens, batch, new_tokens, median_prefill, median_prefill + median_decode)
    figures["output_tokens_per_s"] = batch * new_tokens / statistics.median(call_s)
    ranges = repeat_ranges([throughput_figures(prompt_tokens, batch, new_tokens, p, c)
                            for p, c in zip(prefill_s, call_s, strict=True)])
    return ThroughputRun(label=label, mtp=mtp > 0, batch_size=batch, num_speculative_tokens=mtp or None,
                         model=model_label, repeats=repeats, ranges=ranges, **figures)
