#!/usr/bin/env bash
# The GPU acceptance runs of issues 40 (W4A8, met in runs AA1-AA3) and 41 (serve, met in runs AB1-AB5), each bounded
# in time, results under $1:
#   bash bench/gpu_acceptance.sh OUT [tests|serve|trace|int4|e2e35|e2e397 ...]   (default: tests serve int4 e2e397)
# - tests:  the GPU tests of continuous batching, decode graphs captured up front, prefill chunks padded into staging
#           graphs, batch-invariant steps and W4A8
#           (the int4 matvec kernels and grouped GEMMs at real widths, greedy MTP == greedy for a W4A8 artifact);
# - serve:  issue 41's acceptance: serve with 32 clients against the engine's batch of 32, 35B-A3B widths, 8 layers,
#           W8A8, MTP off and k = 1, serve's default prefill budget (16,384 tokens a step on a GPU since run AA2)
#           (bench/serve_engine_ratio.py; `graph_captures_timed` should be 0; `prefill_seconds_timed` and
#           `decode_seconds_timed` say where serve's time goes);
# - trace:  the batcher's calls timed in process, directly and behind HTTP (bench/serve_trace.py), same model;
# - int4:   W4A8 experts on each kernel path against W8A8's, 35B-A3B and 397B-A17B widths (bench/int4_experts.py):
#           whether the int4 grouped GEMM beats unpacking per call, and where it overtakes the int4 matvec kernels
#           (plan.py's INT4_MATVEC_PAIRS_PER_EXPERT, set from its run of 2026-12-07);
# - e2e35:  issue 40: W4A8 vs W8A8 vs BF16 decode per token, 35B-A3B widths, 4 layers (bench/moe.py --e2e);
# - e2e397: the same at 397B-A17B widths, 1 layer: a 29 GB source, its artifacts under /dev/shm (a 64 GB disk
#           holds the source and one artifact, not three); on an H100 the source took 29 s and both conversions
#           and the W8A8 and W4A8 timings 112 s (run Z1).
# Checkpoints are made with `make-tiny --like` (random weights at real widths) under $1/models.
set -euo pipefail
out=$(realpath -m "$1"); shift
steps=("${@:-tests serve int4 e2e397}")
mkdir -p "$out/models"
models="$out/models"

make_like() {  # make_like NAME LAYERS DIR [w8a8 DIR]: the checkpoint, and its W8A8 artifact when asked
    python - "$@" <<'EOF'
import sys
from pathlib import Path
from npuport.convert.converter import convert_qwen35
from npuport.fixtures.tiny_checkpoint import like_spec, make_tiny
name, layers, source = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
if not source.exists():
    make_tiny(source, like_spec(name, layers))
if len(sys.argv) > 4 and not Path(sys.argv[4]).exists():
    convert_qwen35(source, Path(sys.argv[4]), show_progress=False, log=lambda m: None, workers=8)
EOF
}

serve_model() {  # the W8A8 artifact the serve runs use: 35B-A3B widths, 8 layers (its source removed)
    make_like 35B-A3B 8 "$models/src35_8" "$models/w8a8_35_8"
    rm -rf "$models/src35_8"
}

for step in ${steps[*]}; do
    case "$step" in
    tests)
        timeout 600 python -m pytest -q -rs tests/test_kernels_on_gpu.py -p no:cacheprovider \
            -k "continuous or captured_up_front or padded or batch_invariant_steps or int4 or w4a8" 2>&1 \
            | tee "$out/gpu_tests.log" ;;
    serve)
        serve_model
        timeout 540 python -P bench/serve_engine_ratio.py --out "$out/serve" --model "$models/w8a8_35_8" \
            --mtp 0,1 --prefill-tokens default --requests-per-client 4 ;;
    trace)
        serve_model
        timeout 280 python -P bench/serve_trace.py --out "$out/trace" --model "$models/w8a8_35_8" \
            --mtp 0,1 --variants before,serve,http-before,http --requests-per-client 4 ;;
    int4)
        timeout 300 python -P bench/int4_experts.py --out "$out/int4" ;;
    e2e35)
        make_like 35B-A3B 4 "$models/src35_4"
        timeout 600 python -P bench/moe.py --out "$out/e2e35" --skip-layer --e2e "$out/e2e35/work" \
            --e2e-source "$models/src35_4" --e2e-like 35B-A3B --e2e-layers 4 --batches 1,8,32 --no-transformers \
            --e2e-recipes qwen3_5_moe_w8a8,qwen3_5_moe_w4a8 --e2e-mtp 0 --e2e-no-long-prefill --new-tokens 32 ;;
    e2e397)
        make_like 397B-A17B 1 "$models/src397_1"
        timeout 500 python -P bench/moe.py --out "$out/e2e397" --skip-layer --e2e /dev/shm/npuport-e2e397 \
            --e2e-source "$models/src397_1" --e2e-like 397B-A17B --e2e-layers 1 --batches 1,8,32 --no-transformers \
            --e2e-recipes qwen3_5_moe_w8a8,qwen3_5_moe_w4a8 --e2e-mtp 0 --e2e-no-long-prefill --new-tokens 32
        rm -rf /dev/shm/npuport-e2e397 ;;
    *)
        echo "gpu_acceptance.sh: unknown step '$step' (tests, serve, trace, int4, e2e35, e2e397)" >&2; exit 2 ;;
    esac
done
