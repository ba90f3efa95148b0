"""GatedDeltaNet gating: the per-token, per-value-head decay `g` (log space) and write strength `beta`.

Computed in fp32 (or wider when the inputs are float64), as the engines' fused gating kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype GDN math and recurrent states use for activations of `dtype`: fp32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def fused_gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A_log, dt_bias [HV]; a, b [B, T, HV] (outputs of in_proj_a / in_proj_b) ->
    g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b), both [B, T, HV] in fp32."""
    return fused_gdn_gating_reference(A_log, a, dt_bias, b)


def fused_gdn_gating_reference(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    acc = state_dtype(a.dtype)
    g = -A_log.to(acc).exp() * F.softplus(a.to(acc) + dt_bias.to(acc), beta=1.0, threshold=20.0)
    beta = torch.sigmoid(b.to(acc))
    return g, beta
