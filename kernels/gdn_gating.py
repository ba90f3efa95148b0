"""GatedDeltaNet gating: the per-token, per-value-head decay `g` (log space) and write strength `beta`.

Computed in fp32 (or wider when the inputs are float64), as the engines' fused gating kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from npuport.kernels.implementations import TRITON, runnable
from npuport.kernels.launch import jit, launch, launch_options, persistent_grid, tl, use_triton

SOFTPLUS_THRESHOLD = 20.0


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype GDN math and recurrent states use for activations of `dtype`: fp32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def fused_gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A_log, dt_bias [HV]; a, b [B, T, HV] (outputs of in_proj_a / in_proj_b) ->
    g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b), both [B, T, HV] in fp32."""
    if runnable("gdn_gating", a.device, None, use_triton(a, b)) == TRITON:  # no native form: Triton on an NPU too
        return fused_gdn_gating_triton(A_log, a, dt_bias, b)
    return fused_gdn_gating_reference(A_log, a, dt_bias, b)


def fused_gdn_gating_reference(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    acc = state_dtype(a.dtype)
    g = -A_log.to(acc).exp() * F.softplus(a.to(acc) + dt_bias.to(acc), beta=1.0, threshold=SOFTPLUS_THRESHOLD)
    beta = torch.sigmoid(b.to(acc))
    return g, beta


@jit
def softplus(x):
    """log(1 + exp(x)) in fp32, x itself above the threshold 20 (as torch's softplus)."""
    stable = tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))
    return tl.where(x > 20.0, x, stable)


# NPU budget: two [BLOCK_ROWS, BLOCK_HV] fp32 inputs and two outputs, 64 x 64 x 4 B x 4 = 64 KiB at most.
@jit
def _gdn_gating_kernel(A_log, a, dt_bias, b, g_out, beta_out, n_rows, HV: tl.constexpr,
                       BLOCK_ROWS: tl.constexpr, BLOCK_HV: tl.constexpr):
    heads = tl.arange(0, BLOCK_HV)
    head_ok = heads < HV
    neg_rate = -tl.exp(tl.load(A_log + heads, mask=head_ok, other=0.0).to(tl.float32))
    bias = tl.load(dt_bias + heads, mask=head_ok, other=0.0).to(tl.float32)
    n_blocks = (n_rows + BLOCK_ROWS - 1) // BLOCK_ROWS
    for block in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
        rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        offs = rows[:, None].to(tl.int64) * HV + heads[None, :]
        ok = (rows < n_rows)[:, None] & head_ok[None, :]
        x = tl.load(a + offs, mask=ok, other=0.0).to(tl.float32) + bias[None, :]
        logit = tl.load(b + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(g_out + offs, neg_rate[None, :] * softplus(x), mask=ok)
        tl.store(beta_out + offs, 1.0 / (1.0 + tl.exp(-logit)), mask=ok)


def fused_gdn_gating_triton(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel behind fused_gdn_gating (any device; CPU tensors run in Triton's interpreter)."""
    hv = a.shape[-1]
    a, b = a.contiguous(), b.contiguous()
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    n_rows = a.numel() // hv
    block_hv = max(16, 1 << (hv - 1).bit_length())
    block_rows = max(1, min(64, 4096 // block_hv))
    grid = persistent_grid(a.device, -(-n_rows // block_rows))
    launch(_gdn_gating_kernel, grid, A_log, a, dt_bias, b, g, beta, n_rows, HV=hv, BLOCK_ROWS=block_rows,
           BLOCK_HV=block_hv, **launch_options(a.device, num_warps=4))
    return g, beta
