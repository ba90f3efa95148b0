"""Benchmark: what batch-invariant decode / verify steps cost and whether they keep greedy MTP output equal to greedy
output, on one GPU, at a published model's real widths (`make-tiny --like`, reduced depth, BF16 and W8A8).

    python -P bench/invariance.py --workdir W --out DIR [--like 35B-A3B] [--layers 4] [--batches 1,8]

For each model and batch: decode ms per token with the fast kernels (vendor GEMMs) and with the invariant ones,
plain and MTP k=1 (runtime/validation/throughput.py's rules, fastest of 2); and for 8 random 64-token prompts x
64 new tokens, the share of tokens that MTP k = 1..3 output equals plain greedy output in each mode (random
weights: the drafts are rejected, so every token goes through a verify step of k + 1 rows).
Results: DIR/invariance.json, a JSON line per measurement on stdout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from npuport.convert.converter import convert_qwen35
from npuport.fixtures.tiny_checkpoint import like_spec, make_tiny
from npuport.runtime.generate import generate
from npuport.runtime.loader import load_model
from npuport.runtime.validation.fidelity import greedy_token_agreement
from npuport.runtime.validation.throughput import measure_throughput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--like", default="35B-A3B")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"like": args.like, "layers": args.layers, "device": torch.cuda.get_device_name(), "rows": []}
    source = make_tiny(args.workdir / "source", like_spec(args.like, args.layers))
    artifact = convert_qwen35(source, args.workdir / "artifact", show_progress=False, log=lambda m: None).out
    gen = torch.Generator().manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = torch.randint(0, 2000, (max(batches), 512), generator=gen).tolist()
    checks = torch.randint(0, 2000, (8, 64), generator=gen).tolist()
    for label, path in (("BF16", source), ("W8A8", artifact)):
        model = load_model(path, "cuda")
        for invariant in (False, True):
            mode = "invariant" if invariant else "fast"
            plain = generate(model, checks, 64, invariant=invariant).tokens
            same = {k: greedy_token_agreement(generate(model, checks, 64, mtp=k, invariant=invariant).tokens, plain)
                    for k in (1, 2, 3)}
            row = {"model": label, "kernels": mode, "mtp_equals_greedy_share": same}
            for batch in batches:
                for k in (0, 1):
                    run = measure_throughput(model, prompts[:batch], args.new_tokens, mtp=k, label=label, repeats=2,
                                             invariant=invariant)
                    row[f"b{batch}_mtp{k}_ms_per_token"] = run.time_per_output_token_ms
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            (args.out / "invariance.json").write_text(json.dumps(result, indent=2) + "\n")
        del model
        torch.cuda.empty_cache()
    for label in ("BF16", "W8A8"):
        fast, inv = (next(r for r in result["rows"] if r["model"] == label and r["kernels"] == m)
                     for m in ("fast", "invariant"))
        for key in (k for k in fast if k.endswith("ms_per_token")):
            if fast[key] and inv[key]:
                print(f"{label} {key}: invariant {inv[key]:.3f} vs fast {fast[key]:.3f} ({inv[key] / fast[key]:.2f}x)")


if __name__ == "__main__":
    main()
