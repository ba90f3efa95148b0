"""Long steps, told as they go: `Progress` prints how far one has come (a bar on a terminal, a plain line every
few seconds in a log), and for the benchmark scripts `StepRecorder` runs named steps, times them, keeps going past
a failure and saves the results JSON after every step (a device call that runs out of time still leaves what it
measured)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm


class StepRecorder:
    """Records into `result` ("steps": seconds per step, "errors": tracebacks) and writes it to `out`."""

    def __init__(self, result: dict[str, Any], out: Path) -> None:
        self.result, self.out = result, Path(out)
        result.setdefault("steps", {})
        result.setdefault("errors", [])

    def save(self) -> None:
        self.out.write_text(json.dumps(self.result, indent=2) + "\n")

    def step(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs), timed; None (and the traceback recorded) if it raises."""
        start = time.perf_counter()
        try:
            value = fn(*args, **kwargs)
        except Exception:
            self.result["errors"].append({"step": name, "traceback": traceback.format_exc()})
            print(f"{name}: FAILED\n{self.result['errors'][-1]['traceback']}", flush=True)
            value = None
        self.result["steps"][name] = round(time.perf_counter() - start, 2)
        print(f"{name}: {self.result['steps'][name]} s", flush=True)
        self.save()
        return value


# ---------------------------------------------------------------------------------------------------------
# Progress of a long step

PROGRESS_INTERVAL_S = 10.0  # between two plain progress lines (stderr not a terminal)
PROGRESS_INTERVAL_ENV = "NPUPORT_PROGRESS_INTERVAL"  # seconds, to override it (0: a line at every update)


def _duration(seconds: float) -> str:
    """`42 s`, `3 min 05 s`, `2 h 07 min`."""
    s = int(seconds + 0.5)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class Progress:
    """Progress of one long step on stderr, whether or not it is a terminal: on a terminal a tqdm bar; otherwise
    (a log file, a pipe, a batch job) a plain line every PROGRESS_INTERVAL_S seconds - `LABEL: 12/40 questions,
    3072 tokens (25.1 tok/s), 2 min 02 s elapsed, about 4 min 45 s left` - and, for a step that printed any, one
    when it ends. The estimate of the rest is from the rate of this process's own work: what `start` says was done
    before it (a resumed run) counts as done, not as speed. Use as a context manager, or call `close`."""

    def __init__(self, label: str, total: int, unit: str = "questions", *, start: int = 0, tokens: bool = False,
                 scale: float = 1, stream: TextIO | None = None, interval_s: float | None = None,
                 enabled: bool = True) -> None:
        """`scale`: counts are shown divided by it (bytes as "GB": scale 1e9); `enabled` False shows nothing."""
        self.label, self.total, self.unit, self.counts_tokens, self.scale = label, total, unit, tokens, scale
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        if interval_s is None:
            try:
                interval_s = float(os.environ.get(PROGRESS_INTERVAL_ENV, PROGRESS_INTERVAL_S))
            except ValueError:
                interval_s = PROGRESS_INTERVAL_S
        self.interval_s = interval_s
        self.start, self.done, self.tokens = start, start, 0
        self.began = self.shown_at = time.monotonic()
        self.printed = False
        self.shown_done: int | None = None  # `done` as the last plain line showed it
        isatty = getattr(self.stream, "isatty", None)
        self.bar = (tqdm(total=total / scale, initial=start / scale, desc=label, unit=f" {unit}", file=self.stream,
                         leave=False, dynamic_ncols=True) if enabled and isatty is not None and isatty() else None)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def skip(self, count: int) -> None:
        """`count` more were done before this process began (a resumed run): done, but not part of the rate."""
        self.start += count
        self.done += count
        if self.bar is not None:
            self.bar.update(count / self.scale)

    def update(self, done: int | None = None, *, advance: int = 0, tokens: int = 0) -> None:
        """`done` so far (or `advance` more), `tokens` more generated."""
        before = self.done
        self.done = done if done is not None else self.done + advance
        self.tokens += tokens
        if self.bar is not None:
            if self.counts_tokens:
                self.bar.set_postfix_str(f"{self.tokens} tokens", refresh=False)
            self.bar.update((self.done - before) / self.scale)
            return
        now = time.monotonic()
        if not self.enabled:
            return
        if now - self.shown_at >= self.interval_s:
            self.shown_at = now
            self._line(now)

    def line(self) -> str:
        """The plain progress line, as of now."""
        return self._text(time.monotonic())

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.printed and self.done != self.shown_done:
            self._line(time.monotonic())

    def _line(self, now: float) -> None:
        print(self._text(now), file=self.stream, flush=True)
        self.printed, self.shown_done = True, self.done

    def _text(self, now: float) -> str:
        elapsed = now - self.began
        if self.scale == 1:
            text = f"{self.label}: {self.done}/{self.total} {self.unit}"
        else:
            text = f"{self.label}: {self.done / self.scale:.2f}/{self.total / self.scale:.2f} {self.unit}"
        if self.counts_tokens:
            text += f", {self.tokens} tokens" + (f" ({self.tokens / elapsed:.1f} tok/s)" if elapsed > 0 else "")
        text += f", {_duration(elapsed)} elapsed"
        made = self.done - self.start
        if 0 < made and self.done < self.total:
            text += f", about {_duration(elapsed / made * (self.total - self.done))} left"
        elif self.done >= self.total:
            text += ", done"
        return text
