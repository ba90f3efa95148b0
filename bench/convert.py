"""Benchmark: convert-qwen35 on a "mid" checkpoint against copying the same files (`cp -r`), in the same
run, with the converter's peak resident memory.

    python bench/convert.py [--arch dense|moe] [--workdir DIR] [--workers 1 2]

Both contestants read the source from the page cache (a first copy warms it) and each timing ends with
`sync`, so both pay for getting their output onto the disk; dirty pages are flushed before each run so
one run's writeback does not slow the next. Copies and conversions alternate. Peak RSS is the
converter process's ru_maxrss (a fresh process per run).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path


def measure_rss(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of `cmd`, measured by a wrapper process of its own."""
    wrapper = (
        "import os, resource, subprocess, sys, time; os.sync(); t=time.perf_counter(); "
        "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); os.sync(); "
        "print(time.perf_counter()-t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)"
    )
    out = subprocess.run([sys.executable, "-c", wrapper, *cmd], check=True, capture_output=True, text=True).stdout
    wall, rss = out.split()
    return float(wall), float(rss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=["dense", "moe"], default="dense")
    ap.add_argument("--workdir", type=Path, default=Path(".bench"))
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = args.workdir / f"mid-{args.arch}"
    npuport = [sys.executable, "-m", "npuport.cli"]
    if not src.exists():
        subprocess.run([*npuport, "make-tiny", str(src), "--size", "mid", "--arch", args.arch], check=True)
    size = sum(p.stat().st_size for p in src.iterdir())
    results: dict[str, object] = {"source_bytes": size, "arch": args.arch, "runs": []}
    copy_dst = args.workdir / "copy"
    out = args.workdir / "out"

    def copy() -> float:
        shutil.rmtree(copy_dst, ignore_errors=True)
        t = measure_rss(["cp", "-r", str(src), str(copy_dst)])[0]
        shutil.rmtree(copy_dst, ignore_errors=True)
        return t

    copy()  # warm the page cache for both contestants
    for _ in range(args.repeats):
        t_copy = copy()
        for w in args.workers:
            shutil.rmtree(out, ignore_errors=True)
            cmd = [*npuport, "convert-qwen35", "--a8w8", str(src), str(out), "--quiet", "--workers", str(w)]
            t_conv, rss = measure_rss(cmd)
            results["runs"].append({"workers": w, "convert_s": t_conv, "copy_s": t_copy,
                                    "ratio": t_conv / t_copy, "peak_rss_mb": rss})
            print(f"workers={w}: convert {t_conv:.2f} s, cp -r {t_copy:.2f} s, ratio {t_conv / t_copy:.2f}x, "
                  f"peak RSS {rss:.0f} MB ({size / 1e9:.2f} GB source, {size / t_conv / 1e9:.2f} GB/s)")
    shutil.rmtree(out, ignore_errors=True)
    copies = sorted({r["copy_s"] for r in results["runs"]})
    median_copy = statistics.median(copies)
    for w in args.workers:
        runs = [r for r in results["runs"] if r["workers"] == w]
        t = statistics.median(r["convert_s"] for r in runs)
        rss = max(r["peak_rss_mb"] for r in runs)
        print(f"median over {len(runs)}: workers={w} convert {t:.2f} s vs cp -r {median_copy:.2f} s "
              f"-> {t / median_copy:.2f}x the copy time; peak RSS {rss:.0f} MB")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
