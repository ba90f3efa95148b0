"""What the serving engines assert of a Qwen3.5 folder holds for everything make-tiny writes, at every preset, arch
and layout; each rule fires, in one line naming the file and the field, on a folder that breaks it; the processor
files make-tiny writes are the ones transformers' Qwen3-VL processor loads, and they cut an image into the patches
transformers' own Qwen3.5 model embeds."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer
from transformers.video_processing_utils import BaseVideoProcessor

from npuport.convert.engine_rules import RULES, engine_problems
from npuport.fixtures.tiny_checkpoint import PRESETS, TinySpec, spec_sizes, tensor_shapes, write_metadata

LAYOUTS = ("multimodal", "text")


def preset_specs() -> list[TinySpec]:
    """Every preset in every arch it has (real widths: the model's own) and every layout."""
    specs = []
    for size in PRESETS:
        for arch in ("dense", "moe"):
            for layout in LAYOUTS:
                spec = TinySpec(arch=arch, layout=layout, size=size)
                try:
                    spec_sizes(spec)
                except ValueError:  # a preset without this arch
                    continue
                specs.append(spec)
    return specs


def metadata_folder(folder: Path, spec: TinySpec) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """Write the config, tokenizer and processor files of `spec` (no weights) into `folder`; returns the config and
    the shapes of the tensors make-tiny would write."""
    folder.mkdir(parents=True)
    config = write_metadata(folder, spec)
    vocab = (config.get("text_config") or config)["vocab_size"]
    return config, dict(tensor_shapes(spec, vocab))


@pytest.mark.parametrize("spec", preset_specs(), ids=lambda s: f"{s.size}-{s.arch}-{s.layout}")
def test_every_preset_passes_every_engine_rule(tmp_path, spec):
    config, shapes = metadata_folder(tmp_path / "model", spec)
    assert engine_problems(tmp_path / "model", config, shapes) == []


def test_the_presets_cover_every_size_arch_and_layout():
    covered = {(s.size, s.arch, s.layout) for s in preset_specs()}
    assert {size for size, _, _ in covered} == set(PRESETS)
    assert {(arch, layout) for _, arch, layout in covered} == {(a, x) for a in ("dense", "moe") for x in LAYOUTS}


def edit_json(folder: Path, name: str, edit: Callable[[dict], object]) -> None:
    data = json.loads((folder / name).read_text())
    edit(data)
    (folder / name).write_text(json.dumps(data))


def text(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    return lambda folder: edit_json(folder, "config.json", lambda c: edit(c["text_config"]))


def top(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    return lambda folder: edit_json(folder, "config.json", edit)


def rope(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    return text(lambda t: edit(t["rope_parameters"]))


def tiny_rotated_half() -> int:
    """rotary_dim // 2 of the tiny preset, from its head_dim and Qwen3.5's partial_rotary_factor of 1/4."""
    return int(PRESETS["tiny"].head_dim * 0.25) // 2


# rule -> (what breaks it on the tiny dense multimodal folder, what its one line must say)
BREAKS: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    "architecture": (top(lambda c: c.update(architectures=["Qwen3_5ForCausalLM"])),
                     ["config.json: architectures", "Qwen3_5ForConditionalGeneration"]),
    "text-model-type": (text(lambda t: t.update(model_type="qwen3_5_moe_text")),
                        ["config.json: text_config.model_type", "'qwen3_5_text'"]),
    "full-attention-interval": (text(lambda t: t.update(full_attention_interval=2)),
                                ["config.json: text_config.layer_types[1]", "full_attention_interval 2"]),
    "rotary-dim": (rope(lambda r: r.update(partial_rotary_factor=1.5)),
                   ["config.json: text_config.rope_parameters.partial_rotary_factor 1.5"]),
    "mrope-section": (rope(lambda r: r.update(mrope_section=[11, 11, 10])),
                      ["config.json: text_config.rope_parameters.mrope_section [11, 11, 10] sums to 32",
                       f"rotary_dim // 2 = {tiny_rotated_half()}"]),
    "mrope-interleaved": (rope(lambda r: r.pop("mrope_interleaved")),
                          ["config.json: text_config.rope_parameters.mrope_interleaved is None"]),
    "attention-heads": (text(lambda t: t.update(num_key_value_heads=3)),
                        ["config.json: text_config.num_attention_heads 4 is not a multiple of "
                         "text_config.num_key_value_heads 3"]),
    "linear-heads": (text(lambda t: t.update(linear_num_key_heads=3)),
                     ["config.json: text_config.linear_num_value_heads 4", "text_config.linear_num_key_heads 3"]),
    "mtp-head": (text(lambda t: t.pop("mtp_num_hidden_layers")),
                 ["config.json: text_config.mtp_num_hidden_layers is None", "mtp.*"]),
    "tokenizer-files": (lambda folder: (folder / "tokenizer_config.json").unlink(),
                        ["tokenizer_config.json: missing"]),
    "tokenizer-fits-vocab": (text(lambda t: t.update(vocab_size=2000)),
                             ["tokenizer.json: token", "beyond config.json text_config.vocab_size 2000"]),
    "special-token-ids": (lambda folder: edit_json(folder, "generation_config.json",
                                                   lambda g: g.update(eos_token_id=[7, 9999])),
                          ["generation_config.json: eos_token_id 9999 is not a token id below"]),
    "vision-token-ids": (top(lambda c: c.update(image_token_id=5)),
                         ["config.json: image_token_id is 5, but the tokenizer gives it id", "<|image_pad|>"]),
    "processor-files": (lambda folder: (folder / "preprocessor_config.json").unlink(),
                        ["preprocessor_config.json: missing", "--language-model-only"]),
    "processor-geometry": (lambda folder: edit_json(folder, "video_preprocessor_config.json",
                                                    lambda p: p.update(patch_size=16)),
                           ["video_preprocessor_config.json: patch_size is 16", "vision_config.patch_size is 4"]),
    "vision-tower": (top(lambda c: c["vision_config"].update(out_hidden_size=99)),
                     ["config.json: vision_config.out_hidden_size is 99", "text_config.hidden_size is 64"]),
}


def test_every_rule_has_a_folder_that_breaks_it():
    assert set(BREAKS) == {rule.name for rule in RULES}
    assert all(rule.engines and rule.source for rule in RULES)


@pytest.mark.parametrize("rule", sorted(BREAKS))
def test_each_rule_fires_on_a_folder_that_breaks_it(tmp_path, rule):
    folder = tmp_path / "model"
    _, shapes = metadata_folder(folder, TinySpec(arch="dense", layout="multimodal", size="tiny"))
    brake, needles = BREAKS[rule]
    brake(folder)
    config = json.loads((folder / "config.json").read_text())
    problems = engine_problems(folder, config, shapes)
    assert [p for p in problems if not p.endswith(f"[engine rule {rule}]")] == [], problems
    assert len(problems) == 1, problems
    assert "\n" not in problems[0] and all(needle in problems[0] for needle in needles), problems[0]


def test_the_text_layout_carries_no_vision_rules(tmp_path):
    folder = tmp_path / "model"
    config, shapes = metadata_folder(folder, TinySpec(layout="text"))
    assert not (folder / "preprocessor_config.json").exists() and "image_token_id" not in config
    assert engine_problems(folder, config, shapes) == []


def test_the_processor_files_are_what_transformers_loads_for_the_model(tmp_path):
    """transformers' Qwen3.5 image processor, loaded from the folder, cuts an image into the patches the vision
    tower of transformers' Qwen3.5 model embeds; the tokenizer's vision tokens are the ids the config names, and
    the model runs a prompt holding the image's placeholders."""
    from npuport.fixtures.tiny_checkpoint import make_tiny

    folder = make_tiny(tmp_path / "model", TinySpec(arch="dense", layout="multimodal"))
    config = json.loads((folder / "config.json").read_text())
    vision = config["vision_config"]
    image_processor = AutoImageProcessor.from_pretrained(folder)
    assert (image_processor.patch_size, image_processor.temporal_patch_size, image_processor.merge_size) == (
        vision["patch_size"], vision["temporal_patch_size"], vision["spatial_merge_size"])
    video, _ = BaseVideoProcessor.get_video_processor_dict(str(folder))
    assert video["video_processor_type"] == "Qwen3VLVideoProcessor"
    assert (video["patch_size"], video["temporal_patch_size"], video["merge_size"]) == (
        vision["patch_size"], vision["temporal_patch_size"], vision["spatial_merge_size"])

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in
           [("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}
    assert ids == {key: config[key] for key in ids}
    assert len(set(ids.values())) == 4 and max(ids.values()) < config["text_config"]["vocab_size"]

    pixels = image_processor(images=[Image.new("RGB", (40, 56), (200, 30, 90))], return_tensors="pt")
    grid = pixels["image_grid_thw"]
    patch_values = vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    assert pixels["pixel_values"].shape == (int(grid.prod()), patch_values)
    placeholders = int(grid.prod()) // vision["spatial_merge_size"] ** 2
    prompt = (tokenizer("Count the dots:")["input_ids"] + [ids["vision_start_token_id"]]
              + [ids["image_token_id"]] * placeholders + [ids["vision_end_token_id"]])
    image_tokens = [int(token == ids["image_token_id"]) for token in prompt]  # 1 marks an image token
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt]), pixel_values=pixels["pixel_values"], image_grid_thw=grid,
                       mm_token_type_ids=torch.tensor([image_tokens])).logits
    assert logits.shape == (1, len(prompt), config["text_config"]["vocab_size"])
    assert bool(torch.isfinite(logits).all()) and math.isfinite(float(logits.std())) and float(logits.std()) > 0


def test_convert_refuses_a_source_breaking_an_engine_rule_before_writing(tmp_path):
    """The published models' mrope split on a tiny head: convert names the rule at once and writes nothing."""
    from npuport.convert.converter import convert_qwen35
    from npuport.errors import NpuportError
    from npuport.fixtures.tiny_checkpoint import make_tiny

    source = make_tiny(tmp_path / "src", TinySpec())
    config = json.loads((source / "config.json").read_text())
    config["text_config"]["rope_parameters"]["mrope_section"] = [11, 11, 10]
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(NpuportError, match=r"(?s)serving engines assert.*mrope_section.*\[engine rule"):
        convert_qwen35(source, tmp_path / "out", show_progress=False, log=lambda _: None)
    assert not (tmp_path / "out").exists()
