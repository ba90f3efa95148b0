"""Throughput of the built-in runtime on a generated checkpoint, with and without MTP, against plain
transformers `generate` on the BF16 source, with the same timing rules (runtime/validation/throughput.py):

    python bench/throughput.py --size mid --workdir .bench/throughput --out throughput.json

makes the checkpoint (`npuport make-tiny --size SIZE`), converts it to W8A8, then times one batch of GSM8K
sglang prompts per batch size: prefill = a call making one token, decode = the rest of a call making
--new-tokens tokens per request (no stop tokens), fastest of --repeats after a warm-up. The JSON is rewritten
after every measurement, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time
from pathlib import Path

import torch

from npuport.benchlog import StepRecorder
from npuport.convert.converter import convert_qwen35
from npuport.devices import pick_device
from npuport.fixtures.tiny_checkpoint import TinySpec, make_tiny
from npuport.runtime.generate import generate
from npuport.runtime.loader import load_model
from npuport.runtime.textgen import load_tokenizer
from npuport.runtime.validation.gsm8k import make_protocol
from npuport.runtime.validation.throughput import measure_throughput, synchronize
from npuport.runtime.validation.validate import describe_device


def transformers_throughput(model, tokenizer, prompts: list[list[int]], new_tokens: int, repeats: int,
                            **generate_options) -> dict:
    """transformers `generate` (greedy, left-padded, exactly new_tokens per request), timed like the runtime;
    generate_options go to generate (e.g. cache_implementation="static", which turns on its auto-compile)."""
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)

    def timed(n: int) -> float:
        synchronize(model.device)
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=pad, **generate_options)
        synchronize(model.device)
        return time.perf_counter() - start

    timed(2)
    prefill_s = min(timed(1) for _ in range(repeats))
    total_s = min(timed(new_tokens) for _ in range(repeats))
    decode_s, batch, steps = total_s - prefill_s, len(prompts), new_tokens - 1
    return {"label": "transformers generate BF16", "mtp": False, "batch_size": batch,
            "prefill_tokens_per_s": sum(map(len, prompts)) / prefill_s, "decode_tokens_per_s": batch * steps / decode_s,
            "time_per_output_token_ms": decode_s / steps * 1000, "output_tokens_per_s": batch * new_tokens / total_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="mid", choices=["tiny", "small", "mid"])
    parser.add_argument("--arch", default="dense", choices=["dense", "moe"])
    parser.add_argument("--workdir", type=Path, required=True, help="A new folder for the checkpoints.")
    parser.add_argument("--out", type=Path, required=True, help="The JSON written.")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--mtp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default=None)
    parser.add_argument("--runs", default="W8A8,BF16,transformers",
                        help="Which of W8A8 (runtime on the artifact), BF16 (runtime on the source), transformers.")
    args = parser.parse_args()

    device = pick_device(args.device)
    result: dict = {"size": args.size, "arch": args.arch, "device": describe_device(device),
                    "new_tokens": args.new_tokens, "repeats": args.repeats, "python": platform.python_version(),
                    "versions": {"torch": torch.__version__}, "steps": {}, "runs": [], "errors": []}

    recorder = StepRecorder(result, args.out)
    step, save = recorder.step, recorder.save

    source = step("make-tiny", make_tiny, args.workdir / "source", TinySpec(arch=args.arch, size=args.size))
    artifact = step("convert", convert_qwen35, source, args.workdir / "artifact", show_progress=False,
                    log=lambda m: None).out
    tokenizer = load_tokenizer(source)
    protocol = make_protocol("sglang")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompts = [tokenizer.encode(p) for p in protocol.prompts(max(sizes))]
    result["prompt_tokens"] = [len(p) for p in prompts]

    def runtime_runs(model, label: str, batch: int) -> None:
        for k in sorted({0, args.mtp}):
            name = label if k == 0 else f"{label} + MTP k={k}"
            run = step(f"{name} batch {batch}", measure_throughput, model, prompts[:batch], args.new_tokens, mtp=k,
                       label=name, repeats=args.repeats)
            if run is not None:
                result["runs"].append({"runtime": "npuport", **dataclasses.asdict(run)})
                print(result["runs"][-1], flush=True)
        if args.mtp and batch == max(sizes):  # acceptance of the MTP head, at the largest batch only
            out = step(f"{label} acceptance batch {batch}", generate, model, prompts[:batch], args.new_tokens,
                       mtp=args.mtp)
            if out is not None:
                stats = out.stats.to_dict()
                result.setdefault("acceptance", {})[f"{label} batch {batch}"] = {
                    k: stats[k] for k in ("k", "mean_accepted_length", "acceptance_rate_per_position")}
                save()

    wanted = args.runs.split(",")
    for label, path in (("W8A8", artifact), ("BF16", source)):
        if label not in wanted:
            continue
        model = step(f"load {label}", load_model, path, device)
        if model is not None:
            for batch in sizes:
                runtime_runs(model, label, batch)
        del model

    def load_transformers():
        import transformers

        result["versions"]["transformers"] = transformers.__version__
        model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).to(device).eval()
        return model

    reference = step("load transformers", load_transformers) if "transformers" in wanted else None
    if reference is not None:
        for batch in sizes:
            run = step(f"transformers batch {batch}", transformers_throughput, reference, tokenizer, prompts[:batch],
                       args.new_tokens, args.repeats)
            if run is not None:
                result["runs"].append({"runtime": "transformers", **run})
                print(result["runs"][-1], flush=True)
    save()


if __name__ == "__main__":
    main()
