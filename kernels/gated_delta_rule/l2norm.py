"""Scaling rows to unit length (q and k of the gated delta rule): the PyTorch version and the Triton one
the kernels inline, side by side."""

from __future__ import annotations

import torch

from npuport.kernels.launch import jit, tl

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] with each row divided by sqrt(|row|^2 + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


@jit
def unit_rows(x, L2NORM: tl.constexpr):
    """x [rows, K] fp32 with each row scaled to unit length (when L2NORM), as l2norm."""
    if L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
    return x
