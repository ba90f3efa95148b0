"""Every torch-npu operator npuport calls, held to torch-npu 2.14.0's documented prototypes, read from the wheel's
torch_npu/_op_plugin_docs.py (never imported): each stand-in of kernels/npu/standins.py has exactly the documented
signature (names, order, keyword-only part, defaults), and every call the native wrappers make - recorded while the
NPU path runs on small shapes - binds to the documented prototype. A prototype changed on purpose (an argument
renamed, two swapped) is reported by both checks."""

from __future__ import annotations

import ast
import contextlib
import fcntl
import inspect
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from npuport.devices import DeviceGraph, capturing_graph, graphs_supported, timed_graph
from npuport.kernels.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from npuport.kernels.decode_attention import decode_attention
from npuport.kernels.fused_moe import StackedExperts
from npuport.kernels.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from npuport.kernels.implementations import standing_in_for_npu
from npuport.kernels.npu import standins
from npuport.kernels.npu.moe import moe_experts_native, moe_routing_native
from npuport.kernels.npu.operators import OperatorCall, recording_calls
from npuport.kernels.rms_norm import add_rms_norm, rms_norm
from npuport.kernels.rope import apply_rope, rms_norm_rope
from npuport.kernels.w8a8 import int8_matmul_rescale, quantize_per_token_int8

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".bench" / "wheels"
VERSION = "2.14.0"
# The wheel for the platform its documentation is the same on (cp311, x86_64), whatever runs the tests.
DOWNLOAD = ["--no-deps", "--only-binary=:all:", "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64"]
DOCS = "torch_npu/_op_plugin_docs.py"


@pytest.fixture(scope="module")
def wheel() -> Path:
    """The torch-npu wheel, downloaded into .bench/wheels/ on first use. A failed download fails the test: CI has the
    package index."""
    WHEELS.mkdir(parents=True, exist_ok=True)
    with open(WHEELS.parent / "wheels.lock", "w") as lock:  # one downloader at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = sorted(WHEELS.glob(f"torch_npu-{VERSION}-*.whl"))
        if not found:
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q",
                                   *DOWNLOAD, "-d", str(WHEELS), f"torch-npu=={VERSION}"],
                                  capture_output=True, text=True, timeout=600)
            found = sorted(WHEELS.glob(f"torch_npu-{VERSION}-*.whl"))
            if done.returncode != 0 or not found:
                pytest.fail(f"downloading torch-npu {VERSION} failed:\n{done.stderr[-3000:]}")
    return found[0]


def read_from(wheel: Path, member: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(member).decode()


@pytest.fixture(scope="module")
def docs_source(wheel) -> str:
    """The text of _op_plugin_docs.py in the torch-npu wheel."""
    return read_from(wheel, DOCS)


def doc_blocks(source: str) -> dict[str, str]:
    """operator name -> its documentation text (the _add_torch_npu_docstr(name, text) calls)."""
    return dict(re.findall(r'_add_torch_npu_docstr\(\s*"(\w+)",\s*"""(.*?)"""\s*\)', source, re.S))


def prototype_text(doc: str, name: str) -> str:
    """The parameter list of `name`'s prototype in its documentation: `[torch_npu.]name(...)` at a line's start,
    up to the matching parenthesis, whitespace collapsed (some span lines)."""
    found = re.search(rf"(?m)^\s*(?:torch_npu\.)?{name}\(", doc)
    assert found, f"no prototype of {name} in its documentation"
    depth, at = 1, found.end()
    for i in range(found.end(), len(doc)):
        depth += {"(": 1, ")": -1}.get(doc[i], 0)
        if depth == 0:
            at = i
            break
    return " ".join(doc[found.end():at].split())


def split_top_level(params: str) -> list[str]:
    """params split at the commas outside brackets (`Tensor(a!) state`, `int[2] x=[]`)."""
    parts, depth, current = [], 0, ""
    for ch in params:
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [p.strip() for p in [*parts, current] if p.strip()]


def parse_prototype(params: str) -> inspect.Signature:
    """A documented parameter list - typed (`Tensor? x=None`) or not (`x=None`) - as a Python signature: the names,
    `*` making those after it keyword-only, the defaults as Python values."""
    out, kind = [], inspect.Parameter.POSITIONAL_OR_KEYWORD
    for param in split_top_level(params):
        if param == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        declared, _, default = param.partition("=")
        name = declared.split()[-1]
        value = ast.literal_eval(default.strip()) if default else inspect.Parameter.empty
        out.append(inspect.Parameter(name, kind, default=value))
    return inspect.Signature(out)


def documented_prototypes(source: str) -> dict[str, inspect.Signature]:
    """name -> documented signature, for every operator npuport has a stand-in of."""
    blocks = doc_blocks(source)
    missing = sorted(set(stand_in_names()) - set(blocks))
    assert not missing, f"torch-npu {VERSION} documents no {missing}"
    return {name: parse_prototype(prototype_text(blocks[name], name)) for name in stand_in_names()}


def stand_in_names() -> list[str]:
    return sorted(name for name, fn in vars(standins).items() if name.startswith("npu_") and inspect.isfunction(fn))


def described(signature: inspect.Signature) -> list[tuple[str, str, object]]:
    """What must match: each parameter's name, kind and default, in order."""
    return [(p.name, p.kind.name, p.default) for p in signature.parameters.values()]


def signature_mismatches(documented: dict[str, inspect.Signature]) -> list[str]:
    """The stand-ins whose signature is not the documented one, with both."""
    return [f"{name}: stand-in {described(inspect.signature(getattr(standins, name)))} documented "
            f"{described(documented[name])}"
            for name in stand_in_names() if described(inspect.signature(getattr(standins, name)))
            != described(documented[name])]


def unbound_calls(documented: dict[str, inspect.Signature], calls: list[OperatorCall]) -> list[str]:
    """The recorded calls that do not bind to their operator's documented prototype, with why."""
    wrong = []
    for call in calls:
        try:
            documented[call.name].bind(*call.args, **call.kwargs)
        except TypeError as error:
            wrong.append(f"{call.name}: {error}")
    return wrong


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def experts(gen: torch.Generator, count: int, hidden: int, inter: int, quantized: bool) -> StackedExperts:
    gate_up, down = randn(gen, count, 2 * inter, hidden), randn(gen, count, hidden, inter)
    if not quantized:
        return StackedExperts(gate_up, down)
    return StackedExperts((gate_up * 40).to(torch.int8), (down * 40).to(torch.int8),
                          torch.rand(count, 2 * inter, generator=gen), torch.rand(count, hidden, generator=gen))


def run_the_npu_path() -> None:
    """Every native wrapper on small bf16 shapes within its operator's constraints, as the entry points call it."""
    gen = torch.Generator().manual_seed(0)
    x, weight = randn(gen, 4, 64), randn(gen, 64)
    rms_norm(x, weight, 1e-6)
    add_rms_norm(x, randn(gen, 4, 64), weight, 1e-6)
    q = randn(gen, 2, 3, 4, 32)
    cos, sin = randn(gen, 2, 3, 8), randn(gen, 2, 3, 8)
    rms_norm_rope(q, randn(gen, 32), 1e-6, cos, sin)
    apply_rope(q, cos, sin)
    x_q, x_scale = quantize_per_token_int8(x)
    int8_matmul_rescale(x_q, x_scale, torch.randint(-128, 128, (16, 64), generator=gen, dtype=torch.int8),
                        torch.rand(16, 1, generator=gen), torch.bfloat16)
    keys, values = randn(gen, 2, 24, 2, 32), randn(gen, 2, 24, 2, 32)
    for tokens in (1, 3):
        decode_attention(randn(gen, 2, tokens, 4, 32), keys, values, torch.tensor([5, 20]),
                         randn(gen, 2, tokens, 4, 32))
    conv_x, conv_w, window = randn(gen, 2, 2, 128), randn(gen, 128, 3), randn(gen, 2, 128, 4)
    causal_conv1d_update(conv_x, conv_w, window)
    causal_conv1d_fn(conv_x, conv_w, window, torch.tensor([2, 1]))
    qk = randn(gen, 2, 1, 2, 16)
    fused_recurrent_gated_delta_rule(qk, qk, randn(gen, 2, 1, 4, 16), randn(gen, 2, 1, 4), randn(gen, 2, 1, 4),
                                     torch.zeros(2, 4, 16, 16), A_log=torch.zeros(4), dt_bias=torch.ones(4))
    qk = randn(gen, 1, 4, 1, 128)
    chunk_gated_delta_rule(qk, qk, randn(gen, 1, 4, 2, 128), -torch.rand(1, 4, 2), torch.rand(1, 4, 2))
    weights, ids = moe_routing_native(randn(gen, 5, 8), 2, torch.bfloat16)
    tokens = randn(gen, 5, 32)
    for quantized in (False, True):
        moe_experts_native(tokens, experts(gen, 8, 32, 16, quantized), weights, ids,
                           shared=(experts(gen, 1, 32, 16, quantized), torch.rand(5, 1, generator=gen).bfloat16()))


@pytest.fixture(scope="module")
def npu_calls() -> list[OperatorCall]:
    with standing_in_for_npu(), recording_calls() as calls:
        run_the_npu_path()
    return calls


def test_every_stand_in_has_the_documented_signature(docs_source):
    assert signature_mismatches(documented_prototypes(docs_source)) == []


def test_every_operator_call_binds_to_its_documented_prototype(docs_source, npu_calls):
    assert {call.name for call in npu_calls} == set(stand_in_names())  # every operator npuport calls was called
    assert unbound_calls(documented_prototypes(docs_source), npu_calls) == []


def planted(source: str, name: str, old: str, new: str) -> str:
    """source with `old` replaced by `new` in `name`'s prototype only."""
    doc = doc_blocks(source)[name]
    params = prototype_text(doc, name)
    assert old in params
    changed_doc = doc.replace(prototype_text(doc, name), params.replace(old, new), 1)
    assert changed_doc != doc, "the prototype spans lines: plant the change in one that does not"
    return source.replace(doc, changed_doc)


def test_a_renamed_argument_is_reported_by_both_checks(docs_source, npu_calls):
    changed = documented_prototypes(planted(docs_source, "npu_quant_matmul", "pertoken_scale", "per_token_scale"))
    assert [m.split(":")[0] for m in signature_mismatches(changed)] == ["npu_quant_matmul"]
    unbound = unbound_calls(changed, npu_calls)
    assert unbound and all(m.startswith("npu_quant_matmul:") and "pertoken_scale" in m for m in unbound)


def test_two_swapped_arguments_are_reported(docs_source, npu_calls):
    changed = documented_prototypes(planted(docs_source, "npu_rotary_mul", "Tensor r1, Tensor r2",
                                            "Tensor r2, Tensor r1"))
    assert [m.split(":")[0] for m in signature_mismatches(changed)] == ["npu_rotary_mul"]
    # a keyword argument moved before the `*` of another prototype no longer binds where it is passed by keyword
    moved = documented_prototypes(planted(docs_source, "npu_dynamic_quant", "Tensor x, *,", "*, Tensor x,"))
    assert [m.split(":")[0] for m in unbound_calls(moved, npu_calls)] == ["npu_dynamic_quant"] * sum(
        call.name == "npu_dynamic_quant" for call in npu_calls)


def signature_of(function: ast.FunctionDef, method: bool) -> inspect.Signature:
    """The Python signature of a function in source (self dropped for a method); defaults as placeholders."""
    args = function.args
    positional = [*args.posonlyargs, *args.args][1 if method else 0:]
    first_default = len(positional) - len(args.defaults)
    params = [inspect.Parameter(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                default=None if i >= first_default else inspect.Parameter.empty)
              for i, a in enumerate(positional)]
    params += [inspect.Parameter(a.arg, inspect.Parameter.KEYWORD_ONLY,
                                 default=inspect.Parameter.empty if d is None else None)
               for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    return inspect.Signature(params)


def graph_api(source: str) -> dict[str, inspect.Signature]:
    """The signatures in torch_npu/npu/graphs.py that npuport's graphs call: the module's functions, and NPUGraph's and
    graph's methods as 'Class.method' (a class's constructor under its own name)."""
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = signature_of(node, method=False)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    key = node.name if item.name == "__init__" else f"{node.name}.{item.name}"
                    found[key] = signature_of(item, method=True)
    found.setdefault("NPUGraph", inspect.Signature([]))
    return found


def fake_npu_runtime(calls: list[tuple[str, tuple, dict]]) -> SimpleNamespace:
    """torch.npu as npuport.devices uses it for graphs, recording the graph API's calls."""

    def recorded(name, result=None):
        def call(*args, **kwargs):
            calls.append((name, args, kwargs))
            return result
        return call

    def recorded_method(name):
        def call(self, *args, **kwargs):
            calls.append((name, args, kwargs))
        return call

    class NPUGraph:
        __init__ = recorded_method("NPUGraph")
        replay = recorded_method("NPUGraph.replay")
        reset = recorded_method("NPUGraph.reset")

    class Stream:
        def __init__(self, device=None) -> None:
            pass

        def wait_stream(self, other) -> None:
            pass

    class Event:
        def __init__(self, enable_timing=False) -> None:
            pass

        record = synchronize = recorded_method("Event")

        def elapsed_time(self, other) -> float:
            return 4.0

    @contextlib.contextmanager
    def graph(*args, **kwargs):
        calls.append(("graph", args, kwargs))
        yield

    return SimpleNamespace(NPUGraph=NPUGraph, graph=graph, Stream=Stream, Event=Event,
                           current_stream=lambda device=None: Stream(), stream=lambda s: contextlib.nullcontext(),
                           device=lambda d: contextlib.nullcontext(),
                           graph_pool_handle=recorded("graph_pool_handle", "a pool"),
                           is_current_stream_capturing=recorded("is_current_stream_capturing", True))


def test_npu_graphs_go_through_torch_npus_graph_api(wheel, monkeypatch):
    calls: list[tuple[str, tuple, dict]] = []
    monkeypatch.setattr(torch, "npu", fake_npu_runtime(calls), raising=False)
    npu = SimpleNamespace(type="npu", index=0)  # what devices.py reads of a torch.device("npu", 0)
    assert graphs_supported(npu) and capturing_graph(npu)
    graph = DeviceGraph(npu, DeviceGraph.new_pool(npu))
    assert graph.warm_up(lambda: 3) == 3 and graph.capture(lambda: 5) == 5
    graph.replay()
    replay_ms = timed_graph(lambda: None, npu, calls=2)
    assert replay_ms() == 2.0  # torch.npu's events time it
    DeviceGraph.release_all()
    made = [name for name, _, _ in calls if name != "Event"]
    assert made == ["is_current_stream_capturing", "graph_pool_handle", "NPUGraph", "graph", "NPUGraph.replay",
                    "NPUGraph", "graph", "NPUGraph.replay", "NPUGraph.replay", "NPUGraph.reset", "NPUGraph.reset"]
    capture = next(kwargs for name, _, kwargs in calls if name == "graph")
    assert capture == {"pool": "a pool", "capture_error_mode": "global"}
    api = graph_api(read_from(wheel, "torch_npu/npu/graphs.py"))
    for name, args, kwargs in calls:
        if name != "Event":
            api[name].bind(*args, **kwargs)
