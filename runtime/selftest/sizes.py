"""The widths and steps the kernel checks of `npuport selftest` run at: two published models' (on an accelerator)
and small ones Triton's interpreter runs in seconds (on the CPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

EPS = 1e-6
BF16 = torch.bfloat16
CONV_WIDTH = 4  # linear_conv_kernel_dim of every Qwen3.5
VERIFY_DRAFTS = 3  # the conv window keeps W - 1 + k columns for MTP k drafts: k = 3, as the GPU tests


@dataclass(frozen=True)
class Widths:
    """The sizes a check takes from a model. The published ones are restated from the fixtures' REAL_MODELS (the
    runtime does not import the fixtures; tests/test_selftest.py holds the two to each other)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    key_heads: int  # GatedDeltaNet
    value_heads: int
    key_dim: int
    value_dim: int
    experts: int  # 0: dense
    top_k: int
    expert_intermediate: int

    @property
    def rotary(self) -> int:
        """Rotated dims of a head: every Qwen3.5 rotates a quarter (partial_rotary_factor 0.25)."""
        return self.head_dim // 4

    @property
    def conv_channels(self) -> int:
        """Channels of a GatedDeltaNet's conv: q | k | v."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def qkv_out(self) -> int:
        """Rows of a full-attention layer's stacked q (with its gate) | k | v projection."""
        return 2 * self.heads * self.head_dim + 2 * self.kv_heads * self.head_dim


# Qwen3.5-35B-A3B and -27B: the MoE and the dense published widths.
MODEL_WIDTHS = (
    Widths("35B-A3B", hidden=2048, heads=16, kv_heads=2, head_dim=256, key_heads=16, value_heads=32, key_dim=128,
           value_dim=128, experts=256, top_k=8, expert_intermediate=512),
    Widths("27B", hidden=5120, heads=24, kv_heads=4, head_dim=256, key_heads=16, value_heads=48, key_dim=128,
           value_dim=128, experts=0, top_k=0, expert_intermediate=0),
)
# What Triton's interpreter runs in seconds: about the trained tiny model's widths, with heads of 64.
INTERPRETER_WIDTHS = Widths("small", hidden=128, heads=4, kv_heads=2, head_dim=64, key_heads=2, value_heads=4,
                            key_dim=32, value_dim=32, experts=8, top_k=2, expert_intermediate=64)


@dataclass(frozen=True)
class Step:
    """A runtime step a check stands for: `requests` requests of `tokens` tokens each."""

    name: str  # decode | verify | prefill
    requests: int
    tokens: int

    @property
    def rows(self) -> int:
        return self.requests * self.tokens


DECODE, VERIFY = Step("decode", 1, 1), Step("verify", 4, 1 + VERIFY_DRAFTS)
PREFILL = Step("prefill", 1, 256)
# In the interpreter: a decode step of 1 request, 2 requests verifying 2 tokens; a prefill past one GDN chunk of 64
# tokens, and of more routed pairs (70 tokens x top-2) than the MoE matvec kernels take, so that the grouped GEMMs run.
INTERPRETER_DECODE, INTERPRETER_VERIFY = Step("decode", 1, 1), Step("verify", 2, 2)
INTERPRETER_PREFILL = Step("prefill", 1, 70)
