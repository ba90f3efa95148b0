"""For the benchmark scripts: run named steps, time them, keep going past a failure, and save the results
JSON after every step (a device call that runs out of time still leaves what it measured)."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


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
