"""The batch-invariant setting (runtime/invariance.py) reaches the layers: float linear layers, stacked ones and the
lm_head take the invariant GEMM inside batch_invariant(), and the MoE experts, planned for the call's largest step,
give each token the bits it gets in that largest step (Triton's interpreter on CPU tensors)."""

from __future__ import annotations

import pytest
import torch

import npuport.kernels.launch as launch_module
from npuport.kernels.fused_moe import GROUPED, MATVEC, grouped_config, matvec_config, plan_experts_triton
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


@pytest.mark.parametrize("plan", [None, 12, 17])
def test_moe_steps_take_the_path_and_tiles_of_the_largest_planned_step(plan):
    """A one-token step planned for 12 tokens (96 routed pairs) takes the matvec kernels with the tiles of 12
    tokens; planned for 17 (136 pairs), the grouped GEMMs; unplanned, its own size's. (Whether the two paths'
    bits differ is the GPU's to show: in the interpreter both sum in numpy's order.)"""
    x = torch.randn(1, HIDDEN).bfloat16()
    ids = routings(1, 8, 16, "random", seed=1)
    got = plan_experts_triton(x, random_experts(16, False, seed=5), ids, plan_tokens=plan)
    want = {None: (MATVEC, matvec_config(8)), 12: (MATVEC, matvec_config(96)),
            17: (GROUPED, grouped_config(136, 16, x.device))}[plan]
    assert (got.path, got.matvec or got.grouped) == want


def test_invariance_is_on_by_default_with_mtp_where_the_triton_kernels_run(monkeypatch, tiny_checkpoints):
    import npuport.devices as devices_module
    from npuport.runtime.loader import load_model
    from npuport.runtime.run_options import run_options

    def invariant(asked, mtp):
        return run_options(model, mtp, invariant=asked).invariant

    model = load_model(tiny_checkpoints["dense-text"], "cpu", torch.float32)
    assert not any(invariant(asked, mtp) for asked in (None, True, False) for mtp in (0, 2))
    monkeypatch.setattr(devices_module, "runs_triton", lambda device: True)
    assert [invariant(None, mtp) for mtp in (0, 1, 4)] == [False, True, True]
    assert invariant(True, 0) and not invariant(False, 3)
    monkeypatch.setattr(type(model.parallel), "active", property(lambda self: True))  # as on several devices
    assert not invariant(None, 2) and invariant(True, 2)


def test_verify_steps_give_the_bits_of_decode_steps_in_bf16_on_the_kernels(monkeypatch, tiny_checkpoints,
                                                                            one_cpu_thread):
    """BF16 on CPU with the kernels of a GPU / NPU (Triton's interpreter), as batch-invariant steps run them: a
    verify step of 2 tokens gives its first row's logits the bits of the decode step of that row, and after keeping
    that token (replayed into the GDN states by the next step) the next step's logits are those of a state that
    decoded it. The prompt is prefilled on the references (a prefill is no step). Each interpreted step takes ~6 s:
    hence one request and one kept token; the GPU test covers more (test_kernels_on_gpu.py)."""
    from npuport.runtime.loader import load_model
    from npuport.runtime.prefill import pad_prompts, prefill
    from npuport.runtime.state import commit_accepted

    model = load_model(tiny_checkpoints["moe-multimodal-fused"], "cpu", torch.bfloat16)
    tokens, lengths = pad_prompts([[1000, 3, 77, 640, 12, 18, 901, 5]], model.device)
    plain, spec = model.new_state(1, 32), model.new_state(1, 32, 1)
    for state in (plain, spec):
        prefill(model, state, tokens, lengths)
    monkeypatch.setattr(launch_module, "runs_triton", lambda device: True)
    monkeypatch.setattr("npuport.kernels.implementations.runs_triton", lambda device: True)  # CPU as a Triton device
    drafts, following = torch.tensor([[5, 6]]), torch.tensor([[11]])

    def step(state, tok, keep):
        logits = model.logits(model.step(tok, state))
        commit_accepted(state, torch.full((1,), keep), tok.shape[1])
        return logits

    with batch_invariant(5):
        verified = step(spec, drafts, 1)
        assert torch.equal(verified[:, :1], step(plain, drafts[:, :1], 1))
        assert torch.equal(step(spec, following, 1), step(plain, following, 1))
