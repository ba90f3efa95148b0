"""The ignore-list as convert-qwen35 prints it and the model card lists it: one rule for both - every kind of layer
kept BF16 is named (the GatedDeltaNet and shared-expert layers of a MoE source were cut off before), with its count,
under its reason."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from npuport.cli import main


def kinds_by_reason(manifest: dict) -> dict[str, dict[str, int]]:
    """reason -> {layer kind (layer numbers as *): count}, from the manifest's own ignore-list."""
    out: dict[str, dict[str, int]] = {}
    for entry in manifest["ignore_list"]:
        kind = re.sub(r"\.\d+(?=\.|$)", ".*", entry["module"])
        kinds = out.setdefault(entry["reason"], {})
        kinds[kind] = kinds.get(kind, 0) + 1
    return out


@pytest.mark.parametrize("kind", ["moe-text-per-expert", "dense-multimodal"])
def test_every_kind_of_layer_kept_bf16_is_named_in_the_log_and_the_card(tiny_checkpoints, tmp_path, kind):
    art = tmp_path / "art"
    result = CliRunner().invoke(main, ["convert-qwen35", "--a8w8", str(tiny_checkpoints[kind]), str(art), "--quiet"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((art / "npuport_manifest.json").read_text())
    expected = kinds_by_reason(manifest)
    if kind.startswith("moe"):
        named = {k for kinds in expected.values() for k in kinds}
        assert any(".linear_attn.in_proj_qkv" in k for k in named) and any(".shared_expert." in k for k in named)
    lines = [line for line in result.output.splitlines() if line.startswith("  FLOAT")]
    assert len(lines) == len(expected)
    for reason, kinds in expected.items():
        line = next(text for text in lines if f"  {reason}: " in text)
        assert line.startswith(f"  FLOAT {sum(kinds.values()):4d}  {reason}: ")
        for layer_kind, n in kinds.items():
            assert (f"{layer_kind} ({n})" if n > 1 else layer_kind) in line, (layer_kind, line)
    release = tmp_path / "release"
    packaged = CliRunner().invoke(main, ["package", str(art), "--out", str(release), "--force"])
    assert packaged.exit_code == 0, packaged.output
    card = (release / "README.md").read_text()
    for kinds in expected.values():
        for layer_kind, n in kinds.items():
            assert (f"`{layer_kind}` ({n})" if n > 1 else f"`{layer_kind}`") in card
