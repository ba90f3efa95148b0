"""`make-tiny --like`: the real widths of the published Qwen3.5 models at reduced depth. The preset table against
transformers (its config classes accept it, its model of that config has exactly the tensors planned, the
parameter counts are the models' names), and checkpoints written by the same code at widths divided by 16, read
back with the safetensors library and run by the runtime against transformers."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from collections import namedtuple
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from npuport.cli import main
from npuport.fixtures import tiny_checkpoint as tc
from npuport.fixtures.tiny_checkpoint import REAL_MODELS, full_config, like_spec, make_tiny, plan_shards, tensor_shapes
from npuport.runtime.generate import forward_logits
from npuport.runtime.loader import load_model

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

VOCAB = 248320
# What QWEN35.md "Real sizes" and the model cards state of each model, and the (total, active) parameters its name
# gives.
QWEN_27B = dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                linear_num_key_heads=16, linear_num_value_heads=48, intermediate_size=17408)
QWEN_35B_A3B = dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                    linear_num_key_heads=16, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                    moe_intermediate_size=512, shared_expert_intermediate_size=512)
PUBLISHED = {
    "27B": QWEN_27B,
    "35B-A3B": QWEN_35B_A3B,
    "122B-A10B": dict(num_hidden_layers=48, num_experts=256, num_experts_per_tok=8),
    "397B-A17B": dict(hidden_size=4096, num_hidden_layers=60, num_experts=512, num_experts_per_tok=10),
    "Qwen3.6-27B": QWEN_27B,
    "Qwen3.6-35B-A3B": QWEN_35B_A3B,
    "Qwen3.8-27B": QWEN_27B,
    "Qwen3.8-2.4T-A95B": dict(hidden_size=8192, num_hidden_layers=92, num_attention_heads=64, num_key_value_heads=4,
                              linear_num_key_heads=16, linear_num_value_heads=128, num_experts=512,
                              num_experts_per_tok=10, moe_intermediate_size=2048,
                              shared_expert_intermediate_size=2048),
}
NAMED_PARAMETERS = {"27B": (27e9, 27e9), "35B-A3B": (35e9, 3e9), "122B-A10B": (122e9, 10e9),
                    "397B-A17B": (397e9, 17e9), "Qwen3.6-27B": (27e9, 27e9), "Qwen3.6-35B-A3B": (35e9, 3e9),
                    "Qwen3.8-27B": (27e9, 27e9), "Qwen3.8-2.4T-A95B": (2.4e12, 95e9)}
SHRINK = 16  # widths of the written checkpoints: hidden 128-320, head_dim 16, K = V = 8, vocabulary 15520


def transformers_config(spec: tc.TinySpec):
    """transformers' config object for the config.json make-tiny writes for `spec`."""
    cfg = full_config(spec, tc.spec_sizes(spec).vocab_size, eos_id=1, pad_id=2)
    return AutoConfig.for_model(**cfg)


def meta_state_dict(spec: tc.TinySpec) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor of transformers' model of `spec`'s config (multimodal, or the causal LM of a
    text layout), built without memory."""
    auto = AutoModelForImageTextToText if spec.layout == "multimodal" else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(transformers_config(spec))
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def test_the_cli_offers_exactly_the_real_models():
    like = next(p for p in main.commands["make-tiny"].params if p.name == "like")
    assert list(like.type.choices) == list(REAL_MODELS)


@pytest.mark.parametrize("model", list(REAL_MODELS))
def test_transformers_accepts_each_preset_with_the_published_sizes(model):
    spec = like_spec(model, layers=REAL_MODELS[model].num_hidden_layers)
    cfg = transformers_config(spec)
    moe = "num_experts" in PUBLISHED[model]
    text_only = REAL_MODELS[model].text_only
    assert type(cfg).__name__ == ("Qwen3_5Moe" if moe else "Qwen3_5") + ("TextConfig" if text_only else "Config")
    text = cfg if text_only else cfg.text_config
    for key, value in PUBLISHED[model].items():
        assert getattr(text, key) == value, key
    assert (text.vocab_size, text.head_dim, text.linear_key_head_dim, text.linear_value_head_dim) == (VOCAB, 256, 128,
                                                                                                       128)
    assert text.layer_types == ["linear_attention", "linear_attention", "linear_attention",
                                "full_attention"] * (text.num_hidden_layers // 4)
    assert text.tie_word_embeddings is False and text.mtp_num_hidden_layers == 1
    assert text.rope_parameters["rope_theta"] == 1e7 and text.rope_parameters["partial_rotary_factor"] == 0.25


@pytest.mark.parametrize("model", list(REAL_MODELS))
def test_parameter_counts_are_those_the_model_names_give(model):
    """transformers' text model at full depth (no vision tower: make-tiny's is a stand-in, no MTP: the names
    do not count it) has the named total within 1.5% and, counting top-k of E experts, the named active
    parameters within 20% (35B-A3B has 3.46B active)."""
    sizes = REAL_MODELS[model]
    shapes = meta_state_dict(like_spec(model, layers=sizes.num_hidden_layers))
    total = sum(math.prod(s) for n, s in shapes.items() if not n.startswith("model.visual."))
    experts = sum(math.prod(s) for n, s in shapes.items() if ".mlp.experts." in n)
    active = total - experts + (experts * sizes.num_experts_per_tok // sizes.num_experts if experts else 0)
    named_total, named_active = NAMED_PARAMETERS[model]
    assert abs(total / named_total - 1) < 0.015, total
    assert abs(active / named_active - 1) < 0.2, active


@pytest.mark.parametrize("model", list(REAL_MODELS))
def test_planned_tensors_are_those_of_transformers_model(model):
    """Every planned tensor outside mtp.* has the name and shape of transformers' model of that config, and
    every model tensor is planned; the MTP layer has the shapes of the model's full-attention layer 3."""
    spec = like_spec(model, layers=4)
    want = meta_state_dict(spec)
    planned = dict(tensor_shapes(spec, VOCAB))
    assert {n: s for n, s in planned.items() if not n.startswith("mtp.")} == want
    layer3 = "model.layers.3." if spec.layout == "text" else "model.language_model.layers.3."
    mtp_layer = {n.removeprefix("mtp.layers.0."): s for n, s in planned.items() if n.startswith("mtp.layers.0.")}
    assert mtp_layer == {n.removeprefix(layer3): s for n, s in want.items() if n.startswith(layer3)}
    hidden = REAL_MODELS[model].hidden_size
    assert planned["mtp.fc.weight"] == (hidden, 2 * hidden) and planned["mtp.norm.weight"] == (hidden,)
    if REAL_MODELS[model].num_experts:
        e, i = REAL_MODELS[model].num_experts, REAL_MODELS[model].moe_intermediate_size
        assert mtp_layer["mlp.experts.gate_up_proj"] == (e, 2 * i, hidden)
        assert mtp_layer["mlp.experts.down_proj"] == (e, hidden, i)


@pytest.mark.parametrize("model", list(REAL_MODELS))
def test_shards_hold_at_most_4_gb_unless_one_tensor_is_larger(model):
    spec = like_spec(model, layers=4)
    shards = plan_shards(spec, VOCAB)
    assert [t for shard in shards for t in shard] == tensor_shapes(spec, VOCAB)
    for shard in shards:
        nbytes = sum(2 * math.prod(s) for _, s in shard)
        assert nbytes <= 4e9 or len(shard) == 1, (len(shard), nbytes)
    prefix = "model." if spec.layout == "text" else "model.language_model."
    embed = dict(tensor_shapes(spec, VOCAB))[prefix + "embed_tokens.weight"]
    assert embed == (VOCAB, REAL_MODELS[model].hidden_size)


def read_checkpoint(path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, read with the safetensors library through the index."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(path / file, framework="pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == file
                tensors[name] = f.get_tensor(name)
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    return tensors


def fan_in(name: str, shape: tuple[int, ...]) -> int:
    """Inputs per output of a weight: the last dim of a Linear or of stacked experts [E, N, K]; a depthwise
    conv's kernel; the hidden size of the embedding and lm_head rows."""
    return shape[-1] if len(shape) in (2, 3) and not name.endswith("conv1d.weight") else math.prod(shape[1:])


def test_written_checkpoint_reads_back_with_safetensors_and_is_streamed(tmp_path, monkeypatch):
    """35B-A3B widths / 16 at 4 layers, drawn in chunks of 2^14 values, written 2^12 values per call into shards
    of at most 2 MB: the safetensors library reads every planned tensor in BF16 with its shape; weights have
    std 1/sqrt(fan_in), norms start at zero or one, no two chunks repeat; the bytes do not depend on the shard
    size or the number of drawing threads; the same seed gives the same bytes, another seed others."""
    monkeypatch.setattr(tc, "CHUNK_VALUES", 1 << 14)
    monkeypatch.setattr(tc, "WRITE_VALUES", 1 << 12)
    monkeypatch.setattr(tc, "MAX_SHARD_BYTES", 2 << 20)
    spec = replace(like_spec("35B-A3B", layers=4), shrink_widths=SHRINK)
    out = make_tiny(tmp_path / "a", spec)
    tensors = read_checkpoint(out)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shards = {file: [n for n in weight_map if weight_map[n] == file] for file in set(weight_map.values())}
    assert len(shards) > 10
    for names in shards.values():
        assert len(names) == 1 or sum(2 * tensors[n].numel() for n in names) <= 2 << 20
    assert {n: tuple(t.shape) for n, t in tensors.items()} == dict(tensor_shapes(spec, VOCAB // SHRINK))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    for name, t in tensors.items():
        x = t.double()
        if name.endswith(("A_log", "dt_bias", "conv1d.weight")) or name.startswith("model.visual."):
            continue
        if t.dim() == 1:  # N(0 or 1, 0.1^2): the mean within 5 standard deviations
            plain = name.endswith("linear_attn.norm.weight")
            assert abs(x.mean() - (1.0 if plain else 0.0)) < 0.5 / math.sqrt(t.numel()), name
        elif t.numel() >= 10_000:
            assert 0.9 < x.std() * math.sqrt(fan_in(name, tuple(t.shape))) < 1.1, name
    experts = tensors["model.language_model.layers.0.mlp.experts.gate_up_proj"].reshape(-1)
    heads = experts[: experts.numel() // (1 << 14) * (1 << 14)].reshape(-1, 1 << 14)[:, :8]
    assert heads.shape[0] > 100 and len(torch.unique(heads, dim=0)) == heads.shape[0]

    monkeypatch.setattr(tc, "MAX_SHARD_BYTES", 64 << 20)
    monkeypatch.setattr(tc, "_draw_threads", lambda: 1)
    other = read_checkpoint(make_tiny(tmp_path / "b", spec))
    assert len(list((tmp_path / "b").glob("*.safetensors"))) == 1
    assert all(torch.equal(other[n], t) for n, t in tensors.items())
    reseeded = read_checkpoint(make_tiny(tmp_path / "c", replace(spec, seed=1)))
    assert not torch.equal(reseeded["lm_head.weight"], tensors["lm_head.weight"])


# Writes 35B-A3B widths / 4 at one layer (340 MB, tensors up to 67 MB) after a warm-up write, in chunks of 2^18
# values; prints the growth of the process's peak resident memory during it and the bytes written.
PEAK_MEMORY_SCRIPT = """
import re, sys
from dataclasses import replace
from pathlib import Path
from npuport.fixtures import tiny_checkpoint as tc

def peak():
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024

tc.CHUNK_VALUES = 1 << 18
out = Path(sys.argv[1])
tc.make_tiny(out / "warm-up", replace(tc.like_spec("35B-A3B", layers=1), shrink_widths=16))
before = peak()
tc.make_tiny(out / "big", replace(tc.like_spec("35B-A3B", layers=1), shrink_widths=4))
print(peak() - before, sum(f.stat().st_size for f in (out / "big").glob("*.safetensors")))
"""


def test_writing_holds_a_few_chunks_in_memory_not_a_tensor(tmp_path):
    """The peak resident memory of a fresh process grows by less than half the largest tensor (67 MB) while it
    writes a 340 MB checkpoint: values are drawn and written chunk by chunk, never a whole tensor or shard."""
    result = subprocess.run([sys.executable, "-c", PEAK_MEMORY_SCRIPT, str(tmp_path)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    grew, written = map(int, result.stdout.split())
    assert written > 300e6 and grew < 32e6, (grew, written)


@torch.no_grad()
@pytest.mark.parametrize("model", ["27B", "35B-A3B"])
def test_runtime_loads_the_written_checkpoint_and_agrees_with_transformers(tmp_path, model):
    """The runtime's loader reads every tensor, MTP head included, and its logits equal transformers' on the same
    checkpoint (the MoE with 256 experts, top-8), in float32, to 1e-4 (logits of order 1-5; measured 1-2e-5; a
    misread tensor moves them by order 1)."""
    path = make_tiny(tmp_path / model, replace(like_spec(model, layers=4), shrink_widths=SHRINK))
    runtime = load_model(path, "cpu", torch.float32)
    assert runtime.mtp is not None
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = [31, 7, 1500, 42, 9, 1000, 3, 77]
    logits, _ = forward_logits(runtime, [prompt])
    want = reference(torch.tensor([prompt])).logits[0]
    assert want.std() > 0.5
    torch.testing.assert_close(logits[0], want, rtol=0, atol=1e-4)


def test_cli_writes_the_model_at_the_given_depth(tmp_path, monkeypatch):
    real_like_spec = tc.like_spec
    monkeypatch.setattr(tc, "like_spec", lambda *a, **k: replace(real_like_spec(*a, **k), shrink_widths=SHRINK))
    out = tmp_path / "like"
    result = CliRunner().invoke(main, ["make-tiny", str(out), "--like", "35B-A3B", "--layers", "5", "--quiet"])
    assert result.exit_code == 0, result.output
    text = json.loads((out / "config.json").read_text())["text_config"]
    assert text["model_type"] == "qwen3_5_moe_text" and text["num_hidden_layers"] == 5
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention", "linear_attention"]
    assert (text["num_experts"], text["num_experts_per_tok"]) == (256, 8)
    with safe_open(out / "model-00001-of-00001.safetensors", framework="pt") as f:
        assert f.get_slice("mtp.layers.0.mlp.experts.gate_up_proj").get_shape() == [256, 2 * 512 // SHRINK,
                                                                                    2048 // SHRINK]


@pytest.mark.parametrize("extra", [["--arch", "moe"], ["--size", "mid"]])
def test_cli_refuses_sizes_that_like_sets_in_one_line(tmp_path, extra):
    out = tmp_path / "x"
    result = CliRunner().invoke(main, ["make-tiny", str(out), "--like", "27B", *extra])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [f"error: --like 27B sets the architecture and sizes; "
                                                  f"leave out {extra[0]}"]
    assert not out.exists()


def test_cli_refuses_a_checkpoint_the_disk_cannot_hold_in_one_line(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**12, 10**12 - 10**9, 10**9))
    out = tmp_path / "big"
    result = CliRunner().invoke(main, ["make-tiny", str(out), "--like", "397B-A17B"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and str(out) in lines[0] and "69.8 GB" in lines[0] and "1.0 GB free" in lines[0]
    assert list(tmp_path.iterdir()) == []
