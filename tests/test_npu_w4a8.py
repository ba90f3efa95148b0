"""W4A8_DYNAMIC experts on the NPU path. torch-npu 2.14.0's documentation (torch_npu/_op_plugin_docs.py in the wheel,
read as test_npu_prototypes.py reads it) gives npu_grouped_matmul int4 weights only in its weight-only quantized
form (float16 / bfloat16 tokens, antiquant_scale): its per-token quantized form (int8 tokens, per_token_scale) takes
int8 weights. A8W4 appears only in two fused operators that do not fit npuport's expert path as documented:
npu_grouped_matmul_swiglu_quant_v2 (gate / up, SwiGLU and the requantization in one; its A8W4 `weight_assist_matrix`
is named but given no formula, the weight documented in FRACTAL_NZ format) and npu_grouped_matmul_finalize_routing
(down and the combine in one; a8w4 only for k = 2048 and n = 7168). So the runtime unpacks W4A8 experts to int8 at
load and the NPU runs them through the documented W8A8 operators (kernels/npu/moe.py): the int4 values as int8,
the same arithmetic, twice the expert bytes of the artifact. These tests pin both: the documentation's statements
(a later torch-npu that documents int4 weights beside int8 tokens fails the first test, the cue to add a wrapper) and
the wiring of a W4A8 artifact's MoE layer through the stand-ins."""

from __future__ import annotations

import pytest
import torch

from npuport.convert.converter import convert_qwen35
from npuport.convert.recipe import recipe_path_for
from npuport.kernels.implementations import standing_in_for_npu
from npuport.kernels.npu.operators import recording_calls
from npuport.runtime.loader import load_model
from npuport.runtime.model import MoE
from tests.test_npu_prototypes import doc_blocks, docs_source, wheel  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def table_rows(doc: str, scenario: str, after: str) -> dict[str, str]:
    """The `key: values` lines of the data type table `scenario` (e.g. per-token量化) that follows `after`."""
    start = doc.index(scenario, doc.index(after)) + len(scenario)
    rows = {}
    for line in doc[start:].splitlines()[1:]:
        key, sep, values = line.partition(":")
        if not sep or " " in key.strip():
            break
        rows[key.strip()] = values.strip()
    return rows


def test_the_documentation_takes_int4_weights_only_beside_float_tokens(docs_source):  # noqa: F811
    blocks = doc_blocks(docs_source)
    gmm = blocks["npu_grouped_matmul"]
    tensor_tables = "group_list输入类型为torch.Tensor时, 数据类型使用约束"
    per_token = table_rows(gmm, "per-token量化", tensor_tables)
    assert per_token["x"] == "torch.int8, torch.int8" and per_token["weight"] == "torch.int8, torch.int8"
    per_channel = table_rows(gmm, "per-channel量化", tensor_tables)
    assert "int4" not in per_channel["weight"]
    weight_only = table_rows(gmm, "伪量化", tensor_tables)
    assert weight_only["weight"] == "torch.int8/int4, torch.int8/int4"
    assert weight_only["x"] == "torch.float16, torch.bfloat16" and "antiquant_scale" in weight_only
    swiglu = blocks["npu_grouped_matmul_swiglu_quant_v2"]
    assert "支持 A8W8、A8W4、A4W4" in swiglu and "仅 A8W4 场景使用" in swiglu  # weight_assist_matrix: no formula
    finalize = blocks["npu_grouped_matmul_finalize_routing"]
    assert "a8w4场景下数据格式支持ND，维度为(e,k,n)，k只支持2048，n只支持7168" in finalize


@pytest.fixture(scope="module")
def w4a8_model(tiny_checkpoints, tmp_path_factory):
    out = convert_qwen35(tiny_checkpoints["moe-text-per-expert"], tmp_path_factory.mktemp("npu-w4a8") / "w4a8",
                         recipe_path=recipe_path_for("qwen3_5_moe_w4a8"), show_progress=False,
                         log=lambda _: None).out
    return load_model(out, "cpu", torch.float32)


@torch.no_grad()
def test_w4a8_experts_run_through_the_w8a8_moe_operators_and_equal_the_cpu_path(w4a8_model):
    gen = torch.Generator().manual_seed(3)
    layers = [layer.mlp for layer in w4a8_model.layers if isinstance(layer.mlp, MoE)]
    assert layers and all(moe.experts.quantized for moe in layers)
    for moe in layers:
        x = torch.randn(1, 7, w4a8_model.config.hidden_size, generator=gen)
        want = moe(x)
        with standing_in_for_npu(), recording_calls() as calls:
            got = moe(x)
        names = [c.name for c in calls]
        assert "npu_moe_init_routing_v2" in names and "npu_moe_finalize_routing" in names
        weights = [c.args[1][0] for c in calls if c.name == "npu_grouped_matmul"]
        # the routed experts' gate / up and down as int8 with per-token scales, the BF16 shared expert's two
        int8_calls = [c for c in calls if c.name == "npu_grouped_matmul" and c.args[1][0].dtype == torch.int8]
        assert len(int8_calls) == 2 and len(weights) == 4
        assert all(c.kwargs["per_token_scale"] is not None for c in int8_calls)
        assert int(int8_calls[0].args[1][0].min()) >= -8 and int(int8_calls[0].args[1][0].max()) <= 7
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
