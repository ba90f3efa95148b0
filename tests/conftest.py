"""Shared fixtures: tiny Qwen3.5 checkpoints generated once per test session (never downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from npuport.tiny_checkpoint import TinySpec, make_tiny

CHECKPOINT_KINDS = {
    "dense-multimodal": TinySpec(arch="dense", layout="multimodal"),
    "dense-text": TinySpec(arch="dense", layout="text"),
    "moe-multimodal-fused": TinySpec(arch="moe", layout="multimodal", mtp_experts="fused"),
    "moe-text-per-expert": TinySpec(arch="moe", layout="text", mtp_experts="per-expert"),
}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """kind -> path of a tiny BF16 source checkpoint, for every kind in CHECKPOINT_KINDS."""
    root = tmp_path_factory.mktemp("sources")
    return {kind: make_tiny(root / kind, spec) for kind, spec in CHECKPOINT_KINDS.items()}
