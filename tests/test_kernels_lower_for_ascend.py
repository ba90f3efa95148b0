"""Every Triton kernel through triton-ascend's compiler for an Ascend 910B, no NPU needed: the launches the runtime
makes at the widths of the published Qwen3.5 models (27B dense; 35B-A3B, 122B-A10B, 397B-A17B MoE) and of the tiny
test models - BF16, float32 and W8A8; prefill, decode, verify, batches - recorded as the launchers make them for an
NPU, compiled in a virtual environment of their own (triton-ascend and triton cannot share one) through the TTIR
passes and triton-adapter-opt - the binary stage needs CANN, absent here, and reaching it is the pass mark - and each
launch's on-chip footprint held to the 910B's buffers.

The launches are recorded, not run (kernels/ascend_lowering.py): the launchers pick every tile, flag and option from
shapes, dtypes and the device alone, so a launch that does not run is recorded as one that does; the kernels
themselves would take hours at these widths in Triton's interpreter (the CPU kernel tests run them, at small ones).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from npuport.fixtures.tiny_checkpoint import PRESETS, REAL_MODELS, Sizes  # noqa: E402
from npuport.kernels import ascend_lowering  # noqa: E402
from npuport.kernels.ascend_lowering import (  # noqa: E402
    FOOTPRINTS,
    Launch,
    Lowering,
    launched_as_on_npu,
    launched_kernels,
    npu_footprint,
    recording_launches,
)

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".bench" / "ascend-venv"
# What the compile needs, pinned: triton-ascend (with triton-adapter-opt), torch (npuport's kernel modules and
# triton-ascend import it), pybind11 (triton-ascend's backend imports it).
ASCEND_PACKAGES = {"triton-ascend": "3.2.0", "torch": "2.13.0", "pybind11": "3.1.0"}
# The published models' widths, and the tiny test models' (tiles below the real ones, K not a multiple of the tiles).
# One name per distinct set of widths (Qwen3.6 and 3.8 27B repeat Qwen3.5-27B's, Qwen3.6-35B-A3B Qwen3.5-35B-A3B's).
MODELS = (*{REAL_MODELS[name]: name for name in reversed(REAL_MODELS)}.values(), "tiny")
# A routed-expert stack larger than this (Qwen3.8-2.4T-A95B's is 34 GB) is one expert's weights repeated along a
# zero stride: the launches and their compile see the same shapes, and no memory of that size is asked for.
STACK_BYTES = 1 << 31
MTP_DRAFTS = 3  # a verify step checks the drafts and one more token
KV_CAPACITY = 4096


def installed_versions(python: Path) -> dict[str, str]:
    """The versions of ASCEND_PACKAGES installed for `python` ({} when it cannot say)."""
    if not python.exists():
        return {}
    script = ("import importlib.metadata as m, json, sys; "
              "print(json.dumps({p: m.version(p).split('+')[0] for p in sys.argv[1:]}))")
    found = subprocess.run([str(python), "-c", script, *ASCEND_PACKAGES], capture_output=True, text=True)
    return json.loads(found.stdout) if found.returncode == 0 else {}


@pytest.fixture(scope="module")
def ascend_python() -> Path:
    """The Python of .bench/ascend-venv, made on first use (pip's cache makes it quicker later), reused while its
    versions are ASCEND_PACKAGES'. A failed install fails the test: CI has the package index."""
    python = VENV / "bin" / "python"
    VENV.parent.mkdir(exist_ok=True)
    with open(VENV.parent / "ascend-venv.lock", "w") as lock:  # one maker at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if installed_versions(python) != ASCEND_PACKAGES:
            steps = [[sys.executable, "-m", "venv", "--clear", str(VENV)],
                     [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                      *(f"{p}=={v}" for p, v in ASCEND_PACKAGES.items())]]
            for step in steps:
                done = subprocess.run(step, capture_output=True, text=True, timeout=1200)
                if done.returncode != 0:
                    pytest.fail(f"making {VENV} failed ({' '.join(step[:4])} ...):\n{done.stderr[-3000:]}")
    return python


def linear_shapes(s: Sizes) -> list[tuple[int, int]]:
    """(out, in) of the model's projections as the runtime stacks them."""
    conv_dim = 2 * s.linear_num_key_heads * s.linear_key_head_dim + s.linear_num_value_heads * s.linear_value_head_dim
    value_width = s.linear_num_value_heads * s.linear_value_head_dim
    h = s.hidden_size
    shapes = [(2 * s.num_attention_heads * s.head_dim + 2 * s.num_key_value_heads * s.head_dim, h),
              (h, s.num_attention_heads * s.head_dim), (conv_dim + value_width + 2 * s.linear_num_value_heads, h),
              (conv_dim + value_width, h), (2 * s.linear_num_value_heads, h),
              (h, value_width), (h, 2 * h)]  # attention qkv, o_proj; GDN in_proj (whole, or as the qkv+z and b+a
    # pairs of an artifact whose recipe quantized in_proj_qkv / in_proj_z, msModelSlim's Qwen3.6), out_proj; MTP fc
    if s.num_experts:
        return [*shapes, (2 * s.shared_expert_intermediate_size, h), (h, s.shared_expert_intermediate_size)]
    return [*shapes, (2 * s.intermediate_size, h), (h, s.intermediate_size)]


def empty(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def attention_step(s: Sizes, dtype: torch.dtype, b: int, t: int, plan_tokens: int | None) -> None:
    from npuport.kernels.decode_attention import decode_attention
    from npuport.kernels.kv_write import write_kv
    from npuport.kernels.rope import rms_norm_rope

    hq, hkv, d = s.num_attention_heads, s.num_key_value_heads, s.head_dim
    q_gate = empty(b, t, hq, 2 * d, dtype=dtype)
    q, gate = q_gate.chunk(2, dim=-1)
    rot = d // 4
    cos, sin = empty(b, t, rot, dtype=dtype), empty(b, t, rot, dtype=dtype)
    q = rms_norm_rope(q, empty(d, dtype=dtype), 1e-6, cos, sin)
    k = rms_norm_rope(empty(b, t, hkv, d, dtype=dtype), empty(d, dtype=dtype), 1e-6, cos, sin)
    cache_k, cache_v = empty(b, KV_CAPACITY, hkv, d, dtype=dtype), empty(b, KV_CAPACITY, hkv, d, dtype=dtype)
    start = torch.zeros(b, dtype=torch.long)
    write_kv(cache_k, cache_v, start, k, empty(b, t, hkv, d, dtype=dtype))
    decode_attention(q, cache_k, cache_v, start, gate, plan_tokens)


def gdn_step(s: Sizes, dtype: torch.dtype, b: int, t: int, prefill: bool, plan_tokens: int | None) -> None:
    from npuport.kernels.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
    from npuport.kernels.gated_delta_rule import VerifyLog, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from npuport.kernels.gated_rms_norm import gated_rms_norm
    from npuport.kernels.gdn_gating import fused_gdn_gating

    h, hv, kd, vd = s.linear_num_key_heads, s.linear_num_value_heads, s.linear_key_head_dim, s.linear_value_head_dim
    conv_dim = 2 * h * kd + hv * vd
    projected = empty(b, t, conv_dim + hv * vd + 2 * hv, dtype=dtype)  # [qkv | z | b | a], as the runtime stacks them
    mixed, z, b_logits, a = projected.split([conv_dim, hv * vd, hv, hv], dim=-1)
    weight = empty(conv_dim, 4, dtype=dtype)
    window = empty(b, conv_dim, 3 + (0 if prefill else MTP_DRAFTS), dtype=dtype)
    if prefill:
        mixed = causal_conv1d_fn(mixed.contiguous(), weight, window, torch.full((b,), t))
    else:
        mixed = causal_conv1d_update(mixed.contiguous(), weight, window)
    q, k, v = mixed.split([h * kd, h * kd, hv * vd], dim=-1)
    q, k, v = q.reshape(b, t, h, kd), k.reshape(b, t, h, kd), v.reshape(b, t, hv, vd)
    a_log, dt_bias = empty(hv, dtype=torch.float32), empty(hv, dtype=torch.float32)
    state = empty(b, hv, kd, vd, dtype=torch.float32)
    if prefill:
        g, beta = fused_gdn_gating(a_log, a, dt_bias, b_logits)
        out, _ = chunk_gated_delta_rule(q, k, v, g, beta, state)
    else:
        log = VerifyLog.empty(b, t, h, hv, kd, vd, torch.float32, torch.device("cpu")) if t > 1 else None
        out = fused_recurrent_gated_delta_rule(q, k, v, a, b_logits, state, log, A_log=a_log, dt_bias=dt_bias,
                                               plan_tokens=plan_tokens)
    gated_rms_norm(out, z.view(b, t, hv, vd), empty(vd, dtype=dtype), 1e-6)


def norms(s: Sizes, dtype: torch.dtype, rows: int) -> None:
    from npuport.kernels.rms_norm import add_rms_norm, rms_norm

    x, weight = empty(rows, s.hidden_size, dtype=dtype), empty(s.hidden_size, dtype=dtype)
    rms_norm(x, weight, 1e-6)
    add_rms_norm(x, empty(rows, s.hidden_size, dtype=dtype), weight, 1e-6)


def linears(s: Sizes, dtype: torch.dtype, rows: int, quantized: bool) -> None:
    """The projections: W8A8 (the tokens quantized, then the int8 GEMM), or float as batch-invariant steps run
    them (F.linear otherwise: no Triton); the router and the LM head stay float."""
    from npuport.kernels.invariant_linear import invariant_linear
    from npuport.kernels.w8a8 import int8_matmul_rescale, quantize_per_token_int8

    for n, k in linear_shapes(s):
        x = empty(rows, k, dtype=dtype)
        if quantized:
            x_q, x_scale = quantize_per_token_int8(x)
            int8_matmul_rescale(x_q, x_scale, empty(n, k, dtype=torch.int8), empty(n, 1, dtype=torch.float32), dtype)
        else:
            invariant_linear(x, empty(n, k, dtype=dtype))
    float_heads = [(s.vocab_size, s.hidden_size)] + [(s.num_experts + 1, s.hidden_size)] * bool(s.num_experts)
    for n, k in float_heads:
        invariant_linear(empty(rows, k, dtype=dtype), empty(n, k, dtype=dtype))


def stacked_experts(s: Sizes, dtype: torch.dtype, quantized: bool, shared_quantized: bool, int4: bool = False):
    """(routed experts, shared expert): BF16 or int8; int4: the routed ones W4A8's int4 row pairs in int8 bytes."""
    from npuport.kernels.fused_moe import StackedExperts

    def experts(e: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        one = empty(1, rows, cols, dtype=dtype)
        return one.expand(e, rows, cols) if e * one.nbytes > STACK_BYTES else empty(e, rows, cols, dtype=dtype)

    def stacked(e: int, width: int, int8: bool, packed: bool = False) -> StackedExperts:
        if not int8:
            return StackedExperts(experts(e, 2 * width, s.hidden_size, dtype), experts(e, s.hidden_size, width, dtype))
        rows = 2 if packed else 1
        return StackedExperts(experts(e, 2 * width // rows, s.hidden_size, torch.int8),
                              experts(e, s.hidden_size // rows, width, torch.int8),
                              empty(e, 2 * width, dtype=torch.float32), empty(e, s.hidden_size, dtype=torch.float32),
                              int4=packed)

    return (stacked(s.num_experts, s.moe_intermediate_size, quantized, int4),
            stacked(1, s.shared_expert_intermediate_size, shared_quantized))


def moe(s: Sizes, dtype: torch.dtype, rows: int, quantized: bool, plan_tokens: int | None) -> None:
    """Routing and the experts: the shared expert riding along (BF16 beside int8 experts, as the W8A8 recipes keep
    it, or int8), the routed experts alone (several ranks), a shared expert of another layout (its rows apart)
    added after them by matvec launches of its own, the tokens arriving quantized (int8 dispatch), and W4A8's int4
    experts."""
    from npuport.kernels.fused_moe import StackedExperts, fused_experts, route_top_k
    from npuport.kernels.w8a8 import quantize_per_token_int8

    x = empty(rows, s.hidden_size, dtype=dtype)
    weights, ids = route_top_k(empty(rows, s.num_experts, dtype=dtype), s.num_experts_per_tok, dtype)
    ids = torch.randint(0, s.num_experts, ids.shape)  # the routing kernel did not run: ids its output could hold
    shared_weight = empty(rows, 1, dtype=dtype)
    for shared_quantized in {False, quantized}:
        routed, shared = stacked_experts(s, dtype, quantized, shared_quantized)
        fused_experts(x, routed, weights, ids, shared=(shared, shared_weight), plan_tokens=plan_tokens)
    routed, shared = stacked_experts(s, dtype, quantized, False)
    fused_experts(x, routed, weights, ids, plan_tokens=plan_tokens)
    h, i = s.hidden_size, s.shared_expert_intermediate_size
    apart = StackedExperts(empty(1, 2 * i, h + 16, dtype=dtype)[..., :h], empty(1, h, i + 16, dtype=dtype)[..., :i])
    fused_experts(x, routed, weights, ids, shared=(apart, shared_weight), plan_tokens=plan_tokens)
    if quantized:  # int8 dispatch: the tokens arrive quantized (expert parallelism)
        x_q, x_scale = quantize_per_token_int8(x)
        fused_experts(x, routed, weights, ids, x_int8=(x_q, x_scale), plan_tokens=plan_tokens)
    if quantized:  # W4A8: the int4 matvec kernels or grouped GEMMs, a BF16 shared expert riding along
        routed, shared = stacked_experts(s, dtype, True, False, int4=True)
        fused_experts(x, routed, weights, ids, shared=(shared, shared_weight), plan_tokens=plan_tokens)
        fused_experts(x, routed, weights, ids, plan_tokens=plan_tokens)


def record_runtime_launches() -> list[Launch]:
    """The launches of the runtime's kernels at the widths of MODELS, as an NPU would get them."""
    from npuport.kernels.w8a8 import gemm_candidates, int8_matmul_rescale_triton

    steps = [(1, 1, None), (8, 1, None), (1, 1 + MTP_DRAFTS, None), (8, 1 + MTP_DRAFTS, None),
             (8, 1, 1 + MTP_DRAFTS)]  # (requests, tokens, plan_tokens): decode, verify, batch-invariant decode
    with launched_as_on_npu(), recording_launches() as launches:
        for name in MODELS:
            s = PRESETS[name]
            for dtype in (torch.bfloat16, torch.float32):
                for b, t, plan in steps:
                    attention_step(s, dtype, b, t, plan)
                    gdn_step(s, dtype, b, t, False, plan)
                gdn_step(s, dtype, 1, 200, True, None)
                for rows in (1, 4, 32, 512):
                    norms(s, dtype, rows)
                    linears(s, dtype, rows, quantized=False)
                    if dtype == torch.bfloat16:
                        linears(s, dtype, rows, quantized=True)
                if s.num_experts:
                    for rows, plan in ((1, None), (8, None), (8, 16), (16, None), (200, None)):
                        for quantized in (False, True) if dtype == torch.bfloat16 else (False,):
                            moe(s, dtype, rows, quantized, plan)
        # Split-K, which no NPU launch picks (gemm_candidates), with an explicit config, as the tests launch it
        config = replace(gemm_candidates(16, torch.device("cpu"))[0], split_k=2)
        int8_matmul_rescale_triton(empty(16, 5120, dtype=torch.int8), empty(16, dtype=torch.float32),
                                   empty(5120, 5120, dtype=torch.int8), empty(5120, dtype=torch.float32),
                                   torch.bfloat16, config)
    return launches


@pytest.fixture(scope="module")
def runtime_launches() -> list[Launch]:
    return record_runtime_launches()


def test_every_launched_kernel_is_recorded_and_has_a_footprint(runtime_launches):
    """The recorded launches cover every kernel that npuport.kernels launches, and FOOTPRINTS knows each: a new
    kernel must get a launch here and its tiles there."""
    recorded = {(launch.module, launch.kernel) for launch in runtime_launches}
    assert launched_kernels() - recorded == set()
    int4 = {launch.kernel for launch in runtime_launches if launch.constexprs.get("INT4")}
    assert {"_grouped_gemm_kernel", "_matvec_down_kernel"} <= int4  # W4A8's int4 variants too
    assert {kernel for _, kernel in launched_kernels()} - FOOTPRINTS.keys() == set()


def test_every_kernel_lowers_for_an_ascend_910b(ascend_python, runtime_launches, tmp_path):
    """triton-ascend compiles every distinct launch through triton-adapter-opt (TTIR -> linalg / HIVM) and stops
    only at the binary stage, for want of CANN; anything else is named with the adapter's message."""
    launches_file, results_file = tmp_path / "launches.json", tmp_path / "lowered.json"
    launches_file.write_text(json.dumps([asdict(launch) for launch in runtime_launches]))
    env = {k: v for k, v in os.environ.items() if k != "ASCEND_HOME_PATH"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([str(ascend_python), ascend_lowering.__file__, str(ROOT), str(launches_file),
                           str(results_file)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    results = [Lowering(Launch(**r.pop("launch")), **r) for r in json.loads(results_file.read_text())]
    assert len(results) > len(launched_kernels())
    failed = [f"{r.launch.describe()}\n  {r.stage}: {r.message}" for r in results if not r.lowered]
    assert not failed, f"{len(failed)} of {len(results)} distinct launches did not lower:\n" + "\n".join(failed)


def test_every_launch_fits_the_910b_on_chip_buffers(runtime_launches):
    """Each launch's tiles (npu_footprint: what it loads, twice with multi-buffering, and what it accumulates) fit one
    AI core's unified buffer and, for tl.dot, the cube core's L1 / L0A / L0B / L0C."""
    over = {}
    for launch in runtime_launches:
        problems = npu_footprint(launch).overflows(launch.multibuffer)
        if problems:
            over[launch.describe()] = problems
    assert not over, "\n".join(f"{k}: {', '.join(v)}" for k, v in over.items())
