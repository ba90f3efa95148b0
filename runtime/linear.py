"""Linear layers by label: `Linear` for FLOAT (BF16 or the model's float dtype), `W8A8Linear` for
W8A8_DYNAMIC (int8 weight with per-channel scales, int8 activations with per-token scales)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from npuport.kernels.w8a8 import int8_matmul_rescale, quantize_per_token_int8
from npuport.runtime.dispatch import DispatchError


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
        return F.linear(x, self.weight)


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
