"""Early warning: the kernel suite against the newest releases of torch, triton and transformers.

    python bench/newest_releases.py [--venv DIR] [--all] [--keep]

The tests and the README install the versions in constraints.txt, the ones the suite last passed with. This
script installs the project into a virtual environment of its own (default `.bench/newest-venv`) with no
constraints at all - whatever the package index's newest torch, triton and transformers are - then runs the
tests that depend most on them: every Triton kernel against its reference (interpreted on CPU), the fused
norms, the runtime's kernel dispatch, the batch-invariant steps, and the model against transformers' own
Qwen3.5. `--all` runs the whole suite. It prints the versions it tested and pytest's summary and exits with
pytest's status, so the next break is seen here before a user meets it. Results go into bench/RESULTS.md.

No upper bound in pyproject.toml stops the newest releases, and the machine-wide pip constraint some hosts
set (PIP_CONSTRAINT / pip.conf) is switched off for this environment only, so the newest really is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WATCHED = ("torch", "triton", "transformers")
KERNEL_SUITE = ("tests/test_kernels_*.py", "tests/test_fused_norms.py", "tests/test_runtime_kernels.py",
                "tests/test_batch_invariance.py", "tests/test_runtime_fidelity.py", "tests/test_make_tiny.py")


def unconstrained_env() -> dict[str, str]:
    """The environment with no pip constraint or config file in force."""
    return {**os.environ, "PIP_CONSTRAINT": "", "PIP_CONFIG_FILE": os.devnull}


def run(*args: str | Path, env: dict[str, str] | None = None) -> None:
    print("+", " ".join(map(str, args)), flush=True)
    subprocess.run(list(map(str, args)), check=True, cwd=ROOT, env=env)


def installed_versions(python: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json, sys; "
            f"print(json.dumps({{n: m.version(n) for n in {list(WATCHED)!r}}}))")
    out = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return json.loads(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=ROOT / ".bench" / "newest-venv")
    parser.add_argument("--all", action="store_true", help="run the whole suite, not only the kernel suite")
    parser.add_argument("--keep", action="store_true", help="reuse the environment if it exists (no upgrade)")
    args = parser.parse_args(argv)

    python = args.venv / "bin" / "python"
    if not (args.keep and python.exists()):
        shutil.rmtree(args.venv, ignore_errors=True)
        run(sys.executable, "-m", "venv", args.venv)
        env = unconstrained_env()
        run(python, "-m", "pip", "install", "-q", "--upgrade", "pip", env=env)
        run(python, "-m", "pip", "install", "-q", "--upgrade", *WATCHED, "-e", ".[test]", env=env)
    versions = installed_versions(python)
    print("newest releases under test: " + ", ".join(f"{name} {version}" for name, version in versions.items()),
          flush=True)
    tests = ["tests"] if args.all else sorted(str(p.relative_to(ROOT)) for pattern in KERNEL_SUITE
                                              for p in ROOT.glob(pattern))
    status = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT).returncode
    print("newest releases under test: " + ", ".join(f"{name} {version}" for name, version in versions.items()),
          f"-> pytest exit {status}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
