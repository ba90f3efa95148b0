"""Benchmark: the runtime's MoE layer (device routing + fused experts + shared expert) at real Qwen3.5 MoE widths,
against transformers' own MoE block on the same weights (each of its experts implementations) and against the
per-expert loop the runtime ran before, in the same run on one GPU.

    python -P bench/moe.py --out DIR [--like 35B-A3B] [--tokens 1,8,32,512,4096] [--layers 4] [--sweep 1,8,16]
                           [--e2e WORKDIR [--e2e-like 27B] [--e2e-recipes R1,R2] [--batches 1,8,32] [--profile]
                            [--no-transformers]
                            [--skip-eager-experts]]

For each number of tokens M (decode batch 1/8/32: M = batch; prefill: M = prompt tokens) and each contestant,
the time of one MoE layer forward, and for decode sizes the share of the copy bandwidth that the bytes the
layer must read take (router, the experts the routing touched, shared expert), with the copy bandwidth
measured in the same run. Our layers are timed as CUDA graphs of many calls rotating over --layers layers
with their own weights and inputs (more than the 60 MB L2 holds); contestants that cannot be captured run
eagerly, timed with CUDA events (fastest of several rounds). The outputs of ours and of transformers on the
same weights and inputs are compared (BF16: relative L2 error). --sweep times the matvec tiles of the routed
experts. --e2e: whole models (`make-tiny --like` at --e2e-layers layers, converted to W8A8, or with each recipe of
--e2e-recipes: qwen3_5_moe_w4a8 gives W4A8, see INT4_SCALES) through the public generate, decode ms/token per batch
size with and without MTP k=1, prefill of 512 and 4096 tokens, and transformers `generate` on the same BF16
checkpoint; --profile adds GPU time per decode step by kernel and every
kernel in the order it ran (DIR/profile-LABEL.timeline.tsv).
Results: DIR/moe.json (rewritten after every measurement), one JSON line per measurement on stdout.

W4A8 ("w4a8" layers; W4A8 artifacts end to end) gets its int4 weights from min-max scales (INT4_SCALES), not from
msModelSlim's ssz search, whose ~5 s per expert projection on a CPU core would take hours at real widths
(--e2e-ssz runs it anyway): decode time does not depend on the scale values, and the packing, tensors and labels
are the converter's own.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from npuport.convert.quantize import quantize_per_channel_int8
from npuport.convert.recipe import W4A8_DYNAMIC, load_recipe
from npuport.convert.w4a8 import pack_int4
from npuport.devices import timed_graph
from npuport.kernels.fused_moe import (
    MatvecConfig,
    fused_experts_reference,
    matvec_experts,
    plan_experts_triton,
    route_top_k,
    run_experts,
)
from npuport.runtime.config import ModelConfig
from npuport.runtime.model import Experts, MoE, stack_projections
from npuport.runtime.parallel import Parallel


def bench_module(name: str):
    """Another script of bench/ as a module, by path (bench/ stays off the import path: bench/kernels.py would
    hide an installed package of that name)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

# The MoE widths of the published models (QWEN35.md): hidden, experts, top-k, expert and shared intermediate.
MOE_WIDTHS = {"35B-A3B": (2048, 256, 8, 512, 512), "122B-A10B": (3072, 256, 8, 1024, 1024),
              "397B-A17B": (4096, 512, 10, 1024, 1024)}
CALLS = 24
ROUNDS = 5
# How the bench's W4A8 weights get their scales, as the results label them.
INT4_SCALES = ("min-max int4 scales (max |w| / 7 per channel): not msModelSlim's ssz scales, for speed only; decode "
               "time does not depend on scale values")
CONVERT_WORKERS = min(8, os.cpu_count() or 1)  # shards the end-to-end artifacts are written with at once


def transformers_config(like: str):
    from transformers import Qwen3_5MoeTextConfig

    hidden, experts, top_k, inter, shared = MOE_WIDTHS[like]
    return Qwen3_5MoeTextConfig(hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
                                moe_intermediate_size=inter, shared_expert_intermediate_size=shared,
                                num_hidden_layers=1, vocab_size=1024, num_attention_heads=16, num_key_value_heads=2,
                                head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32)


def transformers_block(config, implementation: str, seed: int, device: torch.device):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    config = copy.deepcopy(config)  # the block reads its experts implementation from its config at every call
    config._experts_implementation = implementation
    torch.manual_seed(seed)
    block = Qwen3_5MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return block.to(device=device, dtype=torch.bfloat16).eval()


def int4_min_max(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (int4 values int8 [N, K], scales fp32 [N]): symmetric per channel, scale max |w| / 7 (INT4_SCALES:
    not the ssz search's scales)."""
    scale = (w.float().abs().amax(-1) / 7).clamp(min=2.0**-23)
    return (w.float() / scale[:, None]).round().clamp(-8, 7).to(torch.int8), scale


def our_layer(block, config: ModelConfig, quantized: bool, int4: bool = False) -> MoE:
    """The runtime's MoE with `block`'s weights (W8A8: experts quantized with the converter's math; int4: W4A8
    experts packed as the loader keeps them on a GPU, their scales INT4_SCALES')."""
    layer = MoE(config, "bench", Parallel()).to(device=block.gate.weight.device, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.gate.weight.copy_(block.gate.weight)
        layer.shared_expert_gate.weight.copy_(block.shared_expert_gate.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.shared_expert, name).weight.copy_(getattr(block.shared_expert, name).weight)
        gate_up, down = block.experts.gate_up_proj.data, block.experts.down_proj.data
        stack_projections(layer)  # as the loader leaves it
        if not quantized:
            layer.experts.gate_up_proj.copy_(gate_up)
            layer.experts.down_proj.copy_(down)
            return layer
        e, two_i, h = gate_up.shape
        experts = Experts(e, h, two_i // 2, quantized=True, int4=int4).to(gate_up.device)
        for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
            if int4:  # rows pair within gate and within up: I is even
                q, scale = zip(*(int4_min_max(w[i]) for i in range(e)), strict=True)
                q = [pack_int4(one) for one in q]
            else:
                q, scale, _ = zip(*(quantize_per_channel_int8(w[i]) for i in range(e)), strict=True)
            getattr(experts, name).copy_(torch.stack(q))
            getattr(experts, f"{name}_scale").copy_(torch.stack(scale).reshape(e, -1).float())
        layer.experts = experts
    return layer


def graph_us(fns: list, device: torch.device) -> float:
    """Microseconds per call of a CUDA graph of CALLS calls cycling over fns."""
    turn = iter(range(10**9))
    replay = timed_graph(lambda: fns[next(turn) % len(fns)](), device, CALLS)
    return min(replay() for _ in range(ROUNDS)) * 1000


def eager_us(fns: list) -> float:
    """Microseconds per call run eagerly (launch costs and host syncs included), fastest of ROUNDS rounds."""
    best = float("inf")
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(CALLS):
            fns[i % len(fns)]()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / CALLS)
    return best


def bytes_read(layer: MoE, x: torch.Tensor) -> int:
    """What one forward of `layer` on x [M, H] must read: router, shared expert, the touched experts."""
    with torch.no_grad():
        _, chosen = torch.softmax(layer.gate(x).float(), -1).topk(layer.top_k, dim=-1)
    touched = int(chosen.unique().numel())
    ex = layer.experts
    per_expert = (ex.gate_up_proj[0].numel() + ex.down_proj[0].numel()) * ex.gate_up_proj.element_size()
    if ex.quantized:
        per_expert += (ex.gate_up_proj_scale[0].numel() + ex.down_proj_scale[0].numel()) * 4
    shared = sum(p.numel() * p.element_size() for p in layer.shared_expert.parameters())
    router = layer.gate.weight.numel() * 2 + layer.shared_expert_gate.weight.numel() * 2
    return router + shared + touched * per_expert + 2 * x.numel() * 2


def per_expert_loop(layer: MoE):
    """The runtime before fused experts: routing, then one expert at a time chosen on the host."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.softmax(layer.gate(x).float(), -1).topk(layer.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        routed = fused_experts_reference(x, layer.experts.stacked(), weights, chosen)
        return routed + torch.sigmoid(layer.shared_expert_gate(x)) * layer.shared_expert(x)

    return forward


def breakdown(layers: list[MoE], xs: list[torch.Tensor], device: torch.device) -> dict[str, float]:
    """Graph-timed parts of the BF16 layer: router GEMM + top-k, the routed experts, the shared expert."""
    routes = [route_top_k(layer.gate(x), layer.top_k, x.dtype) for layer, x in zip(layers, xs, strict=True)]
    parts = {
        "router + top-k": [lambda f=layer, x=x: route_top_k(f.gate(x), f.top_k, x.dtype)
                           for layer, x in zip(layers, xs, strict=True)],
        "routed experts": [lambda f=layer, x=x, r=r: f.experts(x, *r) for layer, x, r in zip(layers, xs, routes,
                                                                                           strict=True)],
        "shared expert": [lambda f=layer, x=x: torch.sigmoid(f.shared_expert_gate(x)) * f.shared_expert(x)
                          for layer, x in zip(layers, xs, strict=True)],
    }
    return {name: graph_us(fns, device) for name, fns in parts.items()}


SWEEP = [MatvecConfig(gu, dn, bk, w, s) for gu, dn, bk, w, s in [
    (32, 16, 256, 4, 3), (16, 16, 256, 4, 3), (16, 8, 256, 4, 3), (32, 32, 256, 4, 3), (64, 16, 256, 4, 3),
    (16, 16, 512, 4, 3), (32, 16, 128, 4, 3), (16, 16, 256, 2, 3), (16, 16, 256, 8, 3), (32, 16, 512, 8, 2),
    (8, 8, 512, 4, 3), (16, 8, 512, 2, 4), (16, 4, 512, 4, 3), (8, 4, 512, 4, 3), (4, 4, 512, 4, 3),
    (32, 8, 512, 4, 3), (2, 2, 512, 4, 3)]]


def sweep(ours: dict[str, list[MoE]], device: torch.device, tokens: list[int]) -> list[dict]:
    """The routed experts alone (BF16 and W8A8) at few tokens: each matvec tile config, and the grouped path."""
    rows = []
    for m in tokens:
        for label, layers in ours.items():
            xs = [torch.randn(m, layer.gate.in_features, device=device, dtype=torch.bfloat16) for layer in layers]
            routes = [route_top_k(layer.gate(x), layer.top_k, x.dtype) for layer, x in zip(layers, xs, strict=True)]
            stacked = [layer.experts.stacked() for layer in layers]
            row = {"tokens": m, "experts": label, "us": {}}
            for cfg in [*SWEEP, None]:
                plans = [plan_experts_triton(x, s, r[1], matvec_max_pairs=0) if cfg is None else
                         replace(plan_experts_triton(x, s, r[1], matvec_max_pairs=10**9), matvec=cfg)
                         for x, s, r in zip(xs, stacked, routes, strict=True)]
                fns = [lambda p=p, x=x, s=s, r=r: run_experts(p, x, s, *r)
                       for p, x, s, r in zip(plans, xs, stacked, routes, strict=True)]
                name = "grouped" if cfg is None else (
                    f"bn{cfg.gate_up_bn}/{cfg.down_bn} bk{cfg.bk} w{cfg.num_warps}s{cfg.num_stages}")
                row["us"][name] = graph_us(fns, device)
            rows.append(row)
            print(json.dumps(row), flush=True)
        # the shared expert on its own (BF16 beside W8A8 routed experts, whose layout it does not share)
        layers = ours["bf16"]
        xs = [torch.randn(m, layer.gate.in_features, device=device, dtype=torch.bfloat16) for layer in layers]
        row = {"tokens": m, "experts": "shared alone", "us": {}}
        shared = [layer.shared_expert.as_expert() for layer in layers]
        ids, weight = torch.zeros(m, 1, dtype=torch.int64, device=device), torch.ones_like(xs[0][:, :1])
        for cfg in SWEEP:
            fns = [lambda x=x, e=e, c=cfg, i=ids, w=weight: matvec_experts(x, None, e, i, w, x.dtype, c, add_to=x)
                   for e, x in zip(shared, xs, strict=True)]
            row["us"][f"bn{cfg.gate_up_bn}/{cfg.down_bn} bk{cfg.bk} w{cfg.num_warps}s{cfg.num_stages}"] = graph_us(
                fns, device)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def step_bytes(model, batch: int) -> int:
    """Bytes one decode step of `batch` requests must read at least: every weight but the embedding table, the
    MTP head and the routed experts, plus per MoE layer the experts batch x top_k routings touch (expected
    distinct count for uniform routing; exact at batch 1)."""
    total = 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name.startswith(("mtp.", "embed_tokens")) or ".experts." in name:
            continue
        total += tensor.numel() * tensor.element_size()
    config = model.config
    for layer in model.layers if config.is_moe else ():
        experts = layer.mlp.experts
        per_expert = sum(t[0].numel() * t.element_size() for t in experts.state_dict().values())
        e, picks = config.num_experts, batch * config.num_experts_per_tok
        touched = config.num_experts_per_tok if batch == 1 else e * (1 - (1 - 1 / e) ** picks)
        total += int(touched * per_expert)
    return total


def profile_decode(model, prompts: list[list[int]], path: Path, tokens: int = 17) -> dict:
    """GPU time per decode step by kernel (torch.profiler) against the wall time per step: where a step goes."""
    from torch.profiler import ProfilerActivity, profile

    from npuport.runtime.generate import generate

    generate(model, prompts, tokens)  # graphs captured, kernels compiled
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        generate(model, prompts, tokens)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    path.write_text(table)
    write_timeline(prof, path.with_suffix(".timeline.tsv"))
    # device work: kernels and copies (aten:: operators also report the device time of the kernels they launch)
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0 and not e.key.startswith("aten::")]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    return {"wall_ms_per_token": wall * 1000 / tokens, "gpu_ms_per_token": gpu_us / 1000 / tokens,
            "gpu_launches_per_token": sum(e.count for e in kernels) / tokens}


def write_timeline(prof, path: Path) -> None:
    """Every device event of a profile in the order it ran: start and duration (us), the gap since the previous
    event ended, and the kernel's name - to read one decode step launch by launch."""
    from torch.autograd import DeviceType

    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    lines, previous_end = ["start_us\tdur_us\tgap_us\tname"], None
    for e in events:
        start, end = e.time_range.start, e.time_range.end
        gap = 0.0 if previous_end is None else start - previous_end
        lines.append(f"{start:.1f}\t{end - start:.1f}\t{gap:.1f}\t{e.name[:120]}")
        previous_end = max(end, previous_end or end)
    path.write_text("\n".join(lines) + "\n")


def end_to_end(args, copy_bps: float, save) -> dict:
    """make-tiny --like at reduced depth, converted to W8A8; the runtime (BF16 and W8A8, graphs, with and without
    MTP k=1) and transformers on the same BF16 checkpoint: decode per batch size, prefill of 512 and 4096."""
    import transformers
    transformers_throughput = bench_module("throughput").transformers_throughput  # timed as the runtime is

    from npuport.convert.converter import convert_qwen35
    from npuport.convert.recipe import recipe_path_for
    from npuport.fixtures.tiny_checkpoint import like_spec, make_tiny
    from npuport.runtime.loader import load_model
    from npuport.runtime.validation.throughput import measure_throughput

    like = args.e2e_like or args.like
    out: dict = {"model": like, "layers": args.e2e_layers, "new_tokens": args.new_tokens, "runs": []}
    start = time.perf_counter()
    source = args.e2e_source or make_tiny(args.e2e / "source", like_spec(like, args.e2e_layers))
    out["make_tiny_s"] = time.perf_counter() - start
    artifacts = {}  # label -> artifact folder: one per --e2e-recipes name, or the default recipe's
    for recipe in args.e2e_recipes.split(",") if args.e2e_recipes else [None]:
        start = time.perf_counter()
        int4 = recipe is not None and writes_w4a8(recipe_path_for(recipe))
        label = f"{'W4A8' if int4 else 'W8A8'} {recipe}" if recipe else "W8A8"
        if int4 and not args.e2e_ssz:
            out.setdefault("int4_scales", {})[label] = INT4_SCALES
        with contextlib.nullcontext() if args.e2e_ssz or not int4 else start_scales_only():
            artifacts[label] = convert_qwen35(source, args.e2e / (recipe or "artifact"), show_progress=False,
                                              recipe_path=recipe_path_for(recipe) if recipe else None,
                                              log=lambda m: None, workers=CONVERT_WORKERS).out
        out.setdefault("convert_s", {})[label] = time.perf_counter() - start
    gen = torch.Generator().manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = torch.randint(0, 2000, (max(batches), 512), generator=gen).tolist()
    long_prompt = torch.randint(0, 2000, (1, 4096), generator=gen).tolist()
    for label, path in (*reversed(artifacts.items()), ("BF16", source)):  # the newest format first
        model = load_model(path, "cuda")
        for batch in batches:
            for k in [int(x) for x in args.e2e_mtp.split(",")]:
                run = measure_throughput(model, prompts[:batch], args.new_tokens, mtp=k, label=label, repeats=2)
                record = {"runtime": f"npuport {label}", "batch": batch, "mtp": k,
                          "ms_per_token": run.time_per_output_token_ms, "prefill_tok_s": run.prefill_tokens_per_s}
                if k == 0 and run.time_per_output_token_ms:
                    seconds = run.time_per_output_token_ms / 1000
                    record["step_bytes"] = step_bytes(model, batch)
                    record["bandwidth_share"] = record["step_bytes"] / seconds / copy_bps
                out["runs"].append(record)
                print(record, flush=True)
                save()
        if args.profile:
            short = [prompts[0][:8]]  # a short prompt: the profile is the decode steps
            out.setdefault("profile", {})[label] = profile_decode(model, short, args.out / f"profile-{label}.txt", 33)
        if not args.e2e_no_long_prefill:
            run = measure_throughput(model, long_prompt, 2, label=label, repeats=2)
            out["runs"].append({"runtime": f"npuport {label}", "prefill_4096_tok_s": run.prefill_tokens_per_s})
        del model
        gc.collect()  # the model's graphs and states sit in reference cycles: their memory goes with the collection
        torch.cuda.empty_cache()
    if args.no_transformers:
        return out
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).to("cuda").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    out["fla"] = fla_version()
    moe = bool(reference.config.get_text_config().to_dict().get("num_experts"))
    for experts, options in TRANSFORMERS_SETTINGS:
        if args.skip_eager_experts and moe and not experts:
            continue  # one expert at a time from the host: minutes per batch at real widths, never the best
        if experts and not moe and not options:
            continue  # a dense model has no experts implementation to pick
        setting = ", ".join([f"{experts or 'eager'} experts"] * moe + ["static cache + compile"] * bool(options))
        for module in reference.modules():  # each MoE block reads the implementation from its config at every call
            if moe and hasattr(module, "config"):
                module.config._experts_implementation = experts or "eager"
        for batch in batches:
            name = f"transformers {transformers.__version__} {setting or 'eager'}"
            name += f", fla {out['fla']}" if out["fla"] else ", no fla"
            try:
                run = transformers_throughput(reference, tokenizer, prompts[:batch], args.new_tokens, 2, **options)
            except Exception as e:  # a setting this model or version does not support
                out["runs"].append({"runtime": name, "batch": batch, "failed": f"{type(e).__name__}: {e}"[:300]})
            else:
                out["runs"].append({"runtime": name, "batch": batch, "ms_per_token": run["time_per_output_token_ms"],
                                    "prefill_tok_s": run["prefill_tokens_per_s"]})
            print(out["runs"][-1], flush=True)
            save()
    return out


def writes_w4a8(recipe: Path) -> bool:
    """Whether the recipe asks for W4A8_DYNAMIC layers."""
    return any(rule.scheme == W4A8_DYNAMIC for rule in load_recipe(recipe).rules)


@contextlib.contextmanager
def start_scales_only():
    """Inside the block the converter's W4A8 weights take msModelSlim's start scale - max |W| / 7 per channel in
    BF16, the first step of its ssz search - without the search's refinement rounds (INT4_SCALES): seconds instead of
    hours at real widths. Everything else the converter writes is its own."""
    import npuport.convert.w4a8 as w4a8

    search = w4a8.ssz_scale

    def start_scale(weight: torch.Tensor, **options) -> torch.Tensor:
        return search(weight, **{**options, "iterations": 0})  # over the recipe's rounds, which callers pass

    w4a8.ssz_scale = start_scale
    try:
        yield
    finally:
        w4a8.ssz_scale = search


# transformers settings timed end to end: (experts implementation, None = eager; generate options). A static
# cache turns on generate's auto-compile.
TRANSFORMERS_SETTINGS = (
    (None, {}),
    ("grouped_mm", {}),
    ("grouped_mm", {"cache_implementation": "static"}),
)


def fla_version() -> str | None:
    """The flash-linear-attention version transformers' GDN layers use, None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flash-linear-attention")
    except PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--like", default="35B-A3B", choices=sorted(MOE_WIDTHS))
    parser.add_argument("--tokens", default="1,8,32,512,4096")
    parser.add_argument("--layers", type=int, default=4, help="Layers with their own weights to rotate over.")
    parser.add_argument("--e2e", type=Path, default=None,
                        help="Also whole models: a folder for a `make-tiny --like` checkpoint and its W8A8 artifact.")
    parser.add_argument("--e2e-layers", type=int, default=4)
    parser.add_argument("--e2e-source", type=Path, default=None,
                        help="End to end on this make-tiny --like checkpoint instead of making one (its depth counts).")
    parser.add_argument("--e2e-like", default=None, help="The make-tiny --like model end to end (default: --like).")
    parser.add_argument("--e2e-recipes", default="",
                        help="End to end, one artifact per shipped recipe named (comma-separated, e.g. "
                             "qwen3_5_moe_w8a8,qwen3_5_moe_w4a8); default: the default recipe's.")
    parser.add_argument("--e2e-ssz", action="store_true",
                        help="W4A8 artifacts with msModelSlim's full ssz search (hours at real widths) rather than "
                             "its start scales.")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--e2e-mtp", default="0,1", help="MTP draft counts timed end to end.")
    parser.add_argument("--e2e-no-long-prefill", action="store_true", help="End to end without the 4096 prefill.")
    parser.add_argument("--sweep", default="", help="Token counts at which to sweep the matvec tiles, e.g. 1,8,16")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--skip-layer", action="store_true", help="Only the end-to-end part.")
    parser.add_argument("--no-transformers", action="store_true", help="End to end without the transformers runs.")
    parser.add_argument("--profile", action="store_true", help="Profile batch-1 decode end to end (kernels).")
    parser.add_argument("--skip-eager-experts", action="store_true",
                        help="End to end, leave out transformers' eager experts (its slowest MoE setting).")
    args = parser.parse_args()
    device = torch.device("cuda")
    import transformers

    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"like": args.like, "widths": MOE_WIDTHS[args.like], "device": torch.cuda.get_device_name(),
                    "versions": {"torch": torch.__version__, "transformers": transformers.__version__}, "rows": []}
    result["peaks"] = bench_module("kernels").bench_peaks()  # the ceilings bench/kernels.py reports against
    copy_bps = result["peaks"]["copy_GBps"] * 1e9
    tconfig = transformers_config(args.like)
    config = ModelConfig.from_dict(tconfig.to_dict())
    impls = () if args.skip_layer else ("eager", "grouped_mm", "batched_mm")
    blocks = {impl: [transformers_block(tconfig, impl, seed, device) for seed in range(args.layers)]
              for impl in impls}
    ours = {} if args.skip_layer else {"bf16": [our_layer(b, config, False) for b in blocks["eager"]],
                                       "w8a8": [our_layer(b, config, True) for b in blocks["eager"]],
                                       "w4a8": [our_layer(b, config, True, int4=True) for b in blocks["eager"]]}
    if ours:
        result["int4_scales"] = INT4_SCALES
    if args.sweep:
        result["sweep"] = sweep(ours, device, [int(t) for t in args.sweep.split(",")])
    for m in [] if args.skip_layer else [int(t) for t in args.tokens.split(",")]:
        xs = [torch.randn(m, config.hidden_size, device=device, dtype=torch.bfloat16) for _ in range(args.layers)]
        row: dict = {"tokens": m, "us": {}, "bandwidth_share": {}, "rel_err_vs_transformers": {}}
        with torch.no_grad():
            want = [blocks["eager"][i](xs[i][None])[0] for i in range(args.layers)]
            for label, layers in ours.items():
                fns = [lambda f=layers[i], x=xs[i]: f(x) for i in range(args.layers)]
                got = [f() for f in fns]
                row["rel_err_vs_transformers"][label] = max(
                    ((g.float() - w.float()).norm() / w.float().norm()).item() for g, w in zip(got, want, strict=True))
                row["us"][f"npuport {label} (graph)"] = graph_us(fns, device)
                row["us"][f"npuport {label} (eager)"] = eager_us(fns)
                need = sum(bytes_read(layers[i], xs[i]) for i in range(args.layers)) / args.layers
                row["bandwidth_share"][label] = need / (row["us"][f"npuport {label} (graph)"] / 1e6) / copy_bps
                if m <= 512:
                    loops = [per_expert_loop(layer) for layer in layers]
                    loop = [lambda f=loops[i], x=xs[i]: f(x) for i in range(args.layers)]
                    row["us"][f"per-expert loop {label} (before)"] = eager_us(loop)
            for impl, layers in blocks.items():
                fns = [lambda b=layers[i], x=xs[i]: b(x[None]) for i in range(args.layers)]
                try:
                    row["us"][f"transformers {impl} (eager)"] = eager_us(fns)
                except Exception as e:  # an implementation this torch lacks
                    row["us"][f"transformers {impl} (eager)"] = f"failed: {type(e).__name__}"
                    continue
                try:
                    row["us"][f"transformers {impl} (graph)"] = graph_us(fns, device)
                except Exception as e:  # host syncs: not capturable
                    row["us"][f"transformers {impl} (graph)"] = f"not capturable: {type(e).__name__}"
        if m <= 32:
            row["breakdown_us"] = breakdown(ours["bf16"], xs, device)
        numbers = {k: v for k, v in row["us"].items() if isinstance(v, float) and k.startswith("transformers")}
        best = min(numbers, key=numbers.get) if numbers else None
        if best:
            row["best_transformers"] = best
            for label in ours:
                row[f"speedup_{label}_vs_best_transformers"] = numbers[best] / row["us"][f"npuport {label} (graph)"]
        row["w8a8_vs_bf16"] = row["us"]["npuport bf16 (graph)"] / row["us"]["npuport w8a8 (graph)"]
        row["w4a8_vs_w8a8"] = row["us"]["npuport w8a8 (graph)"] / row["us"]["npuport w4a8 (graph)"]
        result["rows"].append(row)
        (args.out / "moe.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(row), flush=True)
    if args.e2e:
        result["end_to_end"] = end_to_end(args, copy_bps, lambda: (args.out / "moe.json").write_text(
            json.dumps(result, indent=2) + "\n"))
        (args.out / "moe.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"copy bandwidth {copy_bps / 1e9:.0f} GB/s; done at {time.strftime('%H:%M:%S')}")


if __name__ == "__main__":
    main()
