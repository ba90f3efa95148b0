"""W4A8 artifacts written by convert_qwen35 under the shipped qwen3_5_moe_w4a8 recipe (routed experts W4A8_DYNAMIC:
int4 pairs packed along each projection's rows, per-channel scales, scale_bias; attention projections but o_proj
W8A8; the MTP head BF16): the runtime unpacks the experts at load and runs them on its int8 expert path. Checked
here: what the loader builds against the artifact's bytes, decoded by this file's own nibble arithmetic; each MoE
layer against a float64 per-token loop over dequantized weights; the logits' distance from the BF16 source; greedy
MTP == greedy; bad artifacts failing at load with the tensor named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from npuport.convert.converter import convert_qwen35
from npuport.convert.qwen35_names import text_prefix
from npuport.convert.recipe import recipe_path_for
from npuport.errors import ArtifactError
from npuport.runtime.generate import forward_logits, generate
from npuport.runtime.linear import W8A8Linear
from npuport.runtime.loader import load_model
from npuport.runtime.model import MoE

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

KINDS = ["moe-text-per-expert", "moe-multimodal-fused"]
DESCRIPTION = "quant_model_description.json"
INDEX = "quant_model_weights.safetensors.index.json"
# Against the BF16 source whose routed experts hold their dequantized int4 weights (q * scale), so that what is left
# is the int8 activations (and the W8A8 attention), as in W8A8: relative L2 error of all logits and argmax agreement.
# Measured (per-expert text / fused multimodal): 0.11 / 0.10 and 85% / 91% (28 and 30 of 33 positions).
DEQUANTIZED_REL_TOL = 0.2
DEQUANTIZED_TOP1 = 0.8
# Against the BF16 source itself: measured 0.53 / 0.43 relative, 33% / 39% argmax agreement (W8A8: 0.19, 88%), and
# the source with dequantized experts alone is as far (0.53 / 0.44): the distance is the int4 weights', not the
# runtime's. int4 per channel over K = 32 / 64 random Gaussian inputs moves each expert weight by about a tenth of
# its size, and these random tiny models amplify any perturbation (test_runtime_w8a8.py: BF16 instead of float32
# compute alone moves their logits by 15-75%). A bound that catches a wrong unpacking (noise: relative error about 1
# and more), not a statement about W4A8's accuracy: the trained MoE of the validation report is where that is read.
SOURCE_REL_TOL = 0.75
PROMPTS = [[31, 7, 1500, 42, 9], list(range(200, 217)), [1000, 3, 77, 640, 12, 18, 901, 5, 33, 2047, 64]]
SPEC_PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [400, 401, 402]]
MAX_NEW = 24


@pytest.fixture(scope="module")
def w4a8_artifacts(tiny_checkpoints, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("w4a8-artifacts")
    recipe = recipe_path_for("qwen3_5_moe_w4a8")
    return {kind: convert_qwen35(tiny_checkpoints[kind], root / kind, recipe_path=recipe, show_progress=False,
                                 log=lambda _: None).out for kind in KINDS}


class Tensors:
    """An artifact's tensors by name, read straight from its shards."""

    def __init__(self, folder):
        self.folder = folder
        self.weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        self.labels = json.loads((folder / DESCRIPTION).read_text())
        self.prefix = text_prefix(self.weight_map)

    def __call__(self, name: str) -> torch.Tensor:
        with safe_open(self.folder / self.weight_map[name], framework="pt") as f:
            return f.get_tensor(name)

    def name(self, runtime_name: str) -> str:
        return runtime_name if runtime_name.startswith(("mtp.", "lm_head")) else self.prefix + runtime_name


def decode_int4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [N/2, K] -> int64 [N, K]: row 2j is byte j's low nibble, row 2j + 1 its high one, each read as a signed
    4-bit number (0..7 as is, 8..15 as -8..-1)."""
    unsigned = packed.to(torch.int64) & 0xFF
    nibbles = torch.stack((unsigned & 0xF, unsigned >> 4), dim=1).reshape(-1, packed.shape[1])
    return torch.where(nibbles >= 8, nibbles - 16, nibbles)


def dequantized(t: Tensors, name: str) -> torch.Tensor:
    """Expert projection `name` (checkpoint name, no `.weight`) as float64 [N, K]: int4 value x weight_scale."""
    return decode_int4(t(name + ".weight")).double() * t(name + ".weight_scale").double()


def moe_layers(model):
    return [(f"layers.{i}.mlp", layer.mlp) for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoE)]


@pytest.mark.parametrize("kind", KINDS)
def test_layers_follow_their_labels_and_the_experts_hold_the_unpacked_int4_values(w4a8_artifacts, kind):
    t = Tensors(w4a8_artifacts[kind])
    model = load_model(t.folder, "cpu", torch.float32)
    assert t.labels["model_quant_type"] == "W8A8_DYNAMIC"  # as msModelSlim reports a W4A8 model
    int8_linears = [name for name, m in model.named_modules() if isinstance(m, W8A8Linear)]
    assert int8_linears and all(t.labels[t.name(n) + ".weight"] == "W8A8_DYNAMIC" for n in int8_linears)
    for name, moe in moe_layers(model):
        experts = moe.experts
        assert experts.quantized and experts.gate_up_proj.dtype == torch.int8
        i = experts.down_proj.shape[2]
        rows = {"gate_proj": slice(0, i), "up_proj": slice(i, 2 * i), "down_proj": slice(None)}
        for e in range(experts.gate_up_proj.shape[0]):
            for proj, part in rows.items():
                ck = f"{t.name(name)}.experts.{e}.{proj}"
                assert {t.labels[f"{ck}.{p}"] for p in ("weight", "weight_scale", "weight_offset", "scale_bias")} \
                    == {"W4A8_DYNAMIC"}
                stacked = experts.down_proj if proj == "down_proj" else experts.gate_up_proj
                scales = experts.down_proj_scale if proj == "down_proj" else experts.gate_up_proj_scale
                assert torch.equal(stacked[e, part].long(), decode_int4(t(ck + ".weight")))
                assert torch.equal(scales[e, part], t(ck + ".weight_scale").reshape(-1))
    assert model.mtp is not None
    assert all(not moe.experts.quantized for _, moe in moe_layers(model.mtp))  # the MTP head's experts stay BF16


def quantize_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's int8 values and scale as npuport's contract has them: scale = max |x| / 127 in float32, the
    values x / scale rounded half to even."""
    x32 = x.float()
    scale = (x32.abs().max() / torch.tensor(127.0)).clamp_min(1e-12)
    return (x32 / scale).round().clamp(-128, 127), scale


def int4_expert(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One token x [H] through one W4A8 expert, all float64 (weights dequantized): int8 activations times
    dequantized int4 weights, s_x * sum_k x_q[k] * (q[k] * s_w), then silu(gate) * up, quantized again, down."""
    x_q, s_x = quantize_token(x)
    h = F.silu(s_x.double() * (gate @ x_q.double())) * (s_x.double() * (up @ x_q.double()))
    h_q, s_h = quantize_token(h)
    return s_h.double() * (down @ h_q.double())


def moe_reference(t: Tensors, name: str, x: torch.Tensor, top_k: int, n_experts: int) -> torch.Tensor:
    """MoE layer `name` (runtime name) on tokens x [M, H] float64, one token at a time: the router's softmax and
    renormalised top-k, the W4A8 experts, the sigmoid-gated BF16 shared expert."""
    ck = t.name(name)
    router = t(ck + ".gate.weight").double()
    shared = {p: t(f"{ck}.shared_expert.{p}.weight").double() for p in ("gate_proj", "up_proj", "down_proj")}
    shared_gate = t(ck + ".shared_expert_gate.weight").double()
    experts = [{p: dequantized(t, f"{ck}.experts.{e}.{p}") for p in ("gate_proj", "up_proj", "down_proj")}
               for e in range(n_experts)]
    out = torch.zeros_like(x)
    for m in range(x.shape[0]):
        probs = torch.softmax(router @ x[m], dim=-1)
        weights, ids = probs.topk(top_k)
        weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), ids.tolist(), strict=True):
            out[m] += w * int4_expert(x[m], experts[e]["gate_proj"], experts[e]["up_proj"], experts[e]["down_proj"])
        dense = shared["down_proj"] @ (F.silu(shared["gate_proj"] @ x[m]) * (shared["up_proj"] @ x[m]))
        out[m] += torch.sigmoid(shared_gate @ x[m]) * dense
    return out


@torch.no_grad()
@pytest.mark.parametrize("kind", KINDS)
def test_each_moe_layer_equals_a_float64_per_token_loop_over_dequantized_int4_weights(w4a8_artifacts, kind):
    t = Tensors(w4a8_artifacts[kind])
    model = load_model(t.folder, "cpu", torch.float64)
    config = model.config
    gen = torch.Generator().manual_seed(0)
    for name, moe in moe_layers(model):
        x = torch.randn(1, 9, config.hidden_size, generator=gen, dtype=torch.float64)
        got = moe(x)[0]
        want = moe_reference(t, name, x[0], config.num_experts_per_tok, config.num_experts)
        # float64 rounding, where both sides round each activation to the same int8 level
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9 * float(want.abs().max()))


def with_dequantized_experts(model, t: Tensors):
    """The BF16 source model with each routed expert's weights replaced by the artifact's int4 x scale."""
    for name, moe in moe_layers(model):
        ck = t.name(name)
        experts = moe.experts
        for e in range(experts.gate_up_proj.shape[0]):
            gate, up, down = (dequantized(t, f"{ck}.experts.{e}.{p}") for p in ("gate_proj", "up_proj", "down_proj"))
            experts.gate_up_proj.data[e] = torch.cat([gate, up]).to(experts.gate_up_proj.dtype)
            experts.down_proj.data[e] = down.to(experts.down_proj.dtype)
    return model


def real_positions(logits: torch.Tensor) -> torch.Tensor:
    real = torch.cat([torch.arange(len(p)) + row * logits.shape[1] for row, p in enumerate(PROMPTS)])
    return logits.flatten(0, 1)[real]


@torch.no_grad()
@pytest.mark.parametrize("kind", KINDS)
def test_w4a8_logits_are_within_the_stated_tolerances(tiny_checkpoints, w4a8_artifacts, kind):
    t = Tensors(w4a8_artifacts[kind])
    quant = real_positions(forward_logits(load_model(t.folder, "cpu", torch.float32), PROMPTS)[0])
    source_model = load_model(tiny_checkpoints[kind], "cpu", torch.float32)
    source = real_positions(forward_logits(source_model, PROMPTS)[0])
    near = real_positions(forward_logits(with_dequantized_experts(source_model, t), PROMPTS)[0])
    assert (quant - near).norm() / near.norm() < DEQUANTIZED_REL_TOL
    assert (quant.argmax(-1) == near.argmax(-1)).float().mean() >= DEQUANTIZED_TOP1
    assert (quant - source).norm() / source.norm() < SOURCE_REL_TOL
    assert not torch.equal(quant, source)


@pytest.fixture(scope="module")
def greedy_w4a8(w4a8_artifacts):
    model = load_model(w4a8_artifacts["moe-text-per-expert"], "cpu", torch.float64)
    return model, generate(model, SPEC_PROMPTS, MAX_NEW).tokens


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_speculative_equals_greedy_on_a_w4a8_artifact(greedy_w4a8, k):
    """float64, as test_runtime_speculative.py: a verify of k + 1 tokens and k + 1 decodes agree to ~1e-12, so the
    int8 roundings of the W8A8 attention and the W4A8 experts take the same levels on both."""
    model, plain = greedy_w4a8
    assert generate(model, SPEC_PROMPTS, MAX_NEW, mtp=k).tokens == plain


@pytest.fixture()
def broken(w4a8_artifacts, tmp_path):
    """A copy of the per-expert W4A8 artifact, and a function that edits one of its tensors or its description."""
    artifact = tmp_path / "artifact"
    shutil.copytree(w4a8_artifacts["moe-text-per-expert"], artifact)
    weight_map = json.loads((artifact / INDEX).read_text())["weight_map"]

    def edit(name, change=None, relabel=None):
        if change is not None:
            shard = artifact / weight_map[name]
            weights = load_file(shard)
            weights[name] = change(weights[name])
            save_file(weights, shard, metadata={"format": "pt"})
        if relabel is not None:
            description = json.loads((artifact / DESCRIPTION).read_text())
            description[name] = relabel
            (artifact / DESCRIPTION).write_text(json.dumps(description))
        return artifact

    return edit


@pytest.mark.parametrize("proj", ["gate_proj", "down_proj"])
def test_a_scale_bias_that_disagrees_with_the_weights_fails_the_load(broken, proj):
    name = f"model.layers.1.mlp.experts.5.{proj}.scale_bias"

    def off_by_one_term(bias):
        bias = bias.clone()
        bias[3, -1] += bias.abs().max() / 10
        return bias

    column = 15 if proj == "down_proj" else 0
    with pytest.raises(ArtifactError, match=rf"tensor {name} disagrees .* row 3 column {column} "):
        load_model(broken(name, off_by_one_term), "cpu")


def test_a_nonzero_offset_fails_the_load(broken):
    name = "model.layers.2.mlp.experts.0.up_proj.weight_offset"
    with pytest.raises(ArtifactError, match=f"tensor {name} is not all zeros"):
        load_model(broken(name, lambda o: o + 1), "cpu")


def test_an_unpacked_weight_fails_the_load_with_its_shape(broken):
    """The config check sees a W4A8 weight's logical shape ([N, K] for the stored [N/2, K])."""
    name = "model.layers.0.mlp.experts.1.gate_proj.weight"
    with pytest.raises(ArtifactError, match=rf"tensor {name} has shape \[64, 64\], expected \[32, 64\]"):
        load_model(broken(name, lambda w: torch.cat([w, w])), "cpu")


def test_w4a8_outside_the_routed_experts_fails_the_load(broken):
    """An int8 projection relabelled W4A8_DYNAMIC, its weight cut to the packed row count the label implies."""
    name = "model.layers.3.self_attn.q_proj.weight"
    artifact = broken(name, lambda w: w[: w.shape[0] // 2].contiguous(), relabel="W4A8_DYNAMIC")
    with pytest.raises(ArtifactError, match=f"tensor {name} is labelled W4A8_DYNAMIC, which is for routed experts"):
        load_model(artifact, "cpu")


def test_the_validation_report_calls_a_w4a8_artifact_w4a8(w4a8_artifacts, tiny_checkpoints):
    from npuport.runtime.validation.labels import model_label

    artifact = w4a8_artifacts["moe-text-per-expert"]
    assert model_label(artifact, "bfloat16") == "W4A8"  # though model_quant_type says W8A8_DYNAMIC
    assert model_label(artifact, "float32") == "W4A8 (float32 compute)"
    assert model_label(tiny_checkpoints["moe-text-per-expert"], "bfloat16") == "BF16"
