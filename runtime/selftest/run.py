"""`npuport selftest`: every kernel (and, on an NPU, every native operator) against its PyTorch reference on the
device present, timed, then the tiny model's greedy tokens with and without graphs and with MTP. Whatever fails to
compile or disagrees is switched to its reference for the rest of the process (kernels.implementations.fall_back),
never a crash; the result is JSON a user can attach to a bug report."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from npuport import __version__
from npuport.devices import NATIVE_PACKAGE, cann_version, is_cpu, pick_device
from npuport.errors import NpuportError
from npuport.kernels.implementations import (
    NATIVE,
    batch_invariant_calls,
    choices,
    fall_back,
    fallen_back,
    implementation,
)
from npuport.runtime.ranks import TORCHRUN_ENV
from npuport.runtime.selftest.kernel_checks import CaseSpec, kernel_checks
from npuport.runtime.selftest.model_checks import MODEL_RUNS, ModelRun, model_runs
from npuport.runtime.selftest.timing import median_ms, wait_for
from npuport.runtime.selftest.tolerance import native_tolerance

TIMED_CALLS = 5  # per check on an accelerator, after the checked call (which compiles and tunes)
MODEL_TOKENS = 32
QUICK_TIMED_CALLS, QUICK_MODEL_TOKENS = 3, 16
INTERPRETED = "triton (interpreter)"  # the implementation a CPU run checks
TINY_MODEL = "tiny model"  # the `op` of the model checks
NO_TRITON = "not run: triton is not installed"  # how a kernel check skipped for want of triton begins its note
# What installs the triton a CPU run checks the kernels with: the version the `test` extra names.
INSTALL_TRITON = "pip install 'triton>=3.2,<4'"


@dataclass
class CheckResult:
    """One check. max_error and tolerance: one per output of the operator; ms: the median wall-clock milliseconds of
    a call, the device waited for (in the interpreter: of the one checked call); passed None: not run (note says
    why); error: the exception's type and first line where it raised."""

    op: str
    implementation: str
    widths: str
    step: str
    shape: str = ""
    max_error: list[float] = field(default_factory=list)
    tolerance: list[str] = field(default_factory=list)
    ms: float | None = None
    passed: bool | None = None
    error: str | None = None
    note: str | None = None


@dataclass
class SelftestResult:
    """A whole run: where it ran, with what, every check, and the implementation each operator takes afterwards."""

    device: str
    device_name: str
    versions: dict[str, str | None]
    checks: list[CheckResult]
    implementations: dict[str, str]
    fallen_back: dict[str, str]
    seconds: float
    note: str | None = None

    @property
    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if c.passed is False]

    @property
    def passed(self) -> bool:
        return not self.failed

    def to_json(self) -> dict:
        """The result as plain JSON values (an infinite or NaN error as the text 'inf' / 'nan')."""
        data = dataclasses.asdict(self)
        for check in data["checks"]:
            check["max_error"] = [e if math.isfinite(e) else str(e) for e in check["max_error"]]
        return {"npuport_selftest": 1, **data, "passed": self.passed}


def one_line(error: BaseException) -> str:
    """'TypeName: first line of the message'."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def versions() -> dict[str, str | None]:
    """Python, npuport and the installed torch, triton / triton-ascend, torch-npu and CANN (None where absent)."""
    found: dict[str, str | None] = {"python": platform.python_version(), "npuport": __version__}
    for package in ("torch", "triton", "triton-ascend", NATIVE_PACKAGE):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    found["cann"] = cann_version() if found[NATIVE_PACKAGE] else None
    return found


def device_name(device: torch.device) -> str:
    """The accelerator's product name ("NVIDIA H100 80GB HBM3", "Ascend910B3"), or the CPU's."""
    if is_cpu(device):
        return platform.processor() or platform.machine()
    return str(getattr(torch, device.type).get_device_name(device))


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def check_kernel(spec: CaseSpec, device: torch.device, calls: int) -> CheckResult:
    """Run one kernel check; switch its operator to the reference if it raises or disagrees."""
    with batch_invariant_calls(spec.invariant):
        result = _checked(spec, device, calls)
    if result.passed is False:
        fall_back(spec.op, why_failed(result))
    return result


def _checked(spec: CaseSpec, device: torch.device, calls: int) -> CheckResult:
    cpu = is_cpu(device)
    chosen = INTERPRETED if cpu else implementation(spec.op, device)
    result = CheckResult(spec.op, f"{chosen} (batch-invariant)" if spec.invariant else chosen, spec.widths, spec.step)
    if spec.op in fallen_back():
        result.note = f"not run: switched to its reference earlier in this run ({fallen_back()[spec.op]})"
        return result
    if cpu and not triton_importable():
        result.note = f"{NO_TRITON}, so its interpreter cannot run the kernel ({INSTALL_TRITON})"
        return result
    try:
        case = spec.build()
        result.shape = case.shape
        wait_for(device)
        start = time.perf_counter()
        got = case.run()
        wait_for(device)
        result.ms = (time.perf_counter() - start) * 1e3
        want = case.reference()
        if len(got) != len(case.tolerances) or len(want) != len(case.tolerances):
            raise ValueError(f"{len(got)} outputs, {len(want)} from the reference, {len(case.tolerances)} expected")
        tolerances = [native_tolerance(t, g.dtype) if chosen == NATIVE else t
                      for t, g in zip(case.tolerances, got, strict=True)]
        judged = [t.judge(g, w) for t, g, w in zip(tolerances, got, want, strict=True)]
        result.max_error = [error for error, _ in judged]
        result.tolerance = [t.describe() for t in tolerances]
        result.passed = all(ok for _, ok in judged)
        if result.passed and calls:
            result.ms = median_ms(case.run, device, calls)
    except Exception as e:  # noqa: BLE001 - a kernel that fails to compile or launch is a finding, not a crash
        result.passed, result.error = False, one_line(e)
    return result


def why_failed(result: CheckResult) -> str:
    where = f"at {result.widths} {result.step}"
    if result.error is not None:
        return f"{result.implementation} failed {where}: {result.error}"
    worst = ", ".join(f"{e:.3g} ({t})" for e, t in zip(result.max_error, result.tolerance, strict=True))
    return f"{result.implementation} disagrees with its reference {where}: errors {worst}"


def model_check(run: ModelRun) -> CheckResult:
    return CheckResult(TINY_MODEL, "graphs" if run.graphs else "eager", "tiny-trained", run.name, run.shape,
                       [] if run.differing is None else [float(run.differing)],
                       [] if run.differing is None else ["identical tokens"], run.ms, run.passed, note=run.note)


def check_model(device: torch.device, new_tokens: int) -> Iterator[CheckResult]:
    """The tiny model's runs as checks; an exception ends them with one failed check naming it."""
    runs = model_runs(device, new_tokens)
    while True:
        try:
            run = next(runs)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 - a run that raises is a finding
            yield CheckResult(TINY_MODEL, "", "tiny-trained", "generation", passed=False, error=one_line(e))
            return
        yield model_check(run)


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    """Warnings shown as 'warning: MESSAGE', one line each, while the block runs."""
    shown = warnings.formatwarning
    warnings.formatwarning = lambda message, category, *args, **kwargs: f"warning: {message}\n"
    try:
        yield
    finally:
        warnings.formatwarning = shown


def run_selftest(device: torch.device, quick: bool = False, progress: Callable[[str], None] | None = None,
                 model: bool = True) -> SelftestResult:
    """Every kernel check on `device` (quick: fewer shapes), then (model) the tiny model's; progress(line) hears of
    each check as it ends. Operators that fail are switched to their references (one warning line each)."""
    began = time.perf_counter()
    specs = list(kernel_checks(device, quick))
    total = len(specs) + (MODEL_RUNS if model else 0)
    checks: list[CheckResult] = []

    def done(check: CheckResult) -> None:
        checks.append(check)
        if progress is not None:
            progress(progress_line(len(checks), total, check))

    with one_line_warnings():
        for spec in specs:
            done(check_kernel(spec, device, 0 if is_cpu(device) else QUICK_TIMED_CALLS if quick else TIMED_CALLS))
        if model:
            for check in check_model(device, QUICK_MODEL_TOKENS if quick else MODEL_TOKENS):
                done(check)
    return SelftestResult(str(device), device_name(device), versions(), checks, choices(device), fallen_back(),
                          time.perf_counter() - began)


def progress_line(index: int, total: int, check: CheckResult) -> str:
    status = {True: "ok", False: "FAILED", None: "skipped"}[check.passed]
    details = []
    if check.max_error:
        details.append("error " + ", ".join(f"{e:.3g}" for e in check.max_error))
    if check.ms is not None:
        details.append(f"{check.ms:.3f} ms")
    details += [text for text in (check.error, check.note) if text]
    return (f"[{index:>2}/{total}] {check.op:<16} {check.implementation:<20} {check.widths:<12} {check.step:<24} "
            f"{status:<7} {'; '.join(details)}")


def summary(result: SelftestResult) -> str:
    """One line: passed or failed, how many checks passed, were skipped and failed, which operators were switched to
    their references (fell back), and how to get the skipped ones run."""
    passed = sum(c.passed is True for c in result.checks)
    failed = sum(c.passed is False for c in result.checks)
    skipped = [c for c in result.checks if c.passed is None]
    switched = (f"switched to their PyTorch references: {', '.join(result.fallen_back)}" if result.fallen_back
                else "none fell back to its PyTorch reference")
    line = (f"selftest: {'passed' if result.passed else 'FAILED'} on {result.device} ({result.device_name}) in "
            f"{result.seconds:.0f} s: {passed} passed, {len(skipped)} skipped, {failed} failed of "
            f"{len(result.checks)} checks; {switched}")
    others = [c for c in skipped if not (c.note and c.note.startswith(NO_TRITON))]
    if len(skipped) > len(others):
        line += f"; {len(skipped) - len(others)} skipped as triton is not installed: {INSTALL_TRITON} runs them"
    if others:
        shown = [f"{c.op} {c.step} ({(c.note or 'no reason given').removeprefix('not run: ')})" for c in others[:3]]
        more = f", {len(others) - 3} more (the JSON says why)" if len(others) > 3 else ""
        line += f"; also skipped: {', '.join(shown)}{more}"
    return line


def check_out(out: Path) -> None:
    """Refuse, before any check runs, an --out the result could not be written to: a folder (an empty --out names
    the current one), in a folder that does not exist or takes no new file."""
    out = Path(out)
    if out == Path("."):
        raise NpuportError("--out is empty or the current folder; give a file name such as selftest.json")
    if out.is_dir():
        raise NpuportError(f"--out {out}: a folder; give a file name such as {out / 'selftest.json'}")
    parent = out.parent
    if not parent.is_dir():
        raise NpuportError(f"--out {out}: the folder {parent} does not exist")
    try:  # the file is written as write_json_atomically writes it: a temporary file beside it, renamed
        handle, probe = tempfile.mkstemp(dir=parent, prefix=f".{out.name}.", suffix=".tmp")
    except OSError as e:
        raise NpuportError(f"--out {out}: the folder {parent} takes no new file ({e.strerror or e})") from None
    os.close(handle)
    os.unlink(probe)


def write_json_atomically(path: Path, data: dict) -> None:
    """Write `data` as JSON to `path`: complete or not at all (a temporary file beside it, renamed)."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def selftest_command(device: str | None, out: Path, quick: bool, progress: Callable[[str], None]) -> SelftestResult:
    """What `npuport selftest` does: check that `out` can be written, run every check with a progress line each,
    write the JSON to `out`."""
    check_out(out)
    result = run_selftest(pick_device(device), quick, progress)
    write_json_atomically(out, result.to_json())
    return result


def quiet_selftest(device: torch.device | str | None = None) -> SelftestResult:
    """The same checks, quick and silent, before `validate` and `serve` start on an accelerator: nothing is shown
    unless something fails (a warning line for each operator switched to its reference and each failed model
    check, then one naming `npuport selftest`). Nothing runs on the CPU (the runtime runs the references there) nor
    in a torchrun rank (every rank would check at once, before it knows its own device)."""
    device = device if isinstance(device, torch.device) else pick_device(device)
    if is_cpu(device) or all(name in os.environ for name in TORCHRUN_ENV):
        why = "the CPU runs the references" if is_cpu(device) else "a torchrun rank"
        return SelftestResult(str(device), "", {}, [], choices(device), fallen_back(), 0.0, f"not run: {why}")
    result = run_selftest(device, quick=True)
    if not result.passed:
        with one_line_warnings():
            for check in result.failed:
                if check.op == TINY_MODEL:
                    warnings.warn(f"npuport: self-test: the tiny model's {check.step} failed: "
                                  f"{check.error or f'{check.max_error[0]:.0f} tokens differ'}", RuntimeWarning,
                                  stacklevel=2)
            warnings.warn(f"npuport: {summary(result).removeprefix('selftest: ')}; `npuport selftest` writes the "
                          "details", RuntimeWarning, stacklevel=2)
    return result


def implementations_record(device: torch.device) -> dict:
    """For a validation report: op -> the implementation that runs on `device` now, and the operators switched to
    their references in this process with why."""
    return {"implementations": choices(device), "fallen_back": fallen_back()}
