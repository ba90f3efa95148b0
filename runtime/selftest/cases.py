"""One builder per operator for the kernel checks of `npuport selftest`: (widths, step, device, seed) -> Case, the
kernel's call and its reference's on CPU copies of the same inputs, with the tolerance each kernel's tests use."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from npuport.devices import is_cpu
from npuport.kernels.causal_conv1d import causal_conv1d_fn_reference, causal_conv1d_update_reference
from npuport.kernels.decode_attention import decode_attention_reference
from npuport.kernels.fused_moe import MatvecConfig, StackedExperts, fused_experts_reference, route_top_k_reference
from npuport.kernels.fused_moe import plan as expert_plan
from npuport.kernels.fused_moe import run as expert_run
from npuport.kernels.gated_delta_rule import (
    chunk_gated_delta_rule_reference,
    fused_recurrent_gated_delta_rule_reference,
)
from npuport.kernels.gated_rms_norm import gated_rms_norm_reference
from npuport.kernels.gdn_gating import fused_gdn_gating_reference
from npuport.kernels.invariant_linear import invariant_linear_reference
from npuport.kernels.kv_write import write_kv_reference
from npuport.kernels.rms_norm import add_rms_norm_reference, rms_norm_reference
from npuport.kernels.rope import apply_rope, rms_norm_rope_reference
from npuport.kernels.w8a8 import int8_matmul_rescale_reference, quantize_per_token_int8_reference
from npuport.runtime.selftest.case_inputs import Case, Draw, Outputs, cpu, kernel, shapes
from npuport.runtime.selftest.sizes import (
    BF16,
    CONV_WIDTH,
    EPS,
    VERIFY_DRAFTS,
    Step,
    Widths,
)
from npuport.runtime.selftest.tolerance import EXACT, NORMED, ONE_BF16_STEP, Tolerance

# One builder per operator: (widths, step, device, seed) -> Case.

def rms_norm_case(w: Widths, step: Step, device: torch.device, seed: int) -> Case:
    d = Draw(device, seed)
    x, weight = d.normal(step.rows, w.hidden, scale=3), d.normal(w.hidden, scale=0.1)
    run = kernel("rms_norm", "rms_norm", device)
    return Case("rms_norm", shapes(x=x, weight=weight), lambda: (run(x, weight, EPS),),
                lambda: (rms_norm_reference(cpu(x), cpu(weight), EPS),), (NORMED,))


def add_rms_norm_case(w: Widths, step: Step, device: torch.device, seed: int) -> Case:
    d = Draw(device, seed)
    x, residual = d.normal(step.rows, w.hidden, scale=3), d.normal(step.rows, w.hidden, scale=3)
    weight = d.normal(w.hidden, scale=0.1)
    run = kernel("rms_norm", "add_rms_norm", device)
    return Case("add_rms_norm", shapes(x=x, residual=residual, weight=weight), lambda: run(x, residual, weight, EPS),
                lambda: add_rms_norm_reference(cpu(x), cpu(residual), cpu(weight), EPS), (NORMED, EXACT))


def gated_rms_norm_case(w: Widths, step: Step, device: torch.device, seed: int) -> Case:
    d = Draw(device, seed)
    heads, n = w.value_heads, w.value_dim
    x = d.normal(step.rows, heads, n)
    gate = d.normal(step.rows, heads * n + 64, scale=3)[:, 64:].view(step.rows, heads, n)  # a stacked projection's
    weight = d.normal(n, scale=0.1) + 1
    run = kernel("gated_rms_norm", "gated_rms_norm", device)
    return Case("gated_rms_norm", shapes(x=x, gate=gate, weight=weight), lambda: (run(x, gate, weight, EPS),),
                lambda: (gated_rms_norm_reference(cpu(x), cpu(gate), cpu(weight), EPS),), (EXACT,))


def _cos_sin(d: Draw, step: Step, rot: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = d.normal(step.requests, step.tokens, rot, scale=4, dtype=torch.float32)
    return angles.cos().to(BF16), angles.sin().to(BF16)


def rms_norm_rope_case(w: Widths, step: Step, device: torch.device, seed: int) -> Case:
    d = Draw(device, seed)
    q = d.normal(step.requests, step.tokens, w.heads, 2 * w.head_dim, scale=3)[..., : w.head_dim]  # q of q | gate
    weight = d.normal(w.head_dim, scale=0.1)
    cos, sin = _cos_sin(d, step, w.rotary)
    run = kernel("rope", "rms_norm_rope", device)
    return Case("rms_norm_rope", shapes(q=q, weight=weight, cos=cos), lambda: (run(q, weight, EPS, cos, sin),),
                lambda: (rms_norm_rope_reference(cpu(q), cpu(weight), EPS, cpu(cos), cpu(sin)),), (EXACT,))


def rope_case(w: Widths, step: Step, device: torch.device, seed: int) -> Case:
    d = Draw(device, seed)
    k = d.normal(step.requests, step.tokens, w.kv_heads, w.head_dim, scale=3)
    cos, sin = _cos_sin(d, step, w.rotary)
    run = kernel("rope", "apply_rope", device)
    return Case("rope", shapes(k=k, cos=cos), lambda: (run(k, cos, sin),),
                lambda: (apply_rope(cpu(k), cpu(cos), cpu(sin)),), (EXACT,))


def kv_write_case(w: Widths, step: Step, device: torch.device, seed: int) -> Case:
    d = Draw(device, seed)
    capacity = 4 * step.tokens + 64
    cache_k, cache_v = (d.normal(step.requests, capacity, w.kv_heads, w.head_dim) for _ in range(2))
    kv = d.normal(step.requests, step.tokens, w.kv_heads, 2 * w.head_dim, dtype=torch.float32)  # float32 into bf16
    k, v = kv[..., : w.head_dim], kv[..., w.head_dim :]
    start = d.positions(step.requests, step.tokens, capacity)
    write = kernel("kv_write", "write_kv", device)

    def run() -> Outputs:
        got_k, got_v = cache_k.clone(), cache_v.clone()
        write(got_k, got_v, start, k, v)
        return got_k, got_v

    def reference() -> Outputs:
        want_k, want_v = cpu(cache_k), cpu(cache_v)
        write_kv_reference(want_k, want_v, cpu(start), cpu(k), cpu(v))
        return want_k, want_v

    return Case("kv_write", shapes(cache_k=cache_k, k=k), run, reference, (EXACT, EXACT))


def decode_attention_case(w: Widths, step: Step, device: torch.device, seed: int) -> Case:
    d = Draw(device, seed)
    capacity = 1280 if not is_cpu(device) else 96
    q_gate = d.normal(step.requests, step.tokens, w.heads, 2 * w.head_dim)
    q, gate = q_gate[..., : w.head_dim], q_gate[..., w.head_dim :]
    keys, values = (d.normal(step.requests, capacity, w.kv_heads, w.head_dim) for _ in range(2))
    start = d.positions(step.requests, step.tokens, capacity)
    run = kernel("decode_attention", "decode_attention", device)
    return Case("decode_attention", shapes(q=q, keys=keys), lambda: (run(q, keys, values, start, gate),),
                lambda: (decode_attention_reference(cpu(q), cpu(keys), cpu(values), cpu(start), cpu(gate)),),
                (Tolerance(relative_l2=1e-2),))


def w8a8_quantize_case(w: Widths, step: Step, device: torch.device, seed: int) -> Case:
    x = Draw(device, seed).normal(step.rows, w.hidden, scale=3)
    run = kernel("w8a8.quantize", "quantize_per_token_int8", device)
    return Case("w8a8_quantize", shapes(x=x), lambda: run(x), lambda: quantize_per_token_int8_reference(cpu(x)),
                (EXACT, EXACT))


def w8a8_matmul_case(w: Widths, step: Step, device: torch.device, seed: int) -> Case:
    d = Draw(device, seed)
    x_q, w_q = d.int8(step.rows, w.hidden), d.int8(w.qkv_out, w.hidden)  # the attention's stacked projection
    x_scale, w_scale = d.uniform(step.rows, 1, scale=0.01), d.uniform(w.qkv_out, 1, scale=0.01)
    run = kernel("w8a8.gemm", "int8_matmul_rescale", device)
    return Case("w8a8_matmul", shapes(x_q=x_q, w_q=w_q), lambda: (run(x_q, x_scale, w_q, w_scale, BF16),),
                lambda: (int8_matmul_rescale_reference(cpu(x_q), cpu(x_scale), cpu(w_q), cpu(w_scale), BF16),),
                (EXACT,))


def invariant_linear_case(w: Widths, step: Step, device: torch.device, seed: int) -> Case:
    d = Draw(device, seed)
    x, weight = d.normal(step.rows, w.hidden), d.normal(w.hidden, w.hidden, scale=w.hidden**-0.5)
    run = kernel("invariant_linear", "invariant_linear", device)
    # against F.linear in float64: within bf16 rounding of the output
    return Case("invariant_linear", shapes(x=x, weight=weight), lambda: (run(x, weight),),
                lambda: (invariant_linear_reference(cpu(x).double(), cpu(weight).double()),),
                (Tolerance(relative_l2=4e-3),))


def moe_routing_case(w: Widths, step: Step, device: torch.device, seed: int) -> Case:
    logits = Draw(device, seed).normal(step.rows, w.experts, dtype=torch.float32)  # fp32: no ties to order
    run = kernel("fused_moe.routing", "route_top_k", device)
    return Case("moe_routing", shapes(router_logits=logits), lambda: run(logits, w.top_k, BF16),
                lambda: route_top_k_reference(cpu(logits), w.top_k, BF16), (Tolerance(atol=4e-3), EXACT))


def random_experts(d: Draw, w: Widths, count: int, quantized: bool) -> StackedExperts:
    """`count` experts of w's widths; W8A8: rounded per output channel to int8 with fp32 scales."""
    gate_up = d.normal(count, 2 * w.expert_intermediate, w.hidden, scale=0.02, dtype=torch.float32)
    down = d.normal(count, w.hidden, w.expert_intermediate, scale=0.02, dtype=torch.float32)
    if not quantized:
        return StackedExperts(gate_up.to(BF16), down.to(BF16))
    scales = [m.abs().amax(-1) / 127 for m in (gate_up, down)]
    values = [(m / s[..., None]).round().clamp(-128, 127).to(torch.int8) for m, s in zip((gate_up, down), scales,
                                                                                        strict=True)]
    return StackedExperts(values[0], values[1], scales[0], scales[1])


def experts_on_cpu(e: StackedExperts) -> StackedExperts:
    return StackedExperts(cpu(e.gate_up), cpu(e.down), cpu(e.gate_up_scale), cpu(e.down_scale))


def _routing(d: Draw, w: Widths, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Renormalised top-k weights [rows, top_k] bf16 and distinct expert ids [rows, top_k]."""
    ids = torch.rand(rows, w.experts, generator=d.gen, device=d.device).argsort(-1)[:, : w.top_k]
    weights = torch.softmax(d.normal(rows, w.top_k, dtype=torch.float32), -1).to(BF16)
    return weights, ids


# The matvec tiles the interpreter runs the MoE kernels with: a GPU's [4, 512] for few pairs would be 8x the programs,
# each interpreted in Python (seconds each check); the kernels' masks, slots and quantization are the same at any tile.
INTERPRETER_MATVEC = MatvecConfig(gate_up_bn=32, down_bn=32, bk=128)


def experts_triton(x: torch.Tensor, experts: StackedExperts, weights: torch.Tensor, expert_ids: torch.Tensor, *,
                   shared: tuple[StackedExperts, torch.Tensor] | None = None) -> torch.Tensor:
    """fused_experts through the Triton kernels in the interpreter: their plan (matvec tiles INTERPRETER_MATVEC),
    run."""
    chosen = expert_plan.plan_experts_triton(x, experts, expert_ids, shared=None if shared is None else shared[0])
    if chosen.matvec is not None:
        chosen = dataclasses.replace(chosen, matvec=INTERPRETER_MATVEC,
                                     shared_matvec=chosen.shared_matvec and INTERPRETER_MATVEC)
    return expert_run.run_experts(chosen, x, experts, weights, expert_ids, shared=shared)


def moe_experts_case(w: Widths, step: Step, device: torch.device, seed: int, quantized: bool,
                     with_shared: bool = False) -> Case:
    """The routed experts, BF16 or W8A8 (with_shared: W8A8 and the BF16 shared expert the recipes keep, as a MoE
    layer calls them): within bf16 rounding of the per-expert loop - relative L2 1e-2 on a device (the GPU test's),
    each value within 1e-2 in the interpreter (its test's)."""
    d = Draw(device, seed)
    experts = random_experts(d, w, w.experts, quantized)
    x = d.normal(step.rows, w.hidden)
    weights, ids = _routing(d, w, step.rows)
    shared = (random_experts(d, w, 1, False), d.uniform(step.rows, 1).to(BF16)) if with_shared else None
    run = kernel("fused_moe.run", "fused_experts", device, interpreted=experts_triton)
    tolerance = Tolerance(rtol=1e-2, atol=1e-2) if is_cpu(device) else Tolerance(relative_l2=1e-2)
    kind = ("w8a8" if quantized else "bf16") + (" + a bf16 shared one" if with_shared else "")
    return Case("moe_experts", f"{kind}: experts [{w.experts}, {2 * w.expert_intermediate}, {w.hidden}], "
                f"{shapes(x=x, expert_ids=ids)}", lambda: (run(x, experts, weights, ids, shared=shared),),
                lambda: (fused_experts_reference(cpu(x), experts_on_cpu(experts), cpu(weights), cpu(ids),
                                                 shared=None if shared is None else
                                                 (experts_on_cpu(shared[0]), cpu(shared[1]))),),
                (tolerance,))


def bf16_experts_case(w: Widths, step: Step, device: torch.device, seed: int) -> Case:
    return moe_experts_case(w, step, device, seed, quantized=False)


def w8a8_experts_case(w: Widths, step: Step, device: torch.device, seed: int) -> Case:
    return moe_experts_case(w, step, device, seed, quantized=True)


def w8a8_and_shared_experts_case(w: Widths, step: Step, device: torch.device, seed: int) -> Case:
    return moe_experts_case(w, step, device, seed, quantized=True, with_shared=True)


def gdn_gating_case(w: Widths, step: Step, device: torch.device, seed: int) -> Case:
    d = Draw(device, seed)
    hv = w.value_heads
    a_log, dt_bias = d.normal(hv, dtype=torch.float32), d.normal(hv, dtype=torch.float32)
    a, b = d.normal(step.requests, step.tokens, hv, scale=12), d.normal(step.requests, step.tokens, hv, scale=4)
    run = kernel("gdn_gating", "fused_gdn_gating", device)
    scale = 1e-6 if is_cpu(device) else 1e-5  # fp32 exp / log rounding: the interpreter's numpy, the device's own
    return Case("gdn_gating", shapes(a=a, b=b), lambda: run(a_log, a, dt_bias, b),
                lambda: fused_gdn_gating_reference(cpu(a_log), cpu(a), cpu(dt_bias), cpu(b)),
                (Tolerance(rtol=scale, atol=scale), Tolerance(rtol=scale, atol=scale / 10)))


def conv_update_case(w: Widths, step: Step, device: torch.device, seed: int) -> Case:
    """Decode / verify: silu(conv) within one bf16 step of the fp32 reference, the window shifted exactly."""
    d = Draw(device, seed)
    x = d.normal(step.requests, step.tokens, w.conv_channels)
    weight = d.normal(w.conv_channels, CONV_WIDTH)
    window = d.normal(step.requests, w.conv_channels, CONV_WIDTH - 1 + VERIFY_DRAFTS)
    update = kernel("causal_conv1d", "causal_conv1d_update", device)

    def run() -> Outputs:
        got_window = window.clone()
        return update(x, weight, got_window), got_window

    def reference() -> Outputs:
        out = causal_conv1d_update_reference(cpu(x).float(), cpu(weight).float(), cpu(window).float())
        want_window = cpu(window)
        causal_conv1d_update_reference(cpu(x), cpu(weight), want_window)
        return out, want_window

    return Case("causal_conv1d", "update: " + shapes(x=x, window=window), run, reference, (ONE_BF16_STEP, EXACT))


def conv_prefill_case(w: Widths, step: Step, device: torch.device, seed: int) -> Case:
    d = Draw(device, seed)
    x = d.normal(step.requests, step.tokens, w.conv_channels)
    weight = d.normal(w.conv_channels, CONV_WIDTH)
    window = d.normal(step.requests, w.conv_channels, CONV_WIDTH - 1 + VERIFY_DRAFTS)
    n_valid = torch.full((step.requests,), step.tokens, device=device)
    prefill = kernel("causal_conv1d", "causal_conv1d_fn", device)

    def run() -> Outputs:
        got_window = window.clone()
        return prefill(x, weight, got_window, n_valid), got_window

    def reference() -> Outputs:
        out = causal_conv1d_fn_reference(cpu(x).float(), cpu(weight).float(), cpu(window).float(), cpu(n_valid))
        want_window = cpu(window)
        causal_conv1d_fn_reference(cpu(x), cpu(weight), want_window, cpu(n_valid))
        return out, want_window

    return Case("causal_conv1d", "prefill: " + shapes(x=x, window=window), run, reference, (ONE_BF16_STEP, EXACT))


def _gdn_inputs(d: Draw, w: Widths, step: Step) -> tuple[torch.Tensor, ...]:
    """q, k [B, T, H, K], v [B, T, HV, V] in bf16."""
    q, k = (d.normal(step.requests, step.tokens, w.key_heads, w.key_dim) for _ in range(2))
    return q, k, d.normal(step.requests, step.tokens, w.value_heads, w.value_dim)


def gdn_recurrent_case(w: Widths, step: Step, device: torch.device, seed: int) -> Case:
    """Decode / verify with the gating fused, as the runtime calls it: outputs within one bf16 step of the fp32
    reference, the state within fp32 sums in another order."""
    d = Draw(device, seed)
    q, k, v = _gdn_inputs(d, w, step)
    a, b = (d.normal(step.requests, step.tokens, w.value_heads, dtype=torch.float32) for _ in range(2))
    a_log, dt_bias = d.normal(w.value_heads, dtype=torch.float32), d.normal(w.value_heads, dtype=torch.float32)
    state = d.normal(step.requests, w.value_heads, w.key_dim, w.value_dim, scale=0.1, dtype=torch.float32)
    recurrent = kernel("gated_delta_rule.fused_recurrent", "fused_recurrent_gated_delta_rule", device)

    def run() -> Outputs:
        got_state = state.clone()
        return recurrent(q, k, v, a, b, got_state, A_log=a_log, dt_bias=dt_bias), got_state

    def reference() -> Outputs:
        want_state = cpu(state)
        out = fused_recurrent_gated_delta_rule_reference(cpu(q).float(), cpu(k).float(), cpu(v).float(), cpu(a),
                                                         cpu(b), want_state, A_log=cpu(a_log), dt_bias=cpu(dt_bias))
        return out, want_state

    state_tolerance = Tolerance(atol=1e-5, rtol=1e-5) if is_cpu(device) else Tolerance(atol=1e-4)
    return Case("gdn_recurrent", shapes(q=q, v=v, state=state), run, reference, (ONE_BF16_STEP, state_tolerance))


def gdn_chunk_case(w: Widths, step: Step, device: torch.device, seed: int) -> Case:
    """Chunked prefill from an initial state: bf16 tiles into the dot products, so 2e-2 in relative L2."""
    d = Draw(device, seed)
    q, k, v = _gdn_inputs(d, w, step)
    g = F.logsigmoid(d.normal(step.requests, step.tokens, w.value_heads, dtype=torch.float32)) * 0.2
    beta = d.uniform(step.requests, step.tokens, w.value_heads)
    s0 = d.normal(step.requests, w.value_heads, w.key_dim, w.value_dim, scale=0.1, dtype=torch.float32)
    chunk = kernel("gated_delta_rule.chunk", "chunk_gated_delta_rule", device)
    return Case("gdn_chunk", shapes(q=q, v=v, initial_state=s0), lambda: chunk(q, k, v, g, beta, s0),
                lambda: chunk_gated_delta_rule_reference(cpu(q).float(), cpu(k).float(), cpu(v).float(), cpu(g),
                                                         cpu(beta), cpu(s0)),
                (Tolerance(relative_l2=2e-2), Tolerance(relative_l2=2e-2)))
