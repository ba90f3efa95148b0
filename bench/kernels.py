"""Benchmark: npuport's Triton kernels against their peers, measured in the same run on one GPU.

    python bench/kernels.py [--out DIR] [--only peaks,recurrent,chunk,w8a8] [--sweep] [--quick]
                            [--ms 32,64,...] [--shapes NxK,...]

- peaks: device-to-device copy bandwidth (bytes read + written), bf16 matmul TFLOP/s (8192^3), int8
  torch._int_mm TOP/s (8192^3): the ceilings the kernels are reported against.
- recurrent: decode / verify, fused_recurrent_gated_delta_rule against fla's fused_recurrent_gated_delta_rule
  (final state only), B x T x HV, H = 16, K = V = 128. Verify (T > 1) runs as in speculative decoding: it
  first replays T pending log entries (a previous step that kept every token, the most work) and logs its own.
- chunk: prefill, chunk_gated_delta_rule against fla's chunk_gated_delta_rule, B = 1, T = 4k..64k.
- w8a8: per-token quantization + int8 GEMM with the fused rescale (what W8A8Linear runs) against BF16
  F.linear, at the 27B shapes, M = 1..16384; --sweep also times candidate GEMM tiles per M (split-K ones
  too); --ms and --shapes (N x K) narrow it down.

Timing: each contestant is captured as a CUDA graph of many calls (launch gaps out, as in a captured decode
step) that rotate over enough input sets to exceed the 60 MB L2, replayed several times; the median per call
is reported. Inputs are random, never zeros. Results go to DIR/kernels.json and a table to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from npuport.devices import timed_graph
from npuport.kernels.gated_delta_rule import (
    ChunkConfig,
    RecurrentConfig,
    VerifyLog,
    chunk_gated_delta_rule_triton,
    chunk_prepare,
    chunk_states,
    fused_recurrent_gated_delta_rule_triton,
    recurrent_config,
)
from npuport.kernels.w8a8 import (
    GPU_CANDIDATES,
    GemmConfig,
    gemm_config,
    gemm_overlaps_quantization,
    int8_matmul_rescale_triton,
    quantize_per_token_int8_triton,
    tuning_key,
    tuning_times,
)

L2_BYTES = 60 * 2**20
H, KD, VD = 16, 128, 128
W8A8_SHAPES = {"qkv/gate_up 5120->34816": (34816, 5120), "down 17408->5120": (5120, 17408),
               "5120->10240": (10240, 5120)}
W8A8_M = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def sets_for(bytes_per_set: int, cap: int = 64) -> int:
    """Input sets to rotate over so that one pass reads well past the L2 (4x)."""
    return max(1, min(cap, math.ceil(4 * L2_BYTES / max(1, bytes_per_set))))


def time_graph(call, n_sets: int, min_calls: int = 24, replays: int = 7) -> float:
    """Median seconds per call(i) (i = input set), from a CUDA graph of calls rotating over the sets."""
    calls = max(min_calls, n_sets)

    def every_call():
        for j in range(calls):
            call(j % n_sets)

    replay_ms = timed_graph(every_call, torch.device("cuda"), calls=1)
    return statistics.median(replay_ms() for _ in range(replays)) / calls / 1e3


def time_eager(fn, reps: int = 10) -> float:
    """Median seconds per fn() (for long kernels, where launch gaps do not matter)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------- peaks

def bench_peaks() -> dict:
    n = 2**30  # 2 GiB of bf16 each way
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = time_eager(lambda: dst.copy_(src), reps=10)
    copy_gbs = 2 * n * 2 / t / 1e9
    src = dst = None
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    t = time_eager(lambda: a @ b, reps=10)
    bf16_tflops = 2 * 8192**3 / t / 1e12
    ai, bi = (torch.randint(-128, 128, (8192, 8192), device="cuda", dtype=torch.int8) for _ in range(2))
    bt = bi.t()
    t = time_eager(lambda: torch._int_mm(ai, bt), reps=10)
    int8_tops = 2 * 8192**3 / t / 1e12
    return {"copy_GBps": copy_gbs, "bf16_TFLOPs": bf16_tflops, "int8_TOPs": int8_tops}


# ------------------------------------------------------------------------------------------------- recurrent

def recurrent_inputs(b: int, t: int, hv: int, n_sets: int):
    """n_sets of (q, k, v, g, beta, state, log): bf16 activations, an fp32 state [B, HV, K, V]; for T > 1 a
    VerifyLog whose T pending entries (unit keys, decays, writes) a previous verify step kept."""
    sets = []
    for _ in range(n_sets):
        q = torch.randn(b, t, H, KD, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, t, H, KD, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, t, hv, VD, device="cuda", dtype=torch.bfloat16)
        g = -torch.rand(b, t, hv, device="cuda") * 0.5
        beta = torch.rand(b, t, hv, device="cuda")
        state = torch.randn(b, hv, KD, VD, device="cuda") * 0.1
        log = None
        if t > 1:
            log = VerifyLog.empty(b, t, H, hv, KD, VD, torch.float32, torch.device("cuda"))
            log.keys.copy_(torch.nn.functional.normalize(torch.randn_like(log.keys), dim=-1))
            log.log_decay.copy_(-torch.rand_like(log.log_decay) * 0.5)
            log.writes.copy_(torch.randn_like(log.writes) * 0.1)
            log.pending.fill_(t)
        sets.append((q, k, v, g, beta, state, log))
    return sets


def bench_recurrent(fla, batches, tokens, heads, configs=None) -> list[dict]:
    rows = []
    for hv in heads:
        for b in batches:
            for t in tokens:
                state_bytes = b * hv * KD * VD * 4
                n_sets = sets_for(2 * state_bytes, cap=16)
                sets = recurrent_inputs(b, t, hv, n_sets)

                def ours(i, cfg=None, sets=sets):
                    q, k, v, g, beta, state, log = sets[i]
                    fused_recurrent_gated_delta_rule_triton(q, k, v, g, beta, state, log, config=cfg)

                def peer(i, sets=sets):
                    q, k, v, g, beta, state, _ = sets[i]
                    fla(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)

                row = {"HV": hv, "B": b, "T": t, "ours_us": time_graph(ours, n_sets) * 1e6}
                row["fla_us"] = time_graph(peer, n_sets) * 1e6 if fla else None
                # bytes: the state read and written once, q/k/v/o bf16, and for verify the log entries
                # (T replayed, T recorded: keys, decay and writes in fp32)
                log_bytes = 0 if t == 1 else 2 * b * t * (H * KD + hv + hv * VD) * 4
                moved = 2 * state_bytes + b * t * (2 * H * KD + 2 * hv * VD) * 2 + log_bytes
                row["ours_GBps"] = moved / row["ours_us"] / 1e3
                cfg = recurrent_config(b * hv, t)
                row["config"] = str(cfg)
                for alt in configs or []:
                    if alt != cfg:
                        us = time_graph(lambda i, c=alt: ours(i, c), n_sets) * 1e6
                        row[str(alt)] = us
                rows.append(row)
                print(f"recurrent HV={hv} B={b:3d} T={t}: ours {row['ours_us']:7.1f} us"
                      + (f"  fla {row['fla_us']:7.1f} us  x{row['fla_us'] / row['ours_us']:.2f}" if fla else "")
                      + f"  {row['ours_GBps']:.0f} GB/s", flush=True)
    return rows


def check_recurrent(fla) -> dict:
    """Real sizes, a verify step of 4 after one whose requests kept 0..4 tokens: the Triton kernel against
    the fp32 reference on the same bf16 inputs and log (outputs, and the state after all 4 tokens), and fla
    from the same committed state."""
    from npuport.kernels.gated_delta_rule import fused_recurrent_gated_delta_rule_reference as ref
    from npuport.kernels.gated_delta_rule import replay_pending

    out = {}
    for hv in (32, 48, 64):
        (q, k, v, g, beta, state, log), = recurrent_inputs(8, 4, hv, 1)
        log.pending.copy_(torch.randint(0, 5, (8,), device="cuda"))
        committed = replay_pending(state, log)
        s_ours, s_ref, log_ours, log_ref = state.clone(), state.clone(), log.clone(), log.clone()
        o = fused_recurrent_gated_delta_rule_triton(q, k, v, g, beta, s_ours, log_ours)
        o_ref = ref(q.float(), k.float(), v.float(), g, beta, s_ref, log_ref)
        for one in (log_ours, log_ref):
            one.keep(torch.full((8,), 4, device="cuda"))
        final_ours, final_ref = replay_pending(s_ours, log_ours), replay_pending(s_ref, log_ref)
        res = {"o_max_abs": (o.float() - o_ref).abs().max().item(), "o_ref_max": o_ref.abs().max().item(),
               "state_max_abs": (final_ours - final_ref).abs().max().item(),
               "state_ref_max": final_ref.abs().max().item()}
        if fla:
            o_fla, s_fla = fla(q, k, v, g=g, beta=beta, initial_state=committed.clone(), output_final_state=True,
                               use_qk_l2norm_in_kernel=True)
            res["fla_o_max_abs"] = (o_fla.float() - o_ref).abs().max().item()
            res["fla_state_max_abs"] = (s_fla - final_ref).abs().max().item()
        out[f"HV={hv}"] = res
        print("check recurrent", hv, res, flush=True)
    return out


# ------------------------------------------------------------------------------------------------- chunk

def chunk_inputs(b: int, t: int, hv: int):
    q = torch.randn(b, t, H, KD, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, t, H, KD, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, t, hv, VD, device="cuda", dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn(b, t, hv, device="cuda")) * 0.2
    beta = torch.rand(b, t, hv, device="cuda")
    h0 = torch.randn(b, hv, KD, VD, device="cuda") * 0.1
    return q, k, v, g, beta, h0


def bench_chunk(fla, lengths, heads, configs=None) -> list[dict]:
    rows = []
    for hv in heads:
        for t in lengths:
            q, k, v, g, beta, h0 = inputs = chunk_inputs(1, t, hv)
            row = {"HV": hv, "T": t}
            row["ours_ms"] = time_eager(lambda x=inputs: chunk_gated_delta_rule_triton(*x)) * 1e3
            if fla:
                row["fla_ms"] = time_eager(lambda x=inputs: fla(*x[:3], g=x[3], beta=x[4], initial_state=x[5],
                                                                output_final_state=True,
                                                                use_qk_l2norm_in_kernel=True)) * 1e3
            parts = chunk_prepare(q, k, v, g, beta)
            row["prepare_ms"] = time_eager(lambda x=inputs: chunk_prepare(*x[:5])) * 1e3
            row["states_ms"] = time_eager(lambda x=inputs, pa=parts: chunk_states(pa, x[5])) * 1e3
            for cfg in configs or []:
                row[str(cfg)] = time_eager(lambda c=cfg, x=inputs: chunk_gated_delta_rule_triton(*x, config=c)) * 1e3
            row["ours_Mtok_s"] = t / row["ours_ms"] / 1e3
            rows.append(row)
            print(f"chunk HV={hv} T={t}: ours {row['ours_ms']:.3f} ms (prepare {row['prepare_ms']:.3f}, "
                  f"states {row['states_ms']:.3f})"
                  + (f"  fla {row['fla_ms']:.3f} ms  ours/fla speed x{row['fla_ms'] / row['ours_ms']:.2f}"
                     if fla else ""), flush=True)
    return rows


def check_chunk(fla) -> dict:
    from npuport.kernels.gated_delta_rule import chunk_gated_delta_rule_reference as ref

    out = {}
    for hv in (32, 48, 64):
        q, k, v, g, beta, h0 = chunk_inputs(2, 2048, hv)
        o, s = chunk_gated_delta_rule_triton(q, k, v, g, beta, h0)
        o_ref, s_ref = ref(q.float(), k.float(), v.float(), g, beta, h0)

        def rel(a, b):
            return ((a.float() - b).norm() / b.norm()).item()

        res = {"o_rel": rel(o, o_ref), "state_rel": rel(s, s_ref), "o_max_abs": (o.float() - o_ref).abs().max().item()}
        if fla:
            o_fla, s_fla = fla(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                               use_qk_l2norm_in_kernel=True)
            res["fla_o_rel"], res["fla_state_rel"] = rel(o_fla, o_ref), rel(s_fla, s_ref)
        out[f"HV={hv}"] = res
        print("check chunk", hv, res, flush=True)
    return out


# ------------------------------------------------------------------------------------------------- w8a8

# Tiles (bm, bn, bk, warps, stages) whose split-K variants the sweep times, and the splits.
SWEEP_SPLIT_TILES = [(16, 64, 256, 4, 4), (16, 32, 512, 4, 4), (32, 64, 256, 4, 4), (64, 64, 256, 4, 4),
                     (64, 128, 128, 4, 4), (128, 128, 128, 8, 3), (128, 128, 256, 8, 3)]
SWEEP_SPLITS = (2, 3, 4, 8)
# Split-K is for M up to this (the GPU_CANDIDATES ranges that list it): beyond, the workspace pass only costs.
SWEEP_SPLIT_MAX_M = 2048


def sweep_configs() -> list[GemmConfig]:
    """Every tile of GPU_CANDIDATES, then split-K variants of SWEEP_SPLIT_TILES, each once."""
    split = [GemmConfig(bm, bn, bk, 8, warps, stages, split_k)
             for bm, bn, bk, warps, stages in SWEEP_SPLIT_TILES for split_k in SWEEP_SPLITS]
    return list(dict.fromkeys([*(c for _, cands in GPU_CANDIDATES for c in cands), *split]))


def w8a8_shapes(spec: str | None) -> dict[str, tuple[int, int]]:
    """--shapes "NxK,..." -> {name: (N, K)}: the W8A8_SHAPES entry of that N x K, or a new one; None: all."""
    if not spec:
        return W8A8_SHAPES
    names = {nk: name for name, nk in W8A8_SHAPES.items()}
    shapes = {}
    for item in spec.split(","):
        n, k = (int(v) for v in item.lower().split("x"))
        shapes[names.get((n, k), f"{n}x{k}")] = (n, k)
    return shapes


def bench_w8a8(ms, sweep: bool, shapes: dict[str, tuple[int, int]] = W8A8_SHAPES) -> list[dict]:
    """Per shape {name: (N, K)} and M in ms: quantize + int8 GEMM (the tiles the first call of the shape picked,
    row["config"]) against BF16 F.linear; with sweep also every sweep_configs() tile, the fastest in
    row["best_config"]."""
    rows = []
    for name, (n, k) in shapes.items():
        n_sets = sets_for(n * k, cap=8)  # int8 weights; bf16 ones are twice that
        w_bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(n_sets)]
        w_q, w_s = [], []
        for w in w_bf16:
            s = w.float().abs().amax(1, keepdim=True) / 127
            w_q.append((w.float() / s).round().clamp(-128, 127).to(torch.int8))
            w_s.append(s)
        for m in ms:
            x = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(min(n_sets, 2))]

            def ours(i, cfg=None, x=x, w_q=w_q, w_s=w_s):
                xq, xs = quantize_per_token_int8_triton(x[i % len(x)])
                int8_matmul_rescale_triton(xq, xs, w_q[i], w_s[i], torch.bfloat16, cfg)

            def bf16(i, x=x, w_bf16=w_bf16):
                F.linear(x[i % len(x)], w_bf16[i])

            min_calls = 24 if m <= 1024 else 6
            row = {"shape": name, "N": n, "K": k, "M": m}
            row["bf16_us"] = time_graph(bf16, n_sets, min_calls) * 1e6
            row["w8a8_us"] = time_graph(ours, n_sets, min_calls) * 1e6
            cfg = gemm_config(m, n, k, torch.device("cuda"))  # what the first call picked
            row["config"] = str(cfg)
            row["overlap"] = gemm_overlaps_quantization(m, torch.device("cuda"))  # GEMM started during quantization
            row["tuning_ms"] = {str(c): t for c, t in tuning_times.get(tuning_key(m, n, k, torch.device("cuda")), [])}
            row["speedup"] = row["bf16_us"] / row["w8a8_us"]
            flops = 2 * m * n * k
            row["w8a8_TOPs"] = flops / row["w8a8_us"] / 1e6
            row["w8a8_GBps"] = (n * k + m * k * 3 + m * n * 2) / row["w8a8_us"] / 1e3
            row["bf16_TFLOPs"] = flops / row["bf16_us"] / 1e6
            if sweep:
                best = (row["w8a8_us"], str(cfg))
                for c in sweep_configs():
                    if c == cfg or c.bm > max(16, 4 * m) or (c.split_k > 1 and m > SWEEP_SPLIT_MAX_M):
                        continue
                    try:
                        us = time_graph(lambda i, c=c: ours(i, c), n_sets, min_calls) * 1e6
                    except Exception as e:  # noqa: BLE001 - a config that does not compile is just skipped
                        print("  sweep", c, "failed:", repr(e)[:200], flush=True)
                        continue
                    row.setdefault("sweep", {})[str(c)] = us
                    best = min(best, (us, str(c)))
                row["best_us"], row["best_config"] = best
            rows.append(row)
            print(f"w8a8 {name} M={m:5d}: bf16 {row['bf16_us']:9.1f} us  w8a8 {row['w8a8_us']:9.1f} us  "
                  f"x{row['speedup']:.2f}  {row['w8a8_TOPs']:.0f} TOP/s {row['w8a8_GBps']:.0f} GB/s  {cfg}"
                  + ("  overlapped" if row["overlap"] else "")
                  + (f"  best {row['best_us']:.1f} {row['best_config']}" if sweep else ""), flush=True)
    return rows


# A split-K config the check also runs: K tiles of 256 split 3 ways unevenly at every W8A8 shape.
CHECK_SPLIT = GemmConfig(64, 64, 256, split_k=3)


def check_w8a8() -> dict:
    """Real sizes: the quantization and the GEMM (the tuned tiles, and CHECK_SPLIT) against the references."""
    from npuport.kernels.w8a8 import int8_matmul_rescale_reference, quantize_per_token_int8_reference

    out = {}
    for name, (n, k) in W8A8_SHAPES.items():
        for m in (1, 13, 100, 1000):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
            xq, xs = quantize_per_token_int8_triton(x)
            xq_ref, xs_ref = quantize_per_token_int8_reference(x)
            w_q = torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8)
            w_s = torch.rand(n, 1, device="cuda") / 100
            y = int8_matmul_rescale_triton(xq_ref, xs_ref, w_q, w_s, torch.bfloat16)
            y_ref = int8_matmul_rescale_reference(xq_ref, xs_ref, w_q, w_s, torch.bfloat16)
            y_split = int8_matmul_rescale_triton(xq_ref, xs_ref, w_q, w_s, torch.bfloat16, CHECK_SPLIT)
            res = {"quant_mismatches": int((xq != xq_ref).sum()), "scale_equal": bool(torch.equal(xs, xs_ref)),
                   "gemm_bf16_mismatches": int((y != y_ref).sum()),
                   "gemm_max_abs": (y.float() - y_ref.float()).abs().max().item(),
                   "gemm_split_k_bf16_mismatches": int((y_split != y_ref).sum())}
            out[f"{name} M={m}"] = res
            print("check w8a8", name, m, res, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(".bench"))
    ap.add_argument("--only", default="checks,peaks,recurrent,chunk,w8a8")
    ap.add_argument("--sweep", action="store_true", help="also time alternative tiles / blocks")
    ap.add_argument("--quick", action="store_true", help="fewer sizes")
    ap.add_argument("--ms", help="w8a8: comma list of M (default: all of W8A8_M, fewer with --quick)")
    ap.add_argument("--shapes", help="w8a8: comma list of NxK, e.g. 5120x17408,10240x5120 (default: W8A8_SHAPES)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    except ImportError as e:
        print("fla not importable, peers skipped:", e, file=sys.stderr)
        fla_chunk = fla_recurrent = None
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    results["triton"] = triton.__version__
    path = args.out / "kernels.json"

    def save():
        path.write_text(json.dumps(results, indent=1))

    t0 = time.time()

    def section(name, fn):
        """Run one part; a failure is recorded and the next part still runs."""
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            results[name] = {"error": repr(e)[:2000]}
        save()

    if "checks" in only:
        section("check_recurrent", lambda: check_recurrent(fla_recurrent))
        section("check_chunk", lambda: check_chunk(fla_chunk))
        section("check_w8a8", check_w8a8)
    if "peaks" in only:
        section("peaks", bench_peaks)
        print("peaks", results["peaks"], flush=True)
    if "recurrent" in only:
        batches = [1, 8, 32, 128] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128]
        tokens = [1, 4] if args.quick else [1, 2, 3, 4]
        alts = [RecurrentConfig(16, 1, one_pass=False), RecurrentConfig(16, 1, one_pass=True), RecurrentConfig(32, 2),
                RecurrentConfig(8, 1)] if args.sweep else None
        section("recurrent", lambda: bench_recurrent(fla_recurrent, batches, tokens, [32, 48], alts))
    if "chunk" in only:
        lengths = [4096, 16384] if args.quick else [4096, 16384, 65536]
        alts = [ChunkConfig(32, 4, 2, 8), ChunkConfig(32, 4, 3, 4), ChunkConfig(64, 8, 3, 4), ChunkConfig(16, 4, 2, 4),
                ChunkConfig(64, 4, 2, 4)] if args.sweep else None
        section("chunk", lambda: bench_chunk(fla_chunk, lengths, [32, 48], alts))
    if "w8a8" in only:
        ms = [1, 16, 64, 256, 1024, 16384] if args.quick else W8A8_M
        ms = [int(m) for m in args.ms.split(",")] if args.ms else ms
        section("w8a8", lambda: bench_w8a8(ms, args.sweep, w8a8_shapes(args.shapes)))
    print(f"done in {time.time() - t0:.0f} s; results in {path}")


if __name__ == "__main__":
    main()
