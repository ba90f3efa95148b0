"""The batch-invariant setting (runtime/invariance.py) reaches the layers: float linear layers, stacked ones and the
lm_head take the invariant GEMM inside batch_invariant(), and the MoE experts, planned for the call's largest step,
give each token the bits it gets in that largest step (Triton's interpreter on CPU tensors)."""

from __future__ import annotations

import importlib

import pytest
import torch

import npuport.kernels.launch as launch_module
from npuport.kernels.fused_moe import fused_experts_triton, grouped_config
from npuport.kernels.fused_moe.few_tokens import few_tokens_config
from npuport.kernels.invariant_linear import invariant_linear_reference
from npuport.runtime.invariance import batch_invariant, current_invariance
from npuport.runtime.linear import Linear, stack_linears
from tests.test_kernels_fused_moe import HIDDEN, random_experts, routings


def test_linear_layers_take_the_invariant_gemm_inside_the_setting(monkeypatch):
    calls = []
    monkeypatch.setattr("npuport.runtime.linear.invariant_linear",
                        lambda x, w: calls.append(x.shape) or invariant_linear_reference(x, w))
    gen = torch.Generator().manual_seed(0)
    layers = [Linear(16, n) for n in (8, 4)]
    for layer in layers:
        layer.weight.data = torch.randn(layer.out_features, 16, generator=gen)
    x = torch.randn(3, 16, generator=gen)
    fast = [layer(x) for layer in layers]
    stacked = stack_linears(layers)
    assert not calls and current_invariance() is None
    with batch_invariant(10):
        assert current_invariance().rows == 10
        got = [layer(x) for layer in layers] + list(stacked(x))
    assert len(calls) == 3 and current_invariance() is None
    for g, f in zip(got, fast + fast, strict=True):
        torch.testing.assert_close(g, f)


class Chosen(Exception):
    """Raised by a stand-in kernel once the path is known."""


@pytest.mark.parametrize("plan", [None, 12, 17])
def test_moe_steps_take_the_path_and_tiles_of_the_largest_planned_step(monkeypatch, plan):
    """A one-token step planned for 12 tokens (96 routed pairs) takes the mat-vec kernels with the tiles of 12
    tokens; planned for 17 (136 pairs), the grouped GEMMs; unplanned, its own size's. (Whether the two paths'
    bits differ is the GPU's to show: in the interpreter both sum in numpy's order.)"""
    module = importlib.import_module("npuport.kernels.fused_moe.fused_experts")  # the package's name is a function
    monkeypatch.setattr(launch_module, "runs_triton", lambda device: True)
    seen = []

    def mat_vec(*args, **kwargs):
        seen.append(args[6])
        raise Chosen

    def grouped(*args, **kwargs):
        seen.append(args[7])
        raise Chosen

    monkeypatch.setattr(module, "few_tokens_experts", mat_vec)
    monkeypatch.setattr(module, "grouped_gemm", grouped)
    x = torch.randn(1, HIDDEN).bfloat16()
    ids, weights = routings(1, 8, 16, "random", seed=1), torch.full((1, 8), 0.125).bfloat16()
    with pytest.raises(Chosen):
        fused_experts_triton(x, random_experts(16, False, seed=5), weights, ids, plan_tokens=plan)
    want = {None: few_tokens_config(8), 12: few_tokens_config(96), 17: grouped_config(136, 16, x.device)}[plan]
    assert seen == [want]
