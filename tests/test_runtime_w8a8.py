"""W8A8 artifacts written by convert_qwen35: linear layers built by label, the int8 path against transformers
running the same layers with dequantized weights and per-token fake-quantized inputs, the logits' distance
from the BF16 source, and bad artifacts failing at load with the tensor named."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from npuport.convert.qwen35_names import text_prefix
from npuport.errors import ArtifactError
from npuport.runtime.generate import forward_logits
from npuport.runtime.linear import Linear, W8A8Linear
from npuport.runtime.loader import load_model
from npuport.runtime.model import MLP, Experts
from npuport.runtime.state import commit_accepted

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

KINDS = ["dense-multimodal", "dense-text", "moe-multimodal-fused", "moe-text-per-expert"]
SHARD = "quant_model_weights-00001-of-00001.safetensors"
DESCRIPTION = "quant_model_description.json"
INDEX = "quant_model_weights.safetensors.index.json"
# Stated tolerance of W8A8 against the BF16 source (both computed in float32): relative L2 error of all
# logits <= 0.35 and the same argmax at >= 85% of positions. Loose because these random tiny models
# amplify any perturbation: computing the BF16 source in BF16 instead of float32 alone moves its logits
# by 15-75% (measured); W8A8 moved them by 2-30%.
W8A8_REL_TOL = 0.35
W8A8_TOP1 = 0.85
PROMPTS = [[31, 7, 1500, 42, 9], list(range(200, 217)), [1000, 3, 77, 640, 12, 18, 901, 5, 33, 2047, 64]]


def checkpoint_names(artifact) -> Callable[[str], str]:
    """Runtime module name -> the artifact's tensor name prefix for it."""
    keys = json.loads((artifact / INDEX).read_text())["weight_map"]
    prefix = text_prefix(keys)
    return lambda name: name if name.startswith(("mtp.", "lm_head")) else prefix + name


@pytest.mark.parametrize("kind", KINDS)
def test_linear_layers_follow_their_labels(tiny_artifacts, kind):
    artifact = tiny_artifacts[kind]
    labels = json.loads((artifact / DESCRIPTION).read_text())
    ck = checkpoint_names(artifact)
    model = load_model(artifact, "cpu", torch.float32)
    quantized = 0
    with safe_open(artifact / SHARD, framework="pt") as f:
        for name, module in model.named_modules():
            if isinstance(module, W8A8Linear):
                assert labels[ck(name) + ".weight"] == "W8A8_DYNAMIC" and not name.startswith("mtp.")
                assert torch.equal(module.weight, f.get_tensor(ck(name) + ".weight"))
                assert torch.equal(module.weight_scale, f.get_tensor(ck(name) + ".weight_scale"))
                quantized += 1
            elif isinstance(module, Linear) and name != "lm_head":
                assert labels[ck(name) + ".weight"] == "FLOAT"
            elif isinstance(module, Experts):
                quantized += experts_follow_their_labels(module, ck(name), labels, f)
    assert quantized == sum(1 for k, v in labels.items() if k.endswith(".weight") and v == "W8A8_DYNAMIC")
    assert quantized > 0 and model.mtp is not None


def experts_follow_their_labels(module: Experts, ck: str, labels: dict, f) -> int:
    """Each expert's rows of the stacked tensors against the artifact's per-expert tensors; how many W8A8
    weights there were."""
    i = module.down_proj.shape[2]
    rows = {"gate_proj": slice(0, i), "up_proj": slice(i, 2 * i), "down_proj": slice(None)}
    quantized = 0
    for e in range(module.gate_up_proj.shape[0]):
        for proj, part in rows.items():
            name = f"{ck}.{e}.{proj}"
            stacked = module.down_proj if proj == "down_proj" else module.gate_up_proj
            if module.quantized:
                assert labels[name + ".weight"] == "W8A8_DYNAMIC" and not ck.startswith("mtp.")
                assert torch.equal(stacked[e, part], f.get_tensor(name + ".weight"))
                scales = module.down_proj_scale if proj == "down_proj" else module.gate_up_proj_scale
                assert torch.equal(scales[e, part], f.get_tensor(name + ".weight_scale").float().reshape(-1))
                quantized += 1
            elif name + ".weight" in labels:
                assert labels[name + ".weight"] == "FLOAT"
    return quantized


def fake_quantize_per_token(module, args):
    x = args[0]
    scale = x.abs().amax(-1, keepdim=True) / 127
    return (torch.round(x / scale) * scale,)


@torch.no_grad()
@pytest.mark.parametrize("recipe", ["default", "qwen3_6_27b_w8a8"])
@pytest.mark.parametrize("kind", ["dense-multimodal", "dense-text"])
def test_w8a8_layers_equal_transformers_with_dequantized_weights(tiny_checkpoints, tiny_artifacts, qwen36_artifacts,
                                                                 kind, recipe):
    """Teacher-forced per layer, prefill then decode steps: transformers with every W8A8-labelled linear
    given weight_int8 * weight_scale and an input rounded per token to int8 levels, against the runtime's
    int8 x int8 -> int32 matmul. Under the Qwen3.6 recipe the GatedDeltaNet in_proj_qkv / in_proj_z are int8
    too (and in_proj_b / in_proj_a not: the runtime then stacks the projections in two pairs). (Dense only:
    transformers' MoE experts are one fused module; the MoE artifacts' int8 experts are covered by the label and
    logits tests and by the kernel tests.)"""
    artifact = (tiny_artifacts if recipe == "default" else qwen36_artifacts)[kind]
    reference = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[kind], dtype=torch.float32).eval()
    model = load_model(artifact, "cpu", torch.float32)
    gdn_int8 = [name for name, m in model.named_modules() if isinstance(m, W8A8Linear) and ".linear_attn." in name]
    assert bool(gdn_int8) == (recipe != "default")
    ck = checkpoint_names(artifact)
    with safe_open(artifact / SHARD, framework="pt") as f:
        for name, module in model.named_modules():
            if isinstance(module, W8A8Linear):
                layer = reference.get_submodule("model." + name)
                weight, scale = f.get_tensor(ck(name) + ".weight"), f.get_tensor(ck(name) + ".weight_scale")
                layer.weight.copy_(weight.float() * scale)
                layer.register_forward_pre_hook(fake_quantize_per_token)
    seq = torch.randint(3, 2000, (2, 12), generator=torch.Generator().manual_seed(0))
    hidden = reference(seq, output_hidden_states=True).hidden_states
    state = model.new_state(2, 12)
    errors = []  # per layer and token: max abs difference
    for begin, count in [(0, 8), (8, 1), (9, 1), (10, 1), (11, 1)]:
        step = model.make_step(state.positions, count, torch.full((2,), count) if begin == 0 else None,
                               state.capacity)
        for i, (layer, layer_state) in enumerate(zip(model.layers, state.layers, strict=True)):
            out = sum(layer(hidden[i][:, begin : begin + count], None, layer_state, step))  # MLP output + stream
            out = model.norm(out) if i == len(model.layers) - 1 else out
            errors.append((out - hidden[i + 1][:, begin : begin + count]).abs().amax(-1).flatten())
        commit_accepted(state, torch.full((2,), count), 0 if begin == 0 else count)
    # Float32 rounding, except where the two sides round one activation to neighbouring int8 levels (its
    # inputs differ by ~1e-7 across a .5 boundary): that moves one token's output by one quantization step.
    errors = torch.cat(errors)
    assert (errors > 2e-5).float().mean() <= 0.05 and errors.max() < 3e-2


@pytest.mark.parametrize("kind", KINDS)
def test_w8a8_logits_are_within_the_stated_tolerance_of_the_bf16_source(tiny_checkpoints, tiny_artifacts, kind):
    source, _ = forward_logits(load_model(tiny_checkpoints[kind], "cpu", torch.float32), PROMPTS)
    quant, _ = forward_logits(load_model(tiny_artifacts[kind], "cpu", torch.float32), PROMPTS)
    real = torch.cat([torch.arange(len(p)) + row * source.shape[1] for row, p in enumerate(PROMPTS)])
    source, quant = source.flatten(0, 1)[real], quant.flatten(0, 1)[real]
    assert (quant - source).norm() / source.norm() < W8A8_REL_TOL
    assert (quant.argmax(-1) == source.argmax(-1)).float().mean() >= W8A8_TOP1
    assert not torch.equal(quant, source)


@pytest.fixture()
def broken(tiny_artifacts, tmp_path):
    """A copy of the dense-text artifact, and a function that edits its shard, index or description."""
    artifact = tmp_path / "artifact"
    shutil.copytree(tiny_artifacts["dense-text"], artifact)

    def edit(tensors=None, labels=None, drop_from_index=None):
        if tensors is not None:
            weights = load_file(artifact / SHARD)
            tensors(weights)
            save_file(weights, artifact / SHARD, metadata={"format": "pt"})
        if labels is not None:
            description = json.loads((artifact / DESCRIPTION).read_text())
            labels(description)
            (artifact / DESCRIPTION).write_text(json.dumps(description))
        if drop_from_index is not None:
            index = json.loads((artifact / INDEX).read_text())
            del index["weight_map"][drop_from_index]
            (artifact / INDEX).write_text(json.dumps(index))
        return artifact

    return edit


def test_missing_tensor_is_named(broken):
    name = "model.layers.3.self_attn.k_proj.weight_scale"
    with pytest.raises(ArtifactError, match=f"tensor {name} is missing"):
        load_model(broken(tensors=lambda w: w.pop(name), drop_from_index=name), "cpu")


def test_tensor_missing_from_its_shard_is_named(broken):
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ArtifactError, match=f"tensor {name} is not in {SHARD}"):
        load_model(broken(tensors=lambda w: w.pop(name)), "cpu")


def test_wrong_shape_is_named(broken):
    name = "model.layers.1.linear_attn.out_proj.weight"

    def shrink(w):
        w[name] = w[name][:, :-1].contiguous()

    with pytest.raises(ArtifactError, match=rf"tensor {name} has shape \[64, 63\], expected \[64, 64\]"):
        load_model(broken(tensors=shrink), "cpu")


def test_unknown_label_is_named(broken):
    name = "model.layers.3.self_attn.q_proj.weight"

    def relabel(d):
        d[name] = "W4A16"

    with pytest.raises(ArtifactError, match=f"tensor {name} has label 'W4A16'"):
        load_model(broken(labels=relabel), "cpu")


def test_missing_label_is_named(broken):
    name = "model.layers.2.mlp.down_proj.weight"
    with pytest.raises(ArtifactError, match=f"tensor {name} has no label"):
        load_model(broken(labels=lambda d: d.pop(name)), "cpu")


def test_int8_weight_labelled_float_is_named(broken):
    name = "model.layers.0.mlp.gate_proj.weight"

    def relabel(d):
        d[name] = "FLOAT"

    with pytest.raises(ArtifactError, match=f"tensor {name} is torch.int8, expected a float dtype"):
        load_model(broken(labels=relabel), "cpu")


@pytest.mark.parametrize("kind", ["moe-text-per-expert", "moe-multimodal-fused"])
def test_loaded_shared_experts_are_one_stacked_expert_viewing_their_layers(tiny_artifacts, kind):
    """After loading, each shared expert's gate and up projections live in one tensor (no second copy) that
    the expert kernels read as a single expert, equal to the artifact's tensors."""
    artifact = tiny_artifacts[kind]
    ck = checkpoint_names(artifact)
    model = load_model(artifact, "cpu", torch.float32)
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, MLP) and n.endswith("shared_expert")]
    assert layers
    with safe_open(artifact / SHARD, framework="pt") as f:
        for name, mlp in layers:
            stacked = mlp.as_expert()
            assert stacked is not None and stacked.gate_up.data_ptr() == mlp.gate_proj.weight.data_ptr()
            i = stacked.intermediate
            for proj, part in (("gate_proj", stacked.gate_up[0, :i]), ("up_proj", stacked.gate_up[0, i:]),
                               ("down_proj", stacked.down[0])):
                assert torch.equal(part, f.get_tensor(f"{ck(name)}.{proj}.weight").float())
