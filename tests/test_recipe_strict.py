"""Recipes are read strictly: a key msModelSlim's schema does not have is an error naming it and the nearest
valid key, values in messages are cut short, YAML aliases cannot expand without bound, and every problem is
one line naming the file. msModelSlim-schema recipes still load."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from npuport.cli import main
from npuport.convert.recipe import default_recipe_path, load_recipe
from npuport.errors import RecipeError
from npuport.fixtures.tiny_checkpoint import TinySpec, make_tiny

# In msModelSlim's schema, written for these tests: an anchor parked at the top level, a group of two
# linear_quant steps, calibration keys npuport ignores, one saver.
RECIPE = """\
apiversion: multimodal_vlm_modelslim_v1
metadata:
  config_id: strict_test
  verified_tags: {Qwen3.5-27B: [[vLLM_Ascend, Atlas_A2_Inference]]}
  label: {w_bit: 8, a_bit: 8, is_sparse: False, kv_cache: False}
w8a8_dynamic: &w8a8_dynamic
  act: {scope: "per_token", dtype: "int8", symmetric: True, method: "minmax"}
  weight: {scope: "per_channel", dtype: "int8", symmetric: True, method: "minmax", ext: {}}
spec:
  process:
    - type: "group"
      configs:
        - type: "linear_quant"
          qconfig: *w8a8_dynamic
          include: ["*self_attn*"]
          exclude: ["*q_proj*", "*k_proj*", "*v_proj*"]
        - type: "linear_quant"
          qconfig: *w8a8_dynamic
          include: ["*mlp*"]
  save:
    - type: "ascendv1_saver"
      part_file_size: 2
  dataset: "calibImages"
  default_text: "Describe this image in detail."
"""


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def misspelt(old: str, new: str, text: str = RECIPE) -> str:
    assert old in text
    return text.replace(old, new, 1)


def one_line_error(path: Path, **kwargs) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(path, **kwargs)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


@pytest.fixture(scope="module")
def dense_source(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("recipe-strict") / "dense", TinySpec(arch="dense", layout="text"))


def run_convert(src: Path, out: Path, recipe: Path):
    return CliRunner().invoke(main, ["convert-qwen35", "--a8w8", str(src), str(out), "--recipe", str(recipe),
                                     "--quiet"])


# ---------------------------------------------------------------------------------------------------------
# msModelSlim-schema recipes load


def test_msmodelslim_schema_recipes_load_and_quantizer_parameters_are_not_ignored(tmp_path):
    recipe = load_recipe(write(tmp_path, RECIPE))
    assert recipe.name == "strict_test" and recipe.part_file_size_gb == 2.0
    assert [(r.include, r.exclude) for r in recipe.rules] == [
        (("*self_attn*",), ("*q_proj*", "*k_proj*", "*v_proj*")), (("*mlp*",), ())]
    assert recipe.match("model.layers.3.self_attn.q_proj") is None
    assert recipe.match("model.layers.3.self_attn.o_proj") is recipe.rules[0]
    assert any("w8a8_dynamic" in note for note in recipe.notes)  # the anchor holder is named, not refused
    assert any("spec.dataset ignored" in note for note in recipe.notes)
    for moe in (False, True):  # the shipped ones
        assert load_recipe(default_recipe_path(moe)).rules
    # an empty `ext` is the schema's default; parameters in it would change the quantizer, which npuport's
    # minmax cannot honour
    message = one_line_error(write(tmp_path, misspelt("ext: {}", "ext: {percdamp: 0.01}"), "ext.yaml"))
    assert "qconfig.weight.ext" in message and "not implemented" in message


def test_prior_stages_rewrite_weights_and_are_refused_unless_skipped(tmp_path):
    path = write(tmp_path, misspelt("  save:\n", "  prior:\n    - process: [{type: adapt_rotation_stage1}]\n"
                                                "  save:\n"))
    assert "spec.prior" in one_line_error(path) and "--skip-unsupported" in one_line_error(path)
    assert any("spec.prior" in note for note in load_recipe(path, allow_unsupported=True).notes)
    assert load_recipe(write(tmp_path, misspelt("  save:\n", "  prior: []\n  save:\n"), "empty.yaml")).rules


# ---------------------------------------------------------------------------------------------------------
# Unknown keys


@pytest.mark.parametrize(("old", "new", "nearest"), [
    ('exclude: ["*q_proj*"', 'exclued: ["*q_proj*"', "exclude"),                # in a linear_quant step
    ('include: ["*mlp*"]', 'inclde: ["*mlp*"]', "include"),                     # in the second step
    ("          qconfig: *w8a8_dynamic\n          include: [\"*self", "          qconfg: *w8a8_dynamic\n"
     "          include: [\"*self", "qconfig"),                                 # the step's qconfig
    ("      configs:", "      config:", "configs"),                             # in a group
    ("  weight: {scope", "  wieght: {scope", "weight"),                         # in a qconfig
    ("symmetric: True, method: \"minmax\", ext", "symetric: True, method: \"minmax\", ext", "symmetric"),
    ("part_file_size: 2", "part_file_sise: 2", "part_file_size"),               # in a saver
    ("  dataset: \"calib", "  datset: \"calib", "dataset"),                     # in spec
], ids=["step", "second-step", "qconfig", "group", "qconfig-part", "quantizer", "saver", "spec"])
def test_a_misspelt_key_is_refused_naming_it_and_the_nearest_valid_key(tmp_path, old, new, nearest):
    assert load_recipe(write(tmp_path, RECIPE, "right.yaml")).rules  # spelt right, it loads
    wrong = new.split(":")[0].strip()
    message = one_line_error(write(tmp_path, misspelt(old, new)))
    assert f"unknown key {wrong!r}" in message and f"did you mean {nearest!r}?" in message


def test_a_key_with_no_near_match_lists_the_valid_ones(tmp_path):
    message = one_line_error(write(tmp_path, misspelt("      configs:", "      zzzz: 1\n      configs:")))
    assert "unknown key 'zzzz'" in message and "type, configs" in message


def test_a_misspelt_exclude_is_refused_before_anything_is_written(dense_source, tmp_path):
    """The row of the audit: `exclued:` was ignored and q_proj quantized against the user's intent."""
    good, bad = write(tmp_path, RECIPE, "good.yaml"), write(tmp_path, misspelt("exclude:", "exclued:"), "bad.yaml")
    out = tmp_path / "out"
    result = run_convert(dense_source, out, bad)
    assert result.exit_code == 1 and not out.exists()
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "'exclued'" in errors[0] and "'exclude'" in errors[0]
    assert "Traceback" not in result.output
    # spelt right, the recipe keeps the attention projections BF16 (what the user asked for)
    assert run_convert(dense_source, out, good).exit_code == 0
    labels = json.loads((out / "quant_model_description.json").read_text())
    attention = {k: v for k, v in labels.items() if ".self_attn." in k and k.endswith("_proj.weight")
                 and not k.startswith("mtp.")}
    assert attention and all(v == ("W8A8_DYNAMIC" if ".o_proj." in k else "FLOAT") for k, v in attention.items())


# ---------------------------------------------------------------------------------------------------------
# Values in messages, malformed files


@pytest.mark.parametrize(("old", "new"), [
    ('include: ["*mlp*"]', "include: {a: '" + "x" * 5000 + "'}"),
    ('type: "linear_quant"\n          qconfig: *w8a8_dynamic\n          include: ["*mlp*"]',
     'type: "' + "y" * 5000 + '"'),
    ("part_file_size: 2", "part_file_size: '" + "z" * 5000 + "'"),
    ("      configs:", "      " + "k" * 1000 + ": 1\n      configs:"),  # YAML's longest plain key
], ids=["pattern", "process-type", "part-file-size", "key"])
def test_values_in_messages_are_cut_short(tmp_path, old, new):
    message = one_line_error(write(tmp_path, misspelt(old, new)))
    assert len(message) < len(str(tmp_path)) + 300 and "..." in message


@pytest.mark.parametrize(("content", "expected"), [
    ("spec:\n  password: hunter2\n\tprocess: []\n", "not valid YAML at line 3"),   # a tab, where YAML has none
    ("spec: {process: [\n  hunter2", "not valid YAML"),
    (b"spec: \xff\xfe hunter2\n", "not UTF-8"),
], ids=["tab", "unclosed", "not-utf8"])
def test_yaml_errors_are_one_line_without_the_files_contents(tmp_path, content, expected):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    message = one_line_error(path)
    assert expected in message and "hunter2" not in message


# ---------------------------------------------------------------------------------------------------------
# YAML aliases


def alias_bomb(levels: int = 9) -> str:
    """The "billion laughs": each level an anchored list of nine aliases of the one before (9**9 leaves),
    aliased from a step's exclude list. About 650 bytes."""
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n" + misspelt('exclude: ["*q_proj*", "*k_proj*", "*v_proj*"]',
                                              f"exclude: *l{levels - 1}")


def test_an_alias_bomb_is_refused_without_expanding_it_while_ordinary_aliases_load(tmp_path):
    path = write(tmp_path, alias_bomb())
    assert 600 < path.stat().st_size < 1400
    start = time.perf_counter()
    message = one_line_error(path)
    assert time.perf_counter() - start < 1.0 and "alias" in message and len(message) < len(str(path)) + 120
    # twenty steps sharing one anchored qconfig: a few hundred nodes once expanded
    step = '    - type: "linear_quant"\n      qconfig: *w8a8_dynamic\n      include: ["*layers.{i}.*"]\n'
    text = RECIPE.split("spec:")[0] + "spec:\n  process:\n" + "".join(step.format(i=i) for i in range(20))
    assert len(load_recipe(write(tmp_path, text, "shared.yaml")).rules) == 20


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path):
    message = one_line_error(write(tmp_path, misspelt('include: ["*mlp*"]', "include: &loop [*loop]")))
    assert "alias" in message


def test_convert_with_an_alias_bomb_fails_fast_in_one_line(dense_source, tmp_path):
    """The audit's row (55 s, 8.2 GB, a 2 GB message), as a user meets it: the CLI in a subprocess, its
    address space capped at 3 GiB so that a regression fails here instead of exhausting the machine."""

    def cap_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    recipe, out = write(tmp_path, alias_bomb()), tmp_path / "out"
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "npuport.cli", "convert-qwen35", "--a8w8", str(dense_source),
                             str(out), "--recipe", str(recipe), "--quiet"],
                            capture_output=True, text=True, timeout=120, preexec_fn=cap_memory)
    elapsed = time.perf_counter() - start
    assert result.returncode == 1 and not out.exists()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and str(recipe) in lines[0] and "alias" in lines[0]
    assert len(lines[0]) < 400 and elapsed < 30  # most of it importing torch
