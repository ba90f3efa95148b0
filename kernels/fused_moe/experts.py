"""The experts of one MoE layer stacked into single tensors, as the kernels read them (BF16, int8, or int4 pairs
packed into int8 bytes), and whether a shared expert can ride along with the routed ones."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StackedExperts:
    """E experts of intermediate size I over hidden size H.

    gate_up [E, 2I, H]: expert e's gate_proj rows [0, I), its up_proj rows [I, 2I) (the fused layout of the
    published checkpoints); down [E, H, I]. BF16 (the model's float dtype), or int8 with per-output-channel
    scales gate_up_scale [E, 2I] and down_scale [E, H] fp32 (W8A8_DYNAMIC, symmetric: no offsets).

    int4 (W4A8_DYNAMIC, read as int4 from memory): the int8 tensors hold the int4 values [-8, 7] two to a byte, in
    pairs of rows as msModelSlim packs them (convert/w4a8.py): gate_up int8 [E, I, H], down int8 [E, H/2, I], byte
    [j, k] = (q[2j + 1, k] << 4) | (q[2j, k] & 0xF) - row 2j its low nibble, row 2j + 1 its high one; the scales as
    int8's, one per row of the unpacked weight. unpacked() gives the int8 experts of the same values."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    int4: bool = False

    def __post_init__(self) -> None:
        if self.int4 and (self.gate_up.dtype != torch.int8 or self.down.dtype != torch.int8 or self.down_scale is None
                          or self.down_scale.shape[1] != 2 * self.down.shape[1]):
            raise ValueError("int4 experts hold int8 bytes of packed row pairs, with a scale for each unpacked row")

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
        return self.down.shape[1] * (2 if self.int4 else 1)

    def unpacked(self) -> StackedExperts:
        """The int8 experts of the same values (self when not int4): each byte's nibbles sign-extended into rows 2j
        (low) and 2j + 1 (high) - a new [E, 2I, H] / [E, H, I] copy, made by PyTorch."""
        if not self.int4:
            return self
        return StackedExperts(unpack_int4_rows(self.gate_up), unpack_int4_rows(self.down), self.gate_up_scale,
                              self.down_scale)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """int8 [..., N/2, K] of packed row pairs -> int8 [..., N, K]: row 2j the low nibble of byte row j, row 2j + 1
    its high nibble, each sign-extended ((b << 4) >> 4 and b >> 4: arithmetic shifts of int8)."""
    low = torch.bitwise_right_shift(torch.bitwise_left_shift(packed, 4), 4)
    high = torch.bitwise_right_shift(packed, 4)
    return torch.stack((low, high), dim=-2).reshape(*packed.shape[:-2], 2 * packed.shape[-2], packed.shape[-1])


def shares_layout(experts: StackedExperts, shared: StackedExperts) -> bool:
    """Whether the kernels can run `shared` (one expert) as one more slot of `experts`: the same kind (BF16 or
    int8) or a float or int8 one beside int8 or int4 experts (the W8A8 and W4A8 recipes keep shared experts
    FLOAT; a shared expert is never int4), the same widths (int4 experts' unpacked ones) and row strides (a
    packed byte row spans as many elements as a row of the shared expert)."""
    pairs = ((shared.gate_up, experts.gate_up), (shared.down, experts.down))
    rows = 2 if experts.int4 else 1
    return (shared.num_experts == 1 and not shared.int4 and (shared.quantized == experts.quantized or experts.quantized)
            and all(a.shape[1:] == (rows * b.shape[1], b.shape[2]) and a.stride()[1:] == b.stride()[1:]
                    == (b.shape[2], 1) for a, b in pairs))
