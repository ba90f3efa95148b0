"""The serving engines' own loader code run on an artifact, on a CPU: for every tensor, the parameter the engine
loads it into and the quantization method it builds for its layer, or why not (dropped, unknown, dtype mismatch,
garbage, refused with the engine's message). Each engine release runs in a subprocess of its own, with its folder
under .engines/ (tests/engine_loaders/install.sh) first on its path, so that its imports never touch this process.
Test helpers only: not shipped with npuport."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
ENGINES_DIR = ROOT / ".engines"
INSTALL = "bash tests/engine_loaders/install.sh"
# engine release -> the runner script that loads an artifact with it
RUNNERS = {"sglang": "sglang_load.py", "vllm-ascend": "vllm_ascend_load.py"}
# (status, best first when several models of one engine saw one tensor: mtp.* is dropped by the target and loaded
# by the draft)
ORDER = ("dtype-mismatch", "garbage", "unknown", "loaded", "refused", "dropped")
FAILURES = ("dtype-mismatch", "garbage", "unknown", "refused", "dropped")


class EngineMissing(AssertionError):
    """The engine release is not installed here; the message says how to install it."""


@dataclass(frozen=True)
class Verdict:
    tensor: str
    status: str  # loaded | dropped | unknown | dtype-mismatch | garbage | refused
    param: str | None  # the engine's parameter(s) it was written into
    method: str | None  # the quantization method (and scheme) the engine built for that layer
    message: str  # the engine's own words (warning, exception) where there are any


@dataclass(frozen=True)
class EngineRun:
    engine: str  # e.g. "sglang==0.5.23"
    models: dict  # model tag ("target", "mtp-draft") -> the runner's record (error, architecture, tensors, ...)
    verdicts: dict[str, Verdict]
    extra: dict = field(default_factory=dict)  # what the runner records besides the verdicts (models built to compare)

    def failures(self) -> dict[str, Verdict]:
        return {n: v for n, v in self.verdicts.items() if v.status in FAILURES}

    def summary(self, limit: int = 12) -> str:
        lines = [f"{self.engine}: {len(self.failures())} of {len(self.verdicts)} tensors not loaded as written"]
        for tag, model in self.models.items():
            if model.get("error"):
                lines.append(f"  {tag}: {model['error']}")
        for v in list(self.failures().values())[:limit]:
            lines.append(f"  {v.tensor}: {v.status} {v.param or ''} {v.method or ''} {v.message}".rstrip())
        return "\n".join(lines)


def engine_folder(engine: str) -> Path:
    name, _, version = engine.partition("==")
    return ENGINES_DIR / f"{name}-{version}"


def pinned_engines() -> list[str]:
    """Every release the requirement files pin ("sglang==0.5.23", ...)."""
    out = []
    for path in sorted(HERE.glob("requirements-*.txt")):
        name, _, version = path.stem.removeprefix("requirements-").rpartition("-")
        out.append(f"{name}=={version}")
    return out


def run_engine_many(arts: list[Path], engine: str, *, draft_quantization: str | None = "unquant",
                    timeout: float = 900) -> dict[Path, EngineRun]:
    """Load each artifact of `arts` with the engine release `engine` ("sglang==0.5.23", "vllm-ascend==0.23.0"), all in
    one subprocess (the engine imported once). `draft_quantization`: sglang's --speculative-draft-model-quantization
    for the MTP draft (None: the flag unset; vllm-ascend has no such flag: None)."""
    name, _, _ = engine.partition("==")
    folder = engine_folder(engine)
    if not (folder / ".installed").is_file():
        raise EngineMissing(f"{engine} is not installed in {folder.relative_to(ROOT)}; run: {INSTALL}")
    arts = [Path(a).resolve() for a in arts]
    command = [sys.executable, str(HERE / RUNNERS[name]), *map(str, arts)]
    if draft_quantization:
        command += ["--draft-quantization", draft_quantization]
    env = {**os.environ, "PYTHONPATH": str(folder), "PYTHONNOUSERSITE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=HERE)
    if done.returncode != 0 or not done.stdout.strip():
        raise AssertionError(f"{engine} loader harness failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    record = json.loads(done.stdout)
    assert record["version"] == engine.partition("==")[2], f"{folder} holds {record['version']}, not {engine}"
    extra = record.get("extra", {})
    return {art: EngineRun(engine, record["runs"][str(art)], _combine(record["runs"][str(art)]),
                           extra.get(str(art), {})) for art in arts}


def run_engine(art: Path, engine: str, *, draft_quantization: str | None = "unquant",
               timeout: float = 600) -> EngineRun:
    """run_engine_many for one artifact."""
    return run_engine_many([art], engine, draft_quantization=draft_quantization, timeout=timeout)[Path(art).resolve()]


def _combine(models: dict) -> dict[str, Verdict]:
    """One verdict per tensor over the engine's models: a problem in any wins, then a load in any."""
    out: dict[str, Verdict] = {}
    for model in models.values():
        for name, t in model["tensors"].items():
            v = Verdict(name, t["status"], t["param"], t["method"], t["message"])
            if name not in out or ORDER.index(v.status) < ORDER.index(out[name].status):
                out[name] = v
    return out
