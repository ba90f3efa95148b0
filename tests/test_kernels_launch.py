"""The interpreter launch (kernels/launch.py) leaves Triton as it found it: after a kernel ran on CPU tensors -
calling a @jit helper, as our kernels do - triton.language is what it was and Triton compiles for a GPU."""

from __future__ import annotations

import inspect

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from npuport.kernels.launch import launch  # noqa: E402


@triton.jit
def _doubled(x):
    return x + x


@triton.jit
def _double_kernel(src, dst, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK) + (n + BLOCK - 1) // BLOCK * 0
    mask = offsets < n
    tl.store(dst + offsets, _doubled(tl.load(src + offsets, mask=mask)), mask=mask)


def language_bindings() -> dict[str, dict[str, object]]:
    namespaces = {"tl": tl, "tl.core": tl.core, "tl.math": tl.math, "tl.tensor": tl.core.tensor}
    return {label: {name: value for name, value in vars(ns).items() if not inspect.ismodule(value)}
            for label, ns in namespaces.items()}


def test_an_interpreted_launch_with_a_jit_helper_leaves_triton_language_unchanged() -> None:
    before = language_bindings()
    src = torch.arange(5, dtype=torch.float32)
    dst = torch.zeros(8)
    launch(_double_kernel, (1,), src, dst, 5, BLOCK=8)
    assert dst.tolist() == [0, 2, 4, 6, 8, 0, 0, 0]
    after = language_bindings()
    changed = {label: sorted(name for name in set(before[label]) | set(after[label])
                             if before[label].get(name) is not after[label].get(name)) for label in before}
    assert all(not names for names in changed.values()), changed


def test_triton_compiles_for_a_gpu_after_an_interpreted_launch(tmp_path, monkeypatch) -> None:
    """The consequence that broke CI: the AOT compile of a kernel after interpreted launches, with a cache that
    cannot answer for it (a cached binary would skip code generation and hide the fault)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from npuport.kernels.gated_rms_norm import gated_rms_norm_triton
    from npuport.kernels.rms_norm import add_rms_norm_triton

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    x, weight = torch.randn(2, 64), torch.ones(64)
    gated_rms_norm_triton(x, torch.randn(2, 64), weight, 1e-6)  # kernels that call @jit helpers
    add_rms_norm_triton(x, torch.randn(2, 64), weight, 1e-6)
    signature = {"src": "*fp32", "dst": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    compiled = triton.compile(ASTSource(_double_kernel, signature, {"BLOCK": 64}), target=GPUTarget("cuda", 90, 32))
    assert "st.global" in compiled.asm["ptx"]


def test_gpu_launch_options_state_contraction_rather_than_inherit_triton_s_default() -> None:
    """Triton 3.10 turns fp fusion off by default; the batch-invariant kernels need it off and the others were
    measured with it on, so every GPU launch says which (every launcher takes its options from launch_options)."""
    from npuport.kernels.launch import launch_options

    cuda = torch.device("cuda")
    assert launch_options(cuda, num_warps=4)["enable_fp_fusion"] is True
    assert launch_options(cuda, num_warps=4, contract=False)["enable_fp_fusion"] is False
    assert "enable_fp_fusion" not in launch_options(torch.device("cpu"), num_warps=4)
