"""Benchmark: one model split over N devices (tensor parallel attention / GDN / MLPs, expert parallel MoE) against the
same model on one device, in the same run: decode and prefill throughput of BF16 and of W8A8 with int8 and with BF16
dispatch, and the token payload each MoE layer puts on the wire per decode step.

    python -P bench/several_devices.py --workdir W --out DIR [--like 122B-A10B] [--layers 4] [--devices 2]
                                       [--batches 1,8,32] [--new-tokens 32] [--device cuda] [--shrink 1]
                                       [--prepare-only]

`make-tiny --like` writes the model at reduced depth with its real widths and converts it to W8A8; each configuration
runs through `npuport.runtime.several_devices.on_devices` - the processes and code paths of `npuport generate --devices
N` - and is timed by runtime/validation/throughput.py's rules (greedy, no stop tokens, fastest of 2 after a warm-up;
steps captured as graphs with their collectives). The full-depth memory arithmetic (weights per device at full depth
against one device's memory) is printed first. --shrink divides every width (a quick run on CPU: `--device cpu --shrink
16`). Results: DIR/several_devices.json (rewritten after every measurement), a JSON line per measurement on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from npuport.convert.converter import convert_qwen35
from npuport.fixtures.tiny_checkpoint import REAL_MODELS, like_spec, make_tiny
from npuport.runtime.dispatch import dispatch
from npuport.runtime.expert_parallel import recording_dispatch
from npuport.runtime.generate import generate
from npuport.runtime.loader import load_model
from npuport.runtime.several_devices import on_devices
from npuport.runtime.validation.throughput import measure_throughput

PROMPT_TOKENS = 512
CONVERT_WORKERS = 8


def full_depth_bytes(like: str) -> dict:
    """Weight bytes of the whole model (all layers) in BF16 and in W8A8 (int8 experts and attention projections,
    the rest BF16, as the default recipe): from its sizes, the MTP head left out."""
    s = REAL_MODELS[like]
    h, layers = s.hidden_size, s.num_hidden_layers
    attention = h * (2 * s.num_attention_heads + 2 * s.num_key_value_heads) * s.head_dim + s.num_attention_heads * \
        s.head_dim * h
    key, value = s.linear_num_key_heads * s.linear_key_head_dim, s.linear_num_value_heads * s.linear_value_head_dim
    gdn = h * (2 * key + 2 * value) + value * h
    experts = s.num_experts * 3 * h * s.moe_intermediate_size
    shared = 3 * h * (s.shared_expert_intermediate_size or s.intermediate_size)
    full_layers, linear_layers = layers // 4, layers - layers // 4
    embed = 2 * s.vocab_size * h * 2
    bf16 = 2 * (full_layers * attention + linear_layers * gdn + layers * (experts + shared)) + embed
    w8a8 = bf16 - layers * experts - full_layers * (attention - s.num_attention_heads * s.head_dim * h)
    return {"bf16_GB": bf16 / 1e9, "w8a8_GB": w8a8 / 1e9}


def timed_configs(path_bf16: str, path_w8a8: str, batches: list[int], new_tokens: int, device: str) -> list[dict]:
    """On rank 0 of however many ranks on_devices started: each configuration's throughput and per-step dispatch
    bytes (this rank's sends)."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 2000, (max(batches), PROMPT_TOKENS), generator=gen).tolist()
    rows = []
    for label, path, dispatches in (("BF16", path_bf16, (None,)), ("W8A8", path_w8a8, (False, True))):
        model = load_model(path, device)
        for bf16 in dispatches:
            name = label if bf16 is None else f"{label}, {'BF16' if bf16 else 'int8'} dispatch"
            with dispatch(bf16=bf16):
                for batch in batches:
                    run = measure_throughput(model, prompts[:batch], new_tokens, label=name, repeats=2)
                    # a prefill, then one eager decode step (a replayed graph records nothing)
                    with recording_dispatch() as records:
                        generate(model, prompts[:batch], 2, graphs=False)
                    step = records[-len(model.layers):] if model.parallel.active else []
                    rows.append({"config": name, "batch": batch, "devices": model.parallel.world,
                                 "ms_per_token": run.time_per_output_token_ms,
                                 "decode_tok_s": run.decode_tokens_per_s, "prefill_tok_s": run.prefill_tokens_per_s,
                                 "rank0_dispatch_bytes_per_step": sum(r.sent_bytes for r in step)})
                    print(json.dumps(rows[-1]), flush=True)
        del model
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--like", default="122B-A10B", choices=[m for m, s in REAL_MODELS.items() if s.num_experts])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shrink", type=int, default=1, help="Divide every width by this (quick CPU runs).")
    parser.add_argument("--prepare-only", action="store_true",
                        help="Write the source and its W8A8 artifact into --workdir and stop (later runs reuse them).")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"like": args.like, "layers": args.layers, "full_depth": full_depth_bytes(args.like), "rows": []}
    if args.device == "cuda":
        result["device"] = torch.cuda.get_device_name()
        result["device_GB"] = torch.cuda.get_device_properties(0).total_memory / 1e9
    print(json.dumps(result), flush=True)
    source, artifact = args.workdir / "source", args.workdir / "artifact"
    if not artifact.exists():  # a workdir that --prepare-only filled is reused
        spec = dataclasses.replace(like_spec(args.like, args.layers), shrink_widths=args.shrink)
        make_tiny(source, spec)
        convert_qwen35(source, artifact, workers=CONVERT_WORKERS, show_progress=False, log=lambda m: None)
    if args.prepare_only:
        return
    batches = [int(b) for b in args.batches.split(",")]
    for devices in (1, args.devices):
        if args.device == "cuda":
            torch.cuda.empty_cache()  # the one-device run's memory, before the ranks start
        start = time.perf_counter()
        rows = on_devices(timed_configs, (str(source), str(artifact), batches, args.new_tokens, args.device),
                          devices, args.device)
        result["rows"] += rows
        result[f"wall_s_{devices}"] = time.perf_counter() - start
        (args.out / "several_devices.json").write_text(json.dumps(result, indent=2) + "\n")
    one = {(r["config"], r["batch"]): r for r in result["rows"] if r["devices"] == 1}
    for r in result["rows"]:
        if r["devices"] > 1 and r["ms_per_token"] and one[(r["config"], r["batch"])]["ms_per_token"]:
            base = one[(r["config"], r["batch"])]
            print(f"{r['config']:<26} batch {r['batch']:>3}: {r['devices']} devices {r['ms_per_token']:.3f} ms/token "
                  f"vs 1 device {base['ms_per_token']:.3f} ({base['ms_per_token'] / r['ms_per_token']:.2f}x); "
                  f"prefill {r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x; dispatch "
                  f"{r['rank0_dispatch_bytes_per_step']} B/step from rank 0")


if __name__ == "__main__":
    main()
