"""How a command runs the model, decided once where it starts and passed down: MTP drafts per round, graphs,
batch-invariant steps, and the MoE dispatch (runtime/dispatch.py). Imports no torch at module level: the
command line takes its limits from here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from npuport.errors import NpuportError
from npuport.runtime.dispatch import DispatchConfig, current_dispatch

if TYPE_CHECKING:  # the command line reads MAX_DRAFTS and DISPATCH_CHOICES without importing torch
    from npuport.runtime.model import Qwen35

# The most drafts one MTP round may verify: the limit of every command's --mtp, and what batch-invariant steps
# plan for (planned_rows).
MAX_DRAFTS = 4
# --dispatch's values -> DispatchConfig.bf16 (None: follow the experts)
DISPATCH_CHOICES = {"bf16": True, "int8": False, "auto": None}


@dataclass(frozen=True)
class RunOptions:
    """mtp: drafts per round (0: plain decoding); graphs: steps captured as device graphs; invariant:
    batch-invariant decode and verify steps (runtime/invariance.py); dispatch: how tokens travel to MoE experts."""

    mtp: int = 0
    graphs: bool = False
    invariant: bool = False
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)

    def planned_rows(self, batch: int) -> int | None:
        """The rows batch-invariant steps of a call of `batch` requests are planned for: the longest verify
        step any draft count could make, so that a plain and a speculative call take the same paths; None when
        the steps are not batch-invariant."""
        return batch * (MAX_DRAFTS + 1) if self.invariant else None


def run_options(model: Qwen35, mtp: int = 0, graphs: bool | None = None, invariant: bool | None = None,
                dispatch: str | None = None) -> RunOptions:
    """The options a command runs `model` with. graphs: by default where the device supports them (MoE too: its
    routing stays on the device in shapes fixed by the batch; a split model's steps too, their collectives
    captured with them). invariant: as asked, else on with MTP (a verify step then rounds as the decode steps it
    stands for, so greedy MTP output is greedy output - to compare the two, ask for it in the plain run too) and
    off without, and off on several devices (their expert-parallel exchange sizes its kernels by the step: not
    shown invariant yet); only where the Triton kernels run - elsewhere the references run, which the setting
    does not change. dispatch: one of DISPATCH_CHOICES, else the environment's default (dispatch.BF16_ENV /
    INT8_ENV) or the innermost dispatch() block's."""
    from npuport.devices import graphs_supported, runs_triton

    if not 0 <= mtp <= MAX_DRAFTS:
        raise NpuportError(f"--mtp must be between 0 and {MAX_DRAFTS}, got {mtp}")
    if mtp and model.mtp is None:
        raise NpuportError("this checkpoint has no MTP head (mtp.*); speculative decoding needs one")
    supported = graphs_supported(model.device)
    if graphs and not supported:
        raise NpuportError(f"graph capture is not available on {model.device}")
    if dispatch is not None and dispatch not in DISPATCH_CHOICES:
        raise NpuportError(f"unknown dispatch {dispatch!r}; choose one of {', '.join(DISPATCH_CHOICES)}")
    if not runs_triton(model.device):
        invariant = False
    elif invariant is None:
        invariant = mtp > 0 and not model.parallel.active
    return RunOptions(mtp=mtp, graphs=supported if graphs is None else graphs, invariant=invariant,
                      dispatch=current_dispatch() if dispatch is None else DispatchConfig(DISPATCH_CHOICES[dispatch]))
