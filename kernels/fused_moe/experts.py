"""The experts of one MoE layer stacked into single tensors, as the kernels read them, and whether a shared expert
can ride along with the routed ones."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StackedExperts:
    """E experts of intermediate size I over hidden size H.

    gate_up [E, 2I, H]: expert e's gate_proj rows [0, I), its up_proj rows [I, 2I) (the fused layout of the
    published checkpoints); down [E, H, I]. BF16 (the model's float dtype), or int8 with per-output-channel
    scales gate_up_scale [E, 2I] and down_scale [E, H] fp32 (W8A8_DYNAMIC, symmetric: no offsets)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.gate_up.dtype == torch.int8

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def intermediate(self) -> int:
        return self.down.shape[2]

    @property
    def hidden(self) -> int:
        return self.down.shape[1]


def shares_layout(experts: StackedExperts, shared: StackedExperts) -> bool:
    """Whether the kernels can run `shared` (one expert) as one more slot of `experts`: the same kind (BF16 or
    int8) or a float one beside int8 experts (the W8A8 recipes keep shared experts FLOAT), the same widths and
    row strides."""
    pairs = ((shared.gate_up, experts.gate_up), (shared.down, experts.down))
    return (shared.num_experts == 1 and (shared.quantized == experts.quantized or experts.quantized)
            and all(a.shape[1:] == b.shape[1:] and a.stride()[1:] == b.stride()[1:] == (b.shape[2], 1)
                    for a, b in pairs))
