"""Benchmark: W4A8 routed experts on each path of the fused MoE kernels at real widths, against the W8A8 experts of
the same values, in the same run on one GPU.

    python -P bench/int4_experts.py --out DIR [--like 35B-A3B,397B-A17B] [--tokens 8,32,64,128,512,4096]
                                    [--layers 2]

For each model's routed-expert widths (hidden, experts, top-k, intermediate) and each token count M, the routed
experts of one MoE layer (no router, no shared expert) on random int4 values with per-channel scales, timed as CUDA
graphs of many calls rotating over --layers layers (more than the L2 holds):
- `int4 matvec`: the matvec kernels reading the packed bytes (forced, whatever the plan's limit);
- `int4 grouped`: the grouped GEMMs reading the packed bytes (forced);
- `int4 grouped, unpacked per call`: what the grouped path did before the int4 grouped GEMM - every expert unpacked
  by PyTorch, then the int8 grouped GEMMs;
- `int8 <plan>`: the same values as W8A8 experts (twice the bytes), on the path the plan picks for them;
- `int4 <plan>`: the path the plan picks for int4 experts (plan.py's limits), and which one that is.
Also the bytes the call must read (the touched experts' weights and scales) over its time, against the copy bandwidth
measured in the same run. Results: DIR/int4_experts.json, one JSON line per row on stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

from npuport.fixtures.int4_experts import random_int4_experts
from npuport.kernels.fused_moe import GROUPED, MATVEC, StackedExperts, plan_experts_triton, route_top_k, run_experts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# the MoE widths, the copy bandwidth and the graph timing of bench/moe.py's layer figures
from bench.moe import MOE_WIDTHS, bench_module, graph_us  # noqa: E402

CUDA = torch.device("cuda")


def touched_bytes(experts: StackedExperts, ids: torch.Tensor) -> int:
    """The bytes of the experts `ids` route to: weights (as stored) and their scales."""
    per_expert = (experts.gate_up[0].numel() + experts.down[0].numel()
                  + 4 * (experts.gate_up_scale[0].numel() + experts.down_scale[0].numel()))
    return int(ids.unique().numel()) * per_expert


def measure(like: str, m: int, layers: list[tuple[StackedExperts, StackedExperts]], copy_bps: float) -> dict:
    hidden, experts, top_k, _, _ = MOE_WIDTHS[like]
    gen = torch.Generator(device="cuda").manual_seed(m)
    calls = []
    for _ in layers:
        x = torch.randn(m, hidden, generator=gen, device="cuda").bfloat16()
        weights, ids = route_top_k(torch.randn(m, experts, generator=gen, device="cuda"), top_k, torch.bfloat16)
        calls.append((x, weights, ids))
    row: dict = {"like": like, "tokens": m, "routed_pairs": m * top_k, "us": {}, "bandwidth_share": {}}

    def timed(name: str, experts_of, plan_of, unpack: bool = False) -> None:
        fns = []
        for (packed, unpacked), (x, weights, ids) in zip(layers, calls, strict=True):
            ex = experts_of(packed, unpacked)
            plan = plan_of(x, ex, ids)
            fns.append(lambda p=plan, x=x, e=ex, w=weights, i=ids:
                       run_experts(p, x, e.unpacked() if unpack else e, w, i))
        row["us"][name] = graph_us(fns, CUDA)
        bytes_ = sum(touched_bytes(experts_of(*layer), ids) for layer, (_, _, ids) in zip(layers, calls, strict=True))
        row["bandwidth_share"][name] = bytes_ / len(layers) / (row["us"][name] / 1e6) / copy_bps

    def int4(packed, unpacked):
        return packed

    def int8(packed, unpacked):
        return unpacked

    def forced(most: int):
        return lambda x, ex, ids: plan_experts_triton(x, ex, ids, matvec_max_pairs=most)

    def planned(x, ex, ids):
        return plan_experts_triton(x, ex, ids)

    timed("int4 matvec", int4, forced(10**9))
    timed("int4 grouped", int4, forced(0))
    timed("int4 grouped, unpacked per call", int4, forced(0), unpack=True)
    x, _, ids = calls[0]
    row["int8_plan"] = plan_experts_triton(x, layers[0][1], ids).path
    row["int4_plan"] = plan_experts_triton(x, layers[0][0], ids).path
    timed(f"int8 {row['int8_plan']}", int8, planned)
    timed(f"int4 {row['int4_plan']} (planned)", int4, planned)
    row["int4_planned_vs_int8_planned"] = row["us"][f"int8 {row['int8_plan']}"] / row["us"][
        f"int4 {row['int4_plan']} (planned)"]
    row["int4_grouped_vs_unpacked_per_call"] = row["us"]["int4 grouped, unpacked per call"] / row["us"]["int4 grouped"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--like", default="35B-A3B,397B-A17B", help=f"Comma list of {', '.join(MOE_WIDTHS)}.")
    parser.add_argument("--tokens", default="8,32,64,128,512,4096")
    parser.add_argument("--layers", type=int, default=2, help="Layers with their own weights to rotate over.")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name(), "paths": [MATVEC, GROUPED], "rows": []}
    result["peaks"] = bench_module("kernels").bench_peaks()
    copy_bps = result["peaks"]["copy_GBps"] * 1e9
    for like in args.like.split(","):
        hidden, experts, _, inter, _ = MOE_WIDTHS[like]
        layers = [random_int4_experts(experts, hidden, inter, torch.Generator(device=CUDA).manual_seed(seed))
                  for seed in range(args.layers)]
        for m in [int(t) for t in args.tokens.split(",")]:
            with torch.no_grad():
                row = measure(like, m, layers, copy_bps)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            (args.out / "int4_experts.json").write_text(json.dumps(result, indent=2) + "\n")
        del layers
        gc.collect()  # the graphs' pools sit in reference cycles
        torch.cuda.empty_cache()
    print(f"copy bandwidth {copy_bps / 1e9:.0f} GB/s")


if __name__ == "__main__":
    main()
