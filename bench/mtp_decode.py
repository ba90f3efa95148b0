"""Train a train-tiny preset (`small`: ~100M parameters, dense or MoE) on the GPU, then check and time greedy
decoding with MTP speculative decoding (k = 1..4) against without, at batch 1 and 8, with the acceptance measured:

    python bench/mtp_decode.py --workdir .bench/mtp --out mtp_decode.json --train-seconds 150 [--arch moe] [--w8a8]

Training runs a number of steps that fits --train-seconds, from the time per step of a short calibration
run (its step count is recorded; `npuport train-tiny --size small --arch ARCH --steps N` reproduces the weights).
With --w8a8 the trained model is also converted (`npuport convert-qwen35 --a8w8`) and measured the same way.

For each model, with and without captured graphs: plain greedy output and MTP k = 1..4 greedy output on
--acceptance-prompts GSM8K test prompts (0-shot) x --new-tokens, in each kernel mode (batch-invariant steps -
the default with MTP - and the fast ones): whether MTP output equals plain greedy output of the same mode and the
share of equal tokens, with the acceptance. Timing follows runtime/validation/throughput.py (no stop tokens,
fastest of --repeats after a warm-up), in both modes: the cost of the invariant one. The JSON is rewritten after
every step, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time
import warnings
from pathlib import Path

import torch

from npuport.benchlog import StepRecorder
from npuport.convert.converter import convert_qwen35
from npuport.devices import graphs_supported, pick_device
from npuport.fixtures.tiny_checkpoint import write_metadata
from npuport.fixtures.train_tiny import (
    RECIPES,
    TrainSpec,
    deterministic,
    encode_records,
    new_model,
    token_batches,
    train_model,
    train_tiny,
)
from npuport.runtime.config import ModelConfig
from npuport.runtime.generate import generate
from npuport.runtime.loader import load_model
from npuport.runtime.textgen import load_tokenizer
from npuport.runtime.validation.fidelity import greedy_token_agreement
from npuport.runtime.validation.gsm8k import make_protocol
from npuport.runtime.validation.throughput import measure_throughput, synchronize
from npuport.runtime.validation.validate import describe_device


def seconds_per_step(spec: TrainSpec, device: torch.device, steps: int, workdir: Path) -> float:
    """Time per optimizer step of the preset on `device`, from `steps` steps after two warm-up steps."""
    from tokenizers import Tokenizer

    recipe = dataclasses.replace(spec.recipe, steps=steps + 2)
    folder = workdir / "calibration"
    folder.mkdir(parents=True, exist_ok=True)
    config = ModelConfig.from_dict(write_metadata(folder, spec.checkpoint))
    records, separator = encode_records(Tokenizer.from_file(str(folder / "tokenizer.json")))
    stamps: list[float] = []

    def on_step(step: int, target: float, mtp: float) -> None:
        synchronize(device)
        stamps.append(time.perf_counter())

    with deterministic(device, spec.threads):
        model = new_model(config, spec.seed, device)
        batches = token_batches(records, separator, recipe.batch_size, recipe.seq_len, spec.seed)
        train_model(model, batches, recipe, on_step)
    return (stamps[-1] - stamps[1]) / steps


def same_weights_twice(spec: TrainSpec, device: torch.device, workdir: Path) -> dict:
    """Whether two trainings of `spec` on `device` write byte-identical shards, and the warnings raised meanwhile
    (deterministic mode names there the ops that have no deterministic implementation on the device)."""
    shards = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in ("twice-a", "twice-b"):
            out = train_tiny(workdir / name, spec, str(device), show_progress=False).out
            shards.append({p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))})
    return {"identical": shards[0] == shards[1], "warnings": sorted({str(w.message) for w in caught})}


def measure_model(model, name: str, prompts: list[list[int]], drafts: list[int], args, step, save,
                  result: dict) -> list[list[int]] | None:
    """The acceptance and MTP-equals-greedy figures of one model in both kernel modes and with and without graphs,
    then its throughput in both modes. Returns the plain greedy tokens of the first mode measured (None: failed)."""
    first_plain = None
    for invariant in (True, False):
        mode = "invariant" if invariant else "fast"
        for graphs in (True, False) if graphs_supported(model.device) else (False,):
            key = f"{name} {mode}" + ("" if graphs else " no graphs")
            plain = step(f"{key} k=0", generate, model, prompts, args.new_tokens, invariant=invariant, graphs=graphs)
            if first_plain is None and plain is not None:
                first_plain = plain.tokens
            for k in drafts:
                out = step(f"{key} k={k}", generate, model, prompts, args.new_tokens, mtp=k, invariant=invariant,
                           graphs=graphs)
                if out is None or plain is None:
                    continue
                stats = out.stats.to_dict()
                figures = {f: stats[f] for f in ("k", "mean_accepted_length", "acceptance_rate_per_position")}
                figures["output_equals_plain_greedy"] = out.tokens == plain.tokens
                figures["token_agreement_with_plain_greedy"] = greedy_token_agreement(out.tokens, plain.tokens)
                result["acceptance"][f"{key} k={k}"] = figures
                print(key, figures, flush=True)
                save()
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        for invariant in (False, True):
            for k in [0, *drafts]:
                label = f"{name} {'invariant' if invariant else 'fast'}" + ("" if k == 0 else f" + MTP k={k}")
                run = step(f"{label} batch {batch}", measure_throughput, model, prompts[:batch], args.new_tokens,
                           mtp=k, label=label, repeats=args.repeats, invariant=invariant)
                if run is not None:
                    result["runs"].append(dataclasses.asdict(run))
                    print(result["runs"][-1], flush=True)
                    save()
    return first_plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="A new folder for the checkpoint.")
    parser.add_argument("--out", type=Path, required=True, help="The JSON written.")
    parser.add_argument("--size", default="small", choices=sorted(RECIPES))
    parser.add_argument("--train-seconds", type=float, default=150.0, help="Time budget of the training steps.")
    parser.add_argument("--calibration-steps", type=int, default=6)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--mtp", default="1,2,3,4", help="Draft tokens per round to check and time, besides 0.")
    parser.add_argument("--arch", default="dense", choices=["dense", "moe"])
    parser.add_argument("--w8a8", action="store_true", help="Also convert the trained model and measure the artifact.")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--acceptance-prompts", type=int, default=50)
    parser.add_argument("--device", default=None)
    parser.add_argument("--determinism-steps", type=int, default=3,
                        help="Train this many steps twice at the end and compare the bytes (0: skip).")
    args = parser.parse_args()

    device = pick_device(args.device)
    result: dict = {"size": args.size, "device": describe_device(device), "new_tokens": args.new_tokens,
                    "repeats": args.repeats, "python": platform.python_version(),
                    "versions": {"torch": torch.__version__}, "steps": {}, "runs": [], "acceptance": {},
                    "errors": []}

    recorder = StepRecorder(result, args.out)
    step, save = recorder.step, recorder.save

    args.workdir.mkdir(parents=True, exist_ok=True)
    spec = TrainSpec(size=args.size, arch=args.arch)
    per_step = step("calibrate", seconds_per_step, spec, device, args.calibration_steps, args.workdir)
    steps = min(spec.recipe.steps, max(1, int(args.train_seconds / per_step))) if per_step else spec.recipe.steps
    result["seconds_per_step"], result["train_steps"] = per_step, steps
    spec = dataclasses.replace(spec, steps=steps)
    trained = step("train", train_tiny, args.workdir / "model", spec, str(device), show_progress=False, log=print)
    if trained is None:
        return
    command = f"npuport train-tiny OUT --size {args.size} --arch {args.arch} --steps {steps} --device {device.type}"
    result["training"] = {**dataclasses.asdict(dataclasses.replace(trained, out=str(trained.out))),
                          "recipe": dataclasses.asdict(spec.recipe), "command": command}
    save()

    models = {"BF16": trained.out}
    if args.w8a8:
        artifact = step("convert", convert_qwen35, trained.out, args.workdir / "w8a8", show_progress=False,
                        log=lambda _: None)
        if artifact is not None:
            models["W8A8"] = artifact.out
    tokenizer = load_tokenizer(trained.out)
    prompts = [tokenizer.encode(p) for p in make_protocol("sglang", shots=0).prompts(args.acceptance_prompts)]
    result["prompt_tokens"] = [len(p) for p in prompts]
    drafts = [int(k) for k in args.mtp.split(",")]
    for name, path in models.items():
        model = step(f"load {name}", load_model, path, device)
        if model is not None:
            plain = measure_model(model, name, prompts, drafts, args, step, save, result)
            if name == "BF16" and plain is not None:
                result["sample_text"] = tokenizer.decode(plain[0])
                save()
            del model

    if args.determinism_steps:
        twice = dataclasses.replace(spec, steps=args.determinism_steps)
        result["same_weights_twice"] = step("determinism", same_weights_twice, twice, device, args.workdir)
        save()


if __name__ == "__main__":
    main()
