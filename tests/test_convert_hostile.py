"""Hostile inputs to `convert-qwen35`: each is refused in one `error:` line naming the culprit (the recipe file
and key, the option, the shard), with exit status 1, no traceback and nothing left beside OUT; a recipe that
would quantize nothing never yields an artifact labelled W8A8."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from npuport.cli import main
from npuport.convert.safetensors_io import read_header
from tests.test_input_paths import one_line_error

RECIPE = """\
apiversion: modelslim_v1
metadata:
  config_id: hostile_test
spec:
  process:
    - type: "linear_quant"
      qconfig: &dyn
        act: {scope: "per_token", dtype: "int8", symmetric: True, method: "minmax"}
        weight: {scope: "per_channel", dtype: "int8", symmetric: True, method: "minmax"}
      include: ["*self_attn*"]
      exclude: ["mtp*"]
    - type: "linear_quant"
      qconfig: *dyn
      include: ["*mlp*"]
      exclude: ["*visual*"]
  save:
    - type: "ascendv1_saver"
      part_file_size: 4
"""


def edited(old: str, new: str) -> str:
    assert old in RECIPE
    return RECIPE.replace(old, new, 1)


@pytest.fixture
def src(tiny_checkpoints) -> Path:
    return tiny_checkpoints["dense-multimodal"]


def convert(src: Path, out: Path, *extra: str):
    return CliRunner().invoke(main, ["convert-qwen35", "--a8w8", str(src), str(out), "--quiet", *extra])


def error_line(result, out: Path, *needles: str) -> str:
    """The one `error:` line of a failed run (exit 1, no traceback, nothing of OUT left), holding every needle."""
    line = one_line_error(result, *needles)
    assert not out.exists() and not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]
    return line


def recipe_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------------------
# Recipe files


def test_a_huge_integer_in_a_recipe_is_one_line_naming_the_file_and_key(src, tmp_path):
    """Python refuses to convert a 5,000-digit string to an int (its int_max_str_digits limit)."""
    out = tmp_path / "out"
    for old, new, key in [("part_file_size: 4", "part_file_size: " + "7" * 5000, "spec.save[0].part_file_size"),
                          ("config_id: hostile_test", "config_id: " + "9" * 5000, "metadata.config_id")]:
        recipe = recipe_file(tmp_path, edited(old, new))
        line = error_line(convert(src, out, "--recipe", str(recipe)), out, str(recipe), key)
        assert len(line) < len(str(recipe)) + 200


def test_a_timestamp_that_is_no_date_is_one_line_naming_the_key(src, tmp_path):
    recipe = recipe_file(tmp_path, edited("config_id: hostile_test", "config_id: 2024-13-45"))
    error_line(convert(src, tmp_path / "out", "--recipe", str(recipe)), tmp_path / "out", str(recipe),
               "metadata.config_id")


@pytest.mark.parametrize(("old", "new", "key", "where"), [
    ('include: ["*mlp*"]', 'include: ["*mlp*"]\n      include: ["*visual*"]', "'include'", "spec.process[1]"),
    ("part_file_size: 4", "part_file_size: 4\n      part_file_size: 1", "'part_file_size'", "spec.save[0]"),
    ("spec:\n", "spec: {}\nspec:\n", "'spec'", "top level"),
], ids=["include", "part-file-size", "top-level"])
def test_a_key_given_twice_is_refused_naming_it(src, tmp_path, old, new, key, where):
    recipe = recipe_file(tmp_path, edited(old, new))
    error_line(convert(src, tmp_path / "out", "--recipe", str(recipe)), tmp_path / "out", str(recipe), key, where,
               "twice")


def test_a_merge_key_overridden_by_the_mapping_is_not_a_duplicate(src, tmp_path):
    """`<<: *anchor` then a key of the anchor is YAML's way to override one field, not a repeated key."""
    recipe = recipe_file(tmp_path, edited("qconfig: *dyn", 'qconfig: {<<: *dyn, act: {scope: "per_token", '
                                                           'dtype: "int8", symmetric: True, method: "minmax"}}'))
    assert convert(src, tmp_path / "out", "--recipe", str(recipe)).exit_code == 0


def test_a_recipe_that_is_a_named_pipe_is_refused_without_opening_it(src, tmp_path):
    """Reading a FIFO nobody writes to blocks forever; a subprocess, so that a regression fails instead of hanging."""
    recipe, out = tmp_path / "recipe.yaml", tmp_path / "out"
    os.mkfifo(recipe)
    result = subprocess.run([sys.executable, "-m", "npuport.cli", "convert-qwen35", "--a8w8", str(src), str(out),
                             "--recipe", str(recipe), "--quiet"], capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error:") and str(recipe) in lines[0] and "not a regular file" in lines[0]
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------------
# Shard size


@pytest.mark.parametrize("size", ["nan", "inf", "-inf", "0", "-1", "1e9"])
def test_part_file_size_must_be_a_finite_positive_number(src, tmp_path, size):
    out = tmp_path / "out"
    error_line(convert(src, out, "--part-file-size", size), out, "--part-file-size")


@pytest.mark.parametrize("size", [".nan", ".inf", "0", "-1"])
def test_the_recipes_part_file_size_follows_the_same_rule(src, tmp_path, size):
    recipe, out = recipe_file(tmp_path, edited("part_file_size: 4", f"part_file_size: {size}")), tmp_path / "out"
    error_line(convert(src, out, "--recipe", str(recipe)), out, str(recipe), "spec.save[0]", "part_file_size")


# ---------------------------------------------------------------------------------------------------------
# Rules that select nothing


def test_a_recipe_that_quantizes_nothing_writes_no_artifact(src, tmp_path):
    """A misspelt include glob used to give an all-BF16 artifact labelled W8A8, with exit status 0."""
    text = edited('include: ["*self_attn*"]', 'include: ["*self_atn*"]').replace('include: ["*mlp*"]',
                                                                                   'include: ["*mpl*"]')
    recipe, out = recipe_file(tmp_path, text), tmp_path / "out"
    error_line(convert(src, out, "--recipe", str(recipe)), out, str(recipe), "'*self_atn*'", "'*mpl*'",
               "quantizes nothing", "match no linear layer")


def test_a_recipe_whose_matches_are_all_kept_bf16_writes_no_artifact(src, tmp_path):
    text = edited('exclude: ["mtp*"]', 'exclude: ["*"]').replace('exclude: ["*visual*"]', 'exclude: ["*"]')
    recipe, out = recipe_file(tmp_path, text), tmp_path / "out"
    error_line(convert(src, out, "--recipe", str(recipe)), out, str(recipe), "'*self_attn*'", "quantizes nothing",
               "kept BF16", "excluded by recipe pattern '*'")


def test_an_include_glob_that_matches_nothing_is_named_in_a_warning(src, tmp_path):
    recipe, out = recipe_file(tmp_path, edited('include: ["*mlp*"]', 'include: ["*mlp*", "*mpl*"]')), tmp_path / "o"
    result = convert(src, out, "--recipe", str(recipe))
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "'*mpl*'" in warnings[0] and "spec.process[1]" in warnings[0]
    labels = json.loads((out / "quant_model_description.json").read_text())
    assert labels["model.language_model.layers.3.mlp.up_proj.weight"] == "W8A8_DYNAMIC"


# ---------------------------------------------------------------------------------------------------------
# A source shard that shrinks while it is read

RUNNER = r"""
import os, sys, time
from pathlib import Path
from npuport.convert.safetensors_io import ShardWriter

mark, after = Path(os.environ["NPUPORT_TEST_MARK"]), sys.argv[1]
real_write = ShardWriter.write
def write(self, name, data):  # once tensor `after` is written, touch `mark` and wait for `mark`.go
    real_write(self, name, data)
    if name == after and not mark.exists():
        mark.touch()
        deadline = time.monotonic() + 60
        while not mark.with_suffix(".go").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
ShardWriter.write = write
from npuport.cli import main
main(sys.argv[2:], prog_name="npuport")
"""

LAYER0 = "model.language_model.layers.0."


# Pairs of tensors converted one after the other, the second from a shard read before (so open, and once mapped).
@pytest.mark.parametrize(("after", "cut"), [
    ("model.visual.blocks.0.attn.proj.bias", "model.visual.blocks.0.attn.proj.weight"),  # copied: "Bad address"
    (LAYER0 + "mlp.down_proj.weight", LAYER0 + "mlp.gate_proj.weight"),  # quantized: SIGBUS
], ids=["copy", "quantize"])
def test_a_shard_truncated_during_conversion_is_one_line_naming_it(tiny_checkpoints, tmp_path, after, cut):
    """Source shards used to be memory-mapped: touching a page past the end of a shard cut short under the converter
    killed it with SIGBUS and no message, or failed the write of that page into OUT as "Bad address" naming OUT.
    The converter is paused after tensor `after`; the shard holding `cut`, the next tensor it reads, is then cut
    to its header."""
    src = Path(shutil.copytree(tiny_checkpoints["dense-multimodal"], tmp_path / "src"))
    out, mark = tmp_path / "out", tmp_path / "mark"
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, after, "convert-qwen35", "--a8w8", str(src), str(out),
                             "--quiet"], env={**os.environ, "NPUPORT_TEST_MARK": str(mark)}, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mark.exists(), proc.communicate(timeout=60)
        shard = src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][cut]
        entries, _ = read_header(shard)
        os.truncate(shard, min(e.begin for e in entries.values()))
        mark.with_suffix(".go").touch()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != -7, "killed by SIGBUS"
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in err, err
    assert shard.name in errors[0] and cut in errors[0] and "truncated" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mark", "mark.go", "src"]
