"""Linear layers by label: `Linear` for FLOAT (BF16 or the model's float dtype), `W8A8Linear` for
W8A8_DYNAMIC (int8 weight with per-channel scales, int8 activations with per-token scales)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from npuport.kernels.invariant_linear import invariant_linear
from npuport.kernels.w8a8 import int8_matmul_rescale, quantize_per_token_int8
from npuport.runtime.dispatch import DispatchError
from npuport.runtime.invariance import current_invariance


@dataclass
class QuantizedActivation:
    """Tokens already quantized for a W8A8 layer: values int8 [M, K], scales fp32 [M, 1]."""

    values: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def quantize(cls, x: torch.Tensor) -> QuantizedActivation:
        """x [M, K] -> its per-token int8 form."""
        return cls(*quantize_per_token_int8(x))

    def __getitem__(self, rows: torch.Tensor) -> QuantizedActivation:
        return QuantizedActivation(self.values[rows], self.scales[rows])


class Linear(nn.Module):
    """y = x W^T without bias; weight [N, K] in the model's float dtype."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, QuantizedActivation):
            raise DispatchError("int8 tokens reached a BF16 linear layer, which cannot take them")
        return float_linear(x, self.weight)


def float_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T: the vendor GEMM, or inside batch_invariant() the kernel whose rows do not depend on the batch."""
    if current_invariance() is not None:
        return invariant_linear(x, weight)
    return F.linear(x, weight)


class W8A8Linear(nn.Module):
    """y = (x_q @ W_q^T) * s_x * s_w: weight int8 [N, K], weight_scale fp32 [N, 1]. Takes float tokens
    (quantized here, per token) or a QuantizedActivation (int8 dispatch); returns out_dtype."""

    def __init__(self, in_features: int, out_features: int, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features, self.out_dtype = in_features, out_features, out_dtype
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.empty(out_features, 1, dtype=torch.float32))

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        if isinstance(x, QuantizedActivation):
            return int8_matmul_rescale(x.values, x.scales, self.weight, self.weight_scale, self.out_dtype)
        lead = x.shape[:-1]
        qx = QuantizedActivation.quantize(x.reshape(-1, self.in_features))
        y = int8_matmul_rescale(qx.values, qx.scales, self.weight, self.weight_scale, x.dtype)
        return y.reshape(*lead, self.out_features)


class StackedLinear:
    """Several linear layers over the same input as one: their weights (and W8A8 scales) concatenated into
    weight [sum N, K] (scale [sum N, 1]), each layer's own weight a view of its rows. One GEMM - and, for W8A8,
    one quantization of the input - instead of one per layer. Built by stack_linears after loading; a plain
    object, not a module, so the state dict keeps the checkpoint's names."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None, widths: list[int],
                 out_dtype: torch.dtype | None = None) -> None:
        self.weight, self.scale, self.widths, self.out_dtype = weight, scale, widths, out_dtype

    def __call__(self, x: torch.Tensor | QuantizedActivation) -> tuple[torch.Tensor, ...]:
        """x [..., K] -> one output per stacked layer, [..., N_i] each: views of one [..., sum N] result."""
        if self.scale is None:
            if isinstance(x, QuantizedActivation):
                raise DispatchError("int8 tokens reached a BF16 linear layer, which cannot take them")
            return float_linear(x, self.weight).split(self.widths, dim=-1)
        if isinstance(x, QuantizedActivation):
            y = int8_matmul_rescale(x.values, x.scales, self.weight, self.scale, self.out_dtype)
            return y.split(self.widths, dim=-1)
        lead = x.shape[:-1]
        qx = QuantizedActivation.quantize(x.reshape(-1, x.shape[-1]))
        y = int8_matmul_rescale(qx.values, qx.scales, self.weight, self.scale, x.dtype)
        return y.view(*lead, -1).split(self.widths, dim=-1)


@torch.no_grad()
def stack_linears(layers: Sequence[Linear | W8A8Linear]) -> StackedLinear | None:
    """The layers (same input width) as one StackedLinear, their tensors moved into it (each layer's weight and
    scale become views of its rows; the separate tensors are freed). None, and nothing changed, unless they are
    all FLOAT or all W8A8 - a W8A8 artifact may keep some of them FLOAT."""
    kinds = {type(layer) for layer in layers}
    if len(kinds) != 1 or kinds.pop() not in (Linear, W8A8Linear):
        return None
    names = ["weight", "weight_scale"] if isinstance(layers[0], W8A8Linear) else ["weight"]
    widths = [layer.out_features for layer in layers]
    stacked = {}
    for name in names:
        stacked[name] = torch.cat([getattr(layer, name) for layer in layers])
        for layer, part in zip(layers, stacked[name].split(widths), strict=True):
            setattr(layer, name, nn.Parameter(part, requires_grad=False) if name in layer._parameters else part)
    return StackedLinear(stacked["weight"], stacked.get("weight_scale"), widths, getattr(layers[0], "out_dtype", None))


def project(stacked: StackedLinear | None, layers: Sequence[nn.Module], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x through each of `layers`: one GEMM when they were stacked into `stacked`, else one per layer."""
    if stacked is not None:
        return stacked(x)
    return tuple(layer(x) for layer in layers)
