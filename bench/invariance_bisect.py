"""Diagnosis: where a verify step of k + 1 rows first computes a row differently from the decode step that
computes that row alone - the first kernel call of the model whose inputs are the same bits in both and whose
output is not. Batch-invariant steps (runtime/invariance.py) must have none.

    python -P bench/invariance_bisect.py --workdir W --out DIR [--like 35B-A3B] [--layers 4] [--batches 1,8]
        [--drafts 1,3] [--rounds 6] [--kernels invariant|fast]

For each model (a `make-tiny --like` BF16 source and its W8A8 artifact), batch and k: two states are prefilled
with the same prompts, one as plain greedy decoding makes it (no verify log), one as MTP k makes it. Then rounds
of what generate does: the MTP state verifies k + 1 teacher-forced tokens and commits the first a + 1 (a drawn
at random, as if a drafts were accepted); the plain state decodes those a + 1 tokens one step each. Every call
of a kernel function from runtime/model.py's namespace, and the lm_head, is recorded in both; the verify call's
row j is compared with decode step j's call, bit for bit. Results: DIR/invariance_bisect.json and one line per
finding on stdout. Runs on any device; on the GPU it shows what the Triton kernels do.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import npuport.runtime.mixers as mixers_module
import npuport.runtime.model as model_module
from npuport.convert.converter import convert_qwen35
from npuport.fixtures.tiny_checkpoint import TinySpec, like_spec, make_tiny
from npuport.runtime.generate import generate
from npuport.runtime.invariance import batch_invariant
from npuport.runtime.loader import load_model
from npuport.runtime.model import Qwen35
from npuport.runtime.prefill import pad_prompts, prefill
from npuport.runtime.run_options import RunOptions
from npuport.runtime.state import GDNState, commit_accepted
from npuport.runtime.validation.fidelity import greedy_token_agreement

# The kernel functions runtime/model.py calls, each recorded under its name.
RECORDED = ("project", "row_parallel", "add_rms_norm", "rms_norm", "rms_norm_rope", "write_kv", "decode_attention",
            "causal_conv1d_update", "fused_recurrent_gated_delta_rule", "gated_rms_norm", "route_top_k",
            "fused_experts", "float_linear")
LARGEST_RECORDED = 1 << 24  # elements: activations and logits are recorded, the weights passed along are not


@dataclass
class Call:
    name: str
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]


def tensors_in(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value.detach().clone()] if value.numel() <= LARGEST_RECORDED else []
    if isinstance(value, tuple | list):
        return [t for v in value for t in tensors_in(v)]
    if hasattr(value, "__dataclass_fields__"):
        return [t for name in value.__dataclass_fields__ for t in tensors_in(getattr(value, name))]
    return []


@dataclass
class Recorder:
    """Wraps RECORDED in the namespaces of runtime/model.py and runtime/mixers.py (the layers call them there);
    while `calls` is a list, each call is appended to it."""

    calls: list[Call] | None = None
    originals: dict[tuple, Callable] = field(default_factory=dict)

    def install(self) -> None:
        for name in RECORDED:
            modules = [m for m in (model_module, mixers_module) if hasattr(m, name)]
            if not modules:
                raise SystemExit(f"invariance_bisect: no layer module calls {name} any more; update RECORDED")
            for module in modules:
                fn = getattr(module, name)
                self.originals[module.__name__, name] = fn
                setattr(module, name, self.wrap(name, fn))

    def wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            inputs = tensors_in(list(args) + list(kwargs.values())) if self.calls is not None else []
            out = fn(*args, **kwargs)
            if self.calls is not None:
                self.calls.append(Call(name, inputs, tensors_in(out)))
            return out

        return recorded

    def record(self, fn: Callable) -> list[Call]:
        self.calls = []
        try:
            fn()
            return self.calls
        finally:
            self.calls = None


def row_of(verify: torch.Tensor, decode: torch.Tensor, j: int, t: int) -> torch.Tensor | None:
    """Row j of a verify step's tensor in the shape of the decode step's, or None where they do not correspond:
    the first dimension that differs must be t times the decode's (a [B, T, ...] or a flat [B * T, ...] tensor).
    Tensors without such a dimension are not rows of the step (weights, caches of another capacity, positions,
    the GDN states, which the two sides hold differently: compared at each verify step's start)."""
    if verify.shape == decode.shape or verify.dim() != decode.dim():
        return None
    axis = next(a for a in range(verify.dim()) if verify.shape[a] != decode.shape[a])
    if verify.shape[axis] != t * decode.shape[axis] or verify.shape[axis + 1:] != decode.shape[axis + 1:]:
        return None
    split = verify.shape[:axis] + (decode.shape[axis], t) + verify.shape[axis + 1:]
    return verify.reshape(split).select(axis + 1, j)


def same_bits(verify: list[torch.Tensor], decodes: list[list[torch.Tensor]], t: int) -> tuple[bool, float, int]:
    """(every comparable tensor equal bit for bit in every row, the largest difference, tensors compared)."""
    equal, worst, compared = True, 0.0, 0
    for j, decode in enumerate(decodes):
        for v, d in zip(verify, decode, strict=False):
            row = row_of(v, d, j, t)
            if row is None or row.dtype != d.dtype:
                continue
            compared += 1
            if not torch.equal(row, d):
                equal = False
                if row.is_floating_point():
                    worst = max(worst, float((row.double() - d.double()).abs().nan_to_num(float("inf")).max()))
                else:
                    worst = max(worst, float((row != d).sum()))
    return equal, worst, compared


def compare_round(verify: list[Call], decodes: list[list[Call]], t: int) -> list[dict]:
    """One finding per call of the verify step: its name, position, whether its inputs and outputs match."""
    findings = []
    for i, call in enumerate(verify):
        steps = [d[i] for d in decodes]
        if any(s.name != call.name for s in steps):
            raise RuntimeError(f"call {i}: the verify step ran {call.name}, a decode step {[s.name for s in steps]}")
        inputs = same_bits(call.inputs, [s.inputs for s in steps], t)
        outputs = same_bits(call.outputs, [s.outputs for s in steps], t)
        findings.append({"call": i, "name": call.name, "inputs_equal": inputs[0], "outputs_equal": outputs[0],
                         "output_max_diff": outputs[1], "outputs_compared": outputs[2]})
    return findings


def bisect(model: Qwen35, recorder: Recorder, prompts: list[list[int]], k: int, rounds: int, invariant: bool,
           seed: int) -> dict:
    batch, device = len(prompts), model.device
    tokens, lengths = pad_prompts(prompts, device)
    capacity = tokens.shape[1] + rounds * (k + 1) + 8
    plain, spec = model.new_state(batch, capacity), model.new_state(batch, capacity, k)
    prefills = [prefill(model, state, tokens, lengths) for state in (plain, spec)]
    gen = torch.Generator().manual_seed(seed)
    rows = RunOptions(invariant=invariant).planned_rows(batch)
    result = {"batch": batch, "k": k, "prefill_equal": torch.equal(*prefills), "rounds": []}

    def step(state, tok):
        hidden = model.step(tok, state)
        recorder.calls.append(Call("lm_head", [hidden.clone()], [model.logits(hidden)]))

    with batch_invariant(rows):
        for r in range(rounds):
            toks = torch.randint(0, 2000, (batch, k + 1), generator=gen).to(device)
            kept = int(torch.randint(0, k + 1, (1,), generator=gen)) + 1
            plain_states = [layer.recurrent.clone() for layer in plain.layers if isinstance(layer, GDNState)]
            verify = recorder.record(lambda: step(spec, toks))  # noqa: B023 - called at once
            replayed = [torch.equal(p, s.recurrent) for p, s in
                        zip(plain_states, (x for x in spec.layers if isinstance(x, GDNState)), strict=True)]
            commit_accepted(spec, torch.full((batch,), kept, device=device), k + 1)
            decodes = []
            for j in range(kept):
                decodes.append(recorder.record(lambda: step(plain, toks[:, j : j + 1])))  # noqa: B023
                commit_accepted(plain, torch.ones(batch, dtype=torch.long, device=device), 1)
            findings = compare_round(verify, decodes, k + 1)
            culprits = [f for f in findings if f["inputs_equal"] and not f["outputs_equal"]]
            first_diff = next((f for f in findings if not (f["inputs_equal"] and f["outputs_equal"])), None)
            result["rounds"].append({"round": r, "kept": kept, "calls": len(findings), "gdn_states_equal": replayed,
                                     "first_difference": first_diff, "culprits": culprits[:8]})
            if culprits:  # later rounds start from states that differ already
                result["findings"] = findings
                break
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--like", default="35B-A3B", help="a make-tiny --like model, or a preset: small, tiny")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--drafts", default="1,3", help="the k values to verify")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--kernels", choices=["invariant", "fast"], default="invariant")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--greedy-check", type=int, default=64,
                        help="also compare generate's MTP output with its plain output over this many tokens (0: no)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    spec = (TinySpec(arch="moe", size=args.like, layers=args.layers) if args.like in ("small", "tiny")
            else like_spec(args.like, args.layers))
    source = make_tiny(args.workdir / "source", spec)
    artifact = convert_qwen35(source, args.workdir / "artifact", show_progress=False, log=lambda m: None).out
    recorder = Recorder()
    recorder.install()
    invariant = args.kernels == "invariant"
    batches, drafts = [int(b) for b in args.batches.split(",")], [int(k) for k in args.drafts.split(",")]
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 2000, (max(batches), 64), generator=gen).tolist()
    result = {"like": args.like, "layers": args.layers, "kernels": args.kernels, "device": str(args.device),
              "runs": []}
    for label, path in (("BF16", source), ("W8A8", artifact)):
        model = load_model(path, args.device, getattr(torch, args.dtype))
        for batch in batches:
            for k in drafts:
                run = {"model": label, **bisect(model, recorder, prompts[:batch], k, args.rounds, invariant, seed=k)}
                if args.greedy_check:
                    plain = generate(model, prompts[:batch], args.greedy_check, invariant=invariant).tokens
                    mtp = generate(model, prompts[:batch], args.greedy_check, mtp=k, invariant=invariant).tokens
                    run["generate_mtp_equals_greedy_share"] = greedy_token_agreement(mtp, plain)
                result["runs"].append(run)
                summary = {key: run[key] for key in ("model", "batch", "k", "prefill_equal")}
                summary["generate_mtp_equals_greedy_share"] = run.get("generate_mtp_equals_greedy_share")
                shown = ("round", "kept", "gdn_states_equal", "first_difference", "culprits")
                summary["rounds"] = [{key: r[key] for key in shown} for r in run["rounds"]]
                print(json.dumps(summary), flush=True)
                (args.out / "invariance_bisect.json").write_text(json.dumps(result, indent=1) + "\n")
        del model


if __name__ == "__main__":
    main()
