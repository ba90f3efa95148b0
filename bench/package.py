"""Benchmark: `npuport package` of a "mid" artifact against `cp -r` of the same artifact, in the same run.

    python bench/package.py [--workdir DIR] [--repeats N]

The artifact is made once if absent (`npuport make-tiny --size mid`, then `convert-qwen35 --a8w8`). Both
contestants read it from the page cache (a first copy warms it), each timing ends with os.sync() so both pay
for getting their output onto the disk; before each run the previous output is deleted, dirty pages are
flushed and the disk is left to settle. Copies and packagings alternate in ABBA order; medians are printed.
Packaging runs in this process (package_release); the CLI's start-up time (importing npuport and torch) is
measured apart.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from npuport.release.package import package_release


def timed(run) -> float:
    """Seconds for `run()` plus the os.sync() that puts its output on the disk."""
    os.sync()
    t = time.perf_counter()
    run()
    os.sync()
    return time.perf_counter() - t


def ensure_artifact(workdir: Path) -> Path:
    src, art = workdir / "mid-dense", workdir / "mid-dense-w8a8"
    npuport = [sys.executable, "-m", "npuport.cli"]
    if not src.exists():
        subprocess.run([*npuport, "make-tiny", str(src), "--size", "mid"], check=True)
    if not art.exists():
        subprocess.run([*npuport, "convert-qwen35", "--a8w8", str(src), str(art), "--quiet"], check=True)
    return art


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path(".bench"))
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--settle", type=float, default=2.0, help="Seconds of rest before each timed run.")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    art = ensure_artifact(args.workdir)
    size = sum(p.stat().st_size for p in art.iterdir())
    # Both write to the same path: on this disk, where a run's files land and what was freed there before
    # changes its time more than anything else.
    dst = args.workdir / "package-out"

    def clean() -> None:
        shutil.rmtree(dst, ignore_errors=True)

    def copy() -> None:
        subprocess.run(["cp", "-r", str(art), str(dst)], check=True)

    def package() -> None:
        package_release(art, dst, log=lambda m: None)

    clean()
    copy()  # warm the page cache for both contestants
    times: dict[str, list[float]] = {"cp -r": [], "package": []}
    contestants = [("cp -r", copy), ("package", package)]
    for i in range(args.repeats):
        # ABBA order: a run can be slowed by the one before it, so neither always goes second
        for name, run in contestants if i % 2 == 0 else contestants[::-1]:
            clean()
            os.sync()
            time.sleep(args.settle)
            times[name].append(timed(run))
        print(f"cp -r {times['cp -r'][-1]:.2f} s, package {times['package'][-1]:.2f} s", flush=True)
    copies, packagings = times["cp -r"], times["package"]
    clean()
    help_cmd = [sys.executable, "-c", "import npuport.cli, npuport.release.package"]  # what the CLI imports
    startup = statistics.median(timed(lambda: subprocess.run(help_cmd, check=True, capture_output=True))
                                for _ in range(3))
    cp_s, pkg_s = statistics.median(copies), statistics.median(packagings)
    print(f"artifact {size / 1e9:.2f} GB; medians of {args.repeats}: cp -r {cp_s:.2f} s ({size / cp_s / 1e9:.2f} "
          f"GB/s), package {pkg_s:.2f} s ({size / pkg_s / 1e9:.2f} GB/s), ratio {pkg_s / cp_s:.2f}x; "
          f"CLI start-up {startup:.2f} s")
    print(json.dumps({"artifact_bytes": size, "cp_s": copies, "package_s": packagings, "cp_median_s": cp_s,
                      "package_median_s": pkg_s, "ratio": pkg_s / cp_s, "cli_startup_s": startup}, indent=2))


if __name__ == "__main__":
    main()
