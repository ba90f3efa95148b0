"""Benchmark: the W4A8 weight search (msModelSlim's `ssz`, convert/w4a8.py) per routed-expert projection at real
expert widths, against msModelSlim 26.1.0's own quantizer on the same weights, in the same run, one CPU thread
each; the results are checked equal (integers and scales).

    python -P bench/w4a8_search.py --msmodelslim-python VENV/bin/python [--models 35B-A3B,397B-A17B] [--out FILE]

VENV is a virtual environment with msmodelslim==26.1.0 and torch installed (docs: MSMODELSLIM_ON_CPU.md); the
baseline runs there, in a process of its own, on the weights this script writes (safetensors). Each projection is
random BF16 (normal, std 0.02) of the model's expert shapes: gate or up [I, H], down [H, I]. Printed per shape:
seconds per projection both ways, the ratio, and the CPU-core hours the whole model's routed experts take
(layers x experts x 3 projections) at our speed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from npuport.convert.w4a8 import scale_bias_groups, unpack_int4, w4a8_dynamic  # noqa: E402
from npuport.fixtures.tiny_checkpoint import REAL_MODELS  # noqa: E402

REPEATS = 3

# Runs in msModelSlim's environment: argv = weights file, results file. Times its per-channel ssz quantizer (the
# one its W4A8 recipe's `method: ssz` int4 weights dispatch to) on each weight, fastest of REPEATS.
MSMODELSLIM_SIDE = f"""
import json, sys, time, torch
from safetensors.torch import load_file, save_file
from msmodelslim.core.quantizer.base import AutoWeightQuantizer, QConfig
from msmodelslim.ir.qal import QDType, QStorage
torch.set_num_threads(1)
out, seconds = {{}}, {{}}
for name, w in load_file(sys.argv[1]).items():
    best = None
    for _ in range({REPEATS}):
        q = AutoWeightQuantizer.from_config(QConfig(dtype="int4", scope="per_channel", symmetric=True, method="ssz"))
        q.init_weight(QStorage(QDType.FLOAT, w))
        start = time.perf_counter()
        storage = q.get_q_storage()
        took = time.perf_counter() - start
        best = took if best is None else min(best, took)
    out[name + ".int"] = storage.value.to(torch.int8).contiguous()
    out[name + ".scale"] = q.w_q_param.ext["scale"].float().reshape(-1).contiguous()
    seconds[name] = best
save_file(out, sys.argv[2])
print(json.dumps(seconds))
"""


def expert_shapes(model: str) -> dict[str, tuple[int, int]]:
    sizes = REAL_MODELS[model]
    inter, hidden = sizes.moe_intermediate_size, sizes.hidden_size
    return {f"{model}.gate_proj": (inter, hidden), f"{model}.down_proj": (hidden, inter)}


def ours(weight: torch.Tensor, groups: int) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Fastest of REPEATS: seconds, the integers [N, K] and the scales [N]."""
    best = None
    for _ in range(REPEATS):
        start = time.perf_counter()
        packed, scale, _, _ = w4a8_dynamic(weight, groups)
        took = time.perf_counter() - start
        best = took if best is None else min(best, took)
    return best, unpack_int4(packed), scale.reshape(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--msmodelslim-python", type=Path, required=True)
    parser.add_argument("--models", default="35B-A3B,397B-A17B")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    weights = {name: (torch.randn(shape, generator=g) * 0.02).bfloat16()
               for model in args.models.split(",") for name, shape in expert_shapes(model).items()}
    with tempfile.TemporaryDirectory() as tmp:
        save_file(weights, f"{tmp}/weights.safetensors")
        done = subprocess.run([str(args.msmodelslim_python), "-c", MSMODELSLIM_SIDE, f"{tmp}/weights.safetensors",
                               f"{tmp}/theirs.safetensors"], check=True, capture_output=True, text=True)
        their_seconds = json.loads(done.stdout.strip().splitlines()[-1])
        theirs = load_file(f"{tmp}/theirs.safetensors")
    results = []
    for name, weight in weights.items():
        model = name.split(".")[0]
        seconds, ints, scale = ours(weight, scale_bias_groups(name))
        same = torch.equal(ints, theirs[name + ".int"]) and torch.equal(scale, theirs[name + ".scale"])
        sizes = REAL_MODELS[model]
        projections = sizes.num_hidden_layers * sizes.num_experts * 3
        results.append({"projection": name, "shape": list(weight.shape), "ours_s": round(seconds, 4),
                        "msmodelslim_s": round(their_seconds[name], 4),
                        "speedup": round(their_seconds[name] / seconds, 2), "same_bits": same,
                        "model_core_hours_ours": round(projections * seconds / 3600, 1)})
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    if not all(r["same_bits"] for r in results):
        raise SystemExit("the results differ from msModelSlim's")


if __name__ == "__main__":
    main()
