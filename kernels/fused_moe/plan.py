"""How a call of the MoE experts runs, decided once from shapes, dtypes and the device (plan_experts -> ExpertPlan):
the implementation, the Triton kernels' path (matvec or grouped GEMM) and tiles, how the shared expert joins the
routed sum, and which tokens the kernels read. run.py executes a plan; nothing there decides."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from npuport.kernels.fused_moe.experts import StackedExperts, shares_layout
from npuport.kernels.fused_moe.grouped_gemm import GroupedConfig, grouped_config
from npuport.kernels.fused_moe.matvec import MatvecConfig, matvec_config
from npuport.kernels.implementations import NATIVE, REFERENCE, TRITON, runnable
from npuport.kernels.launch import use_triton
from npuport.kernels.npu.moe import moe_experts_refusal

# The paths of the routed experts: the Triton kernels' two, the PyTorch loop, torch-npu's operators.
MATVEC, GROUPED = "matvec", "grouped"
PATHS = (MATVEC, GROUPED, REFERENCE, NATIVE)
# How the shared expert joins: one more slot of the routed sum (rounded once with it), or added onto the rounded
# routed sum by its own matvec launches or by PyTorch.
SLOT = "slot"
SHARED_WAYS = (SLOT, MATVEC, REFERENCE)

# Up to this many routed pairs (token x slot) the matvec kernels run; beyond, the grouped GEMMs, whose weight tiles
# serve every row of an expert at once. At the 35B-A3B widths on an H200 the matvec kernels were 1.4-2x faster at
# 128 pairs (bench/RESULTS.md).
MATVEC_MAX_PAIRS = 128
# int4 experts: the matvec kernels serve routed pairs up to this many for each expert of the call, the grouped GEMMs
# (reading int4 themselves, grouped_gemm.py) beyond. Where they cross, measured on an H100 (bench/int4_experts.py,
# bench/RESULTS.md): about 1.25 pairs an expert at 397B-A17B widths (512 experts: matvec 12% faster at 0.94, the
# grouped GEMMs 3% faster at 1.25 and 32% at 1.9) and about 2 at 35B-A3B widths (256 experts: matvec 27% faster at
# 1.5, even at 2, grouped 37% faster at 3). In proportion to the experts, the limit follows an expert-parallel rank's
# share of them.
INT4_MATVEC_PAIRS_PER_EXPERT = 1.5


@dataclass(frozen=True)
class ExpertPlan:
    """One call of the experts, decided.

    path: MATVEC or GROUPED (the Triton kernels, with the tiles `matvec` or `grouped`), REFERENCE (the PyTorch
    loop) or NATIVE (torch-npu's MoE operators, kernels/npu/moe.py: its shared expert summed in by the operator that
    sums the slots, recorded as SLOT).
    shared: None (no shared expert), or how it joins the routed sum (SHARED_WAYS; MATVEC with the tiles
    shared_matvec). int8_tokens: the routed experts read the tokens as they arrived quantized (x_int8) rather than
    the float tokens x."""

    path: str
    shared: str | None
    int8_tokens: bool
    matvec: MatvecConfig | None = None
    grouped: GroupedConfig | None = None
    shared_matvec: MatvecConfig | None = None

    def __post_init__(self) -> None:
        if self.path not in PATHS or self.shared not in (None, *SHARED_WAYS):
            raise ValueError(f"no such expert plan: path {self.path!r}, shared expert {self.shared!r}")
        tiles = {MATVEC: (self.matvec, MatvecConfig), GROUPED: (self.grouped, GroupedConfig)}
        if self.path in tiles and not isinstance(*tiles[self.path]):
            raise ValueError(f"the {self.path} path needs its tiles, got {tiles[self.path][0]!r}")
        if self.shared == MATVEC and self.shared_matvec is None:
            raise ValueError("a shared expert on matvec launches of its own needs their tiles")

    @property
    def implementation(self) -> str:
        """kernels.implementations' name of what runs the routed experts."""
        return TRITON if self.path in (MATVEC, GROUPED) else self.path


def plan_experts(x: torch.Tensor, experts: StackedExperts, expert_ids: torch.Tensor, *,
                 shared: StackedExperts | None = None, tokens_int8: bool = False, plan_tokens: int | None = None
                 ) -> ExpertPlan:
    """The plan of fused_experts(x, experts, weights, expert_ids, shared=(shared, weight), x_int8=..., plan_tokens):
    kernels.implementations' choice for "moe_experts" on x's device, stepping down from Triton to the reference
    where the kernels cannot take x (float64, autograd), then plan_experts_triton's choices for Triton. Off Triton
    the shared expert is added after the routed sum, as PyTorch adds it.

    x [M, H] (only its shape, dtype and device are read); expert_ids [M, top_k]; shared: one expert (E = 1);
    tokens_int8: the tokens arrive quantized too (int8 dispatch); plan_tokens: plan as for that many tokens (each
    token's bits then do not depend on M, for M up to plan_tokens: batch-invariant steps); default M."""
    # a batch-invariant step (plan_tokens) has no native form: the grouped matmul tiles by the call's rows; packed
    # int4 experts neither: the loader unpacks them where torch-npu's operators run them
    native = None if plan_tokens is not None or experts.int4 else lambda: moe_experts_refusal(x, experts, shared)
    chosen = runnable("moe_experts", x.device, native=native, triton=use_triton(x))
    if chosen == TRITON:
        return plan_experts_triton(x, experts, expert_ids, shared=shared, tokens_int8=tokens_int8,
                                   plan_tokens=plan_tokens)
    if chosen == NATIVE:  # the shared expert added in by the operator that sums the slots
        return ExpertPlan(NATIVE, None if shared is None else SLOT, tokens_int8 and experts.quantized)
    return ExpertPlan(REFERENCE, None if shared is None else REFERENCE, tokens_int8 and experts.quantized)


def plan_experts_triton(x: torch.Tensor, experts: StackedExperts, expert_ids: torch.Tensor, *,
                        shared: StackedExperts | None = None, tokens_int8: bool = False,
                        plan_tokens: int | None = None, matvec_max_pairs: int | None = None) -> ExpertPlan:
    """The Triton kernels' plan (any device; CPU tensors run in Triton's interpreter), arguments as plan_experts':
    the matvec kernels up to matvec_max_pairs routed pairs of the planned tokens (default MATVEC_MAX_PAIRS, for int4
    experts INT4_MATVEC_PAIRS_PER_EXPERT for each expert of the call), the grouped GEMMs beyond. A
    shared expert of the routed ones' layout (shares_layout) is one more slot - in the matvec kernels, or beside
    the grouped GEMMs - so that a decode step and a verify step round alike; another is added after the routed
    sum, by matvec launches of its own for few tokens."""
    m, top_k = expert_ids.shape
    if matvec_max_pairs is None:
        matvec_max_pairs = (int(INT4_MATVEC_PAIRS_PER_EXPERT * experts.num_experts) if experts.int4
                            else MATVEC_MAX_PAIRS)
    planned = m if plan_tokens is None else max(m, plan_tokens)
    arrived_int8 = tokens_int8 and experts.quantized
    slot = shared is not None and shares_layout(experts, shared)
    if shared is None or slot:
        shared_way, shared_tiles = (None if shared is None else SLOT), None
    elif planned <= matvec_max_pairs:
        shared_way, shared_tiles = MATVEC, matvec_config(planned, x.device)
    else:
        shared_way, shared_tiles = REFERENCE, None
    if planned * top_k <= matvec_max_pairs:
        # int8 experts quantize float tokens in the matvec kernels themselves (the same values); a float shared
        # expert riding along needs them float
        float_rider = slot and not shared.quantized
        tiles = matvec_config(planned * (top_k + int(slot)), x.device, int4=experts.int4)
        return ExpertPlan(MATVEC, shared_way, arrived_int8 and not float_rider, matvec=tiles,
                          shared_matvec=shared_tiles)
    tiles = grouped_config(planned * top_k, experts.num_experts, x.device)
    return ExpertPlan(GROUPED, shared_way, arrived_int8, grouped=tiles, shared_matvec=shared_tiles)
