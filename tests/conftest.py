"""Shared fixtures: tiny Qwen3.5 checkpoints generated once per test session (never downloaded)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from npuport.fixtures.tiny_checkpoint import TinySpec, make_tiny

CHECKPOINT_KINDS = {
    "dense-multimodal": TinySpec(arch="dense", layout="multimodal"),
    "dense-text": TinySpec(arch="dense", layout="text"),
    "moe-multimodal-fused": TinySpec(arch="moe", layout="multimodal", mtp_experts="fused"),
    "moe-text-per-expert": TinySpec(arch="moe", layout="text", mtp_experts="per-expert"),
}


@pytest.fixture(scope="session", autouse=True)
def signals_of_a_foreground_command() -> None:
    """The signal tests send SIGINT as Ctrl-C reaches a command run in a terminal. A suite started in the background
    of a script without job control (`pytest ... &`, as runners and nohup start it) inherits SIGINT ignored, and so
    does every command it starts, which then rightly ignores Ctrl-C: those tests would fail for a reason not theirs.
    So the suite takes a foreground command's dispositions (its children inherit them)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """kind -> path of a tiny BF16 source checkpoint, for every kind in CHECKPOINT_KINDS."""
    root = tmp_path_factory.mktemp("sources")
    return {kind: make_tiny(root / kind, spec) for kind, spec in CHECKPOINT_KINDS.items()}


@pytest.fixture(scope="session")
def tiny_artifacts(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """kind -> path of the W8A8 artifact convert_qwen35 writes from that tiny source (default recipe)."""
    from npuport.convert.converter import convert_qwen35

    root = tmp_path_factory.mktemp("artifacts")
    return {kind: convert_qwen35(src, root / kind, show_progress=False, log=lambda _: None).out
            for kind, src in tiny_checkpoints.items()}


@pytest.fixture(scope="session")
def qwen36_artifacts(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """kind -> the W8A8 artifact of a dense tiny source under the shipped Qwen3.6-27B recipe (qwen3_6_27b_w8a8,
    msModelSlim's: attention, MLP, visual blocks and the GatedDeltaNet in_proj_qkv / in_proj_z quantized)."""
    from npuport.convert.converter import convert_qwen35
    from npuport.convert.recipe import recipe_path_for

    root = tmp_path_factory.mktemp("qwen36-artifacts")
    recipe = recipe_path_for("qwen3_6_27b_w8a8")
    return {kind: convert_qwen35(tiny_checkpoints[kind], root / kind, recipe_path=recipe, show_progress=False,
                                 log=lambda _: None).out for kind in ("dense-multimodal", "dense-text")}


@pytest.fixture(scope="session")
def w4a8_artifact(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The W4A8 artifact of the per-expert MoE tiny source under the shipped qwen3_5_moe_w4a8 recipe: its routed
    experts W4A8_DYNAMIC (int4 packed two to a byte), the rest as W8A8."""
    from npuport.convert.converter import convert_qwen35
    from npuport.convert.recipe import recipe_path_for

    return convert_qwen35(tiny_checkpoints["moe-text-per-expert"], tmp_path_factory.mktemp("w4a8") / "artifact",
                          recipe_path=recipe_path_for("qwen3_5_moe_w4a8"), show_progress=False,
                          log=lambda _: None).out


@pytest.fixture(scope="module")
def one_cpu_thread():
    """One intra-op thread for a module: tiny models on a shared 2-core CPU run many times faster than with a
    contended thread pool. Restores the previous setting afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
