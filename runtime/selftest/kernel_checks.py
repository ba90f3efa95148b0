"""The kernel checks of `npuport selftest`: every operator the runtime dispatches against its PyTorch reference at a
few Qwen3.5 shapes. On an accelerator a check calls the kernel's entry point, so what implementation(op, device)
picks (native, Triton) is what is checked, at the published models' widths; on the CPU, where the runtime runs the
references, it calls the Triton kernel in Triton's interpreter at small widths. References run on the CPU.

Tolerances are those of each kernel's tests (tests/test_kernels_*.py in the interpreter, test_kernels_on_gpu.py
on a device): bit for bit where they demand it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from npuport.devices import is_cpu, is_npu
from npuport.kernels.implementations import NATIVE_ON_NPU, ORDER_FREE
from npuport.runtime.selftest import cases
from npuport.runtime.selftest.case_inputs import Case
from npuport.runtime.selftest.sizes import (
    DECODE,
    INTERPRETER_DECODE,
    INTERPRETER_PREFILL,
    INTERPRETER_VERIFY,
    INTERPRETER_WIDTHS,
    MODEL_WIDTHS,
    PREFILL,
    VERIFY,
    Step,
    Widths,
)


@dataclass(frozen=True)
class CaseSpec:
    """A check before its inputs are made (building one allocates them, so a run holds one case at a time).
    invariant: run inside kernels.implementations.batch_invariant_calls, as batch-invariant steps call it (on an NPU
    the Triton kernel then runs where the native operator otherwise would)."""

    op: str
    widths: str
    step: str
    build: Callable[[], Case]
    invariant: bool = False


# op -> (builder, the steps it stands for). "rows": any step, though quick runs skip prefill;
# "grouped": any step, prefill included (the MoE grouped GEMMs run only past the mat-vec kernels' routed pairs);
# "decode": decode and verify; "prefill": prefill only. A trailing "*": on an accelerator only (no Triton function of
# its own to interpret).
Builder = Callable[[Widths, Step, torch.device, int], Case]
BUILDERS: tuple[tuple[str, Builder, str], ...] = (
    ("rms_norm", cases.rms_norm_case, "rows"),
    ("add_rms_norm", cases.add_rms_norm_case, "rows"),
    ("gated_rms_norm", cases.gated_rms_norm_case, "rows"),
    ("rms_norm_rope", cases.rms_norm_rope_case, "rows"),
    ("rope", cases.rope_case, "rows*"),
    ("kv_write", cases.kv_write_case, "decode"),
    ("decode_attention", cases.decode_attention_case, "decode"),
    ("w8a8_quantize", cases.w8a8_quantize_case, "rows"),
    ("w8a8_matmul", cases.w8a8_matmul_case, "rows"),
    ("invariant_linear", cases.invariant_linear_case, "rows"),
    ("moe_routing", cases.moe_routing_case, "rows"),
    ("moe_experts", cases.bf16_experts_case, "grouped"),
    ("moe_experts", cases.w8a8_experts_case, "grouped"),
    ("moe_experts", cases.w8a8_and_shared_experts_case, "rows"),
    ("gdn_gating", cases.gdn_gating_case, "rows"),
    ("causal_conv1d", cases.conv_update_case, "decode"),
    ("causal_conv1d", cases.conv_prefill_case, "prefill"),
    ("gdn_recurrent", cases.gdn_recurrent_case, "decode"),
    ("gdn_chunk", cases.gdn_chunk_case, "prefill"),
)
MOE_OPS = frozenset({"moe_routing", "moe_experts"})


def widths_and_steps(device: torch.device, quick: bool) -> tuple[tuple[Widths, ...], tuple[Step, ...]]:
    """The widths and steps a run takes: the published widths at decode, verify and prefill on an accelerator
    (quick: 35B-A3B's, verify and a shorter prefill); small widths in the interpreter (quick: no decode step)."""
    if is_cpu(device):
        return (INTERPRETER_WIDTHS,), (INTERPRETER_VERIFY, INTERPRETER_PREFILL) if quick else (
            INTERPRETER_DECODE, INTERPRETER_VERIFY, INTERPRETER_PREFILL)
    if quick:
        return MODEL_WIDTHS[:1], (VERIFY, Step("prefill", 1, 128))
    return MODEL_WIDTHS, (DECODE, VERIFY, PREFILL)


def _takes(kind: str, step: Step, device: torch.device, quick: bool) -> bool:
    """Whether a builder of `kind` (see BUILDERS) runs at `step` on `device`."""
    if kind.endswith("*") and is_cpu(device):
        return False
    kind = kind.rstrip("*")
    if kind == "decode":
        return step.name != "prefill"
    if kind == "prefill":
        return step.name == "prefill"
    return step.name != "prefill" or kind == "grouped" or not quick


def kernel_checks(device: torch.device, quick: bool = False) -> Iterator[CaseSpec]:
    """Every check of a run on `device`, in order, its inputs not made yet. On an NPU an operator whose native form
    batch-invariant steps do not take is checked twice: native, then as those steps call it (triton-ascend)."""
    widths, steps = widths_and_steps(device, quick)
    seed = 0
    for w in widths:
        for step in steps:
            for op, build, kind in BUILDERS:
                if not _takes(kind, step, device, quick) or (op in MOE_OPS and not w.experts):
                    continue
                seed += 1
                spec = CaseSpec(op, w.name, f"{step.name} {step.requests}x{step.tokens}",
                                lambda build=build, w=w, step=step, seed=seed: build(w, step, device, seed))
                yield spec
                if is_npu(device) and op in NATIVE_ON_NPU - ORDER_FREE:
                    yield dataclasses.replace(spec, invariant=True)
