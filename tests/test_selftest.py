"""`npuport selftest` (runtime/selftest*.py): on the CPU it runs every Triton kernel in the interpreter against its
reference and the trained tiny model's greedy tokens against MTP, passes and writes its JSON; a kernel planted to
raise and one planted to return wrong values are each switched to their reference with one warning, the run
completes with exit 1, and the JSON and kernels.implementations name them. Quick shapes throughout."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("triton")

import npuport.kernels.causal_conv1d as conv_module  # noqa: E402
import npuport.kernels.gdn_gating as gating_module  # noqa: E402
from npuport.cli import main  # noqa: E402
from npuport.fixtures.tiny_checkpoint import REAL_MODELS, like_spec, text_config  # noqa: E402
from npuport.kernels import implementations  # noqa: E402
from npuport.runtime.selftest import kernel_checks as selftest_kernels  # noqa: E402
from npuport.runtime.selftest import run as selftest_run  # noqa: E402
from npuport.runtime.selftest.run import (  # noqa: E402
    INSTALL_TRITON,
    INTERPRETED,
    NO_TRITON,
    TINY_MODEL,
    CheckResult,
    SelftestResult,
    implementations_record,
    quiet_selftest,
    summary,
    write_json_atomically,
)
from npuport.runtime.selftest.sizes import CONV_WIDTH, MODEL_WIDTHS  # noqa: E402
from npuport.runtime.selftest.tolerance import EXACT, Tolerance  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

CHECK_FIELDS = {"op", "implementation", "widths", "step", "shape", "max_error", "tolerance", "ms", "passed", "error",
                "note"}
# Every operator with a Triton kernel to interpret (RoPE alone is PyTorch on every device but an NPU).
INTERPRETED_OPS = set(implementations.OPERATORS) - {"rope"}


@pytest.fixture(autouse=True)
def forget_fall_backs():
    """Operators a test's run switched to their references run their kernels again in the next test."""
    with implementations.reset_fall_backs():
        yield


def run_selftest(tmp_path, *extra: str):
    """`npuport selftest --quick --device cpu` in this process: (exit code, output, the JSON, fall-back warnings)."""
    out = tmp_path / "selftest.json"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = CliRunner().invoke(main, ["selftest", "--quick", "--device", "cpu", "--out", str(out), *extra])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    fell_back = [str(w.message) for w in caught if "switched to its PyTorch reference" in str(w.message)]
    return result.exit_code, result.output, json.loads(out.read_text()), fell_back


@pytest.mark.parametrize("widths", MODEL_WIDTHS, ids=lambda w: w.name)
def test_the_published_widths_are_the_fixtures_real_models(widths):
    real = REAL_MODELS[widths.name]
    assert (widths.hidden, widths.heads, widths.kv_heads, widths.head_dim) == (
        real.hidden_size, real.num_attention_heads, real.num_key_value_heads, real.head_dim)
    assert (widths.key_heads, widths.value_heads, widths.key_dim, widths.value_dim) == (
        real.linear_num_key_heads, real.linear_num_value_heads, real.linear_key_head_dim, real.linear_value_head_dim)
    assert (widths.experts, widths.top_k, widths.expert_intermediate) == (
        real.num_experts, real.num_experts_per_tok, real.moe_intermediate_size)
    config = text_config(like_spec(widths.name, layers=1), real.vocab_size, 0, 0)
    assert widths.rotary == widths.head_dim * config["rope_parameters"]["partial_rotary_factor"]
    assert config["linear_conv_kernel_dim"] == CONV_WIDTH


def test_tolerances_judge_as_their_descriptions_say():
    want = torch.tensor([1.0, -2.0, 0.5, 4.0], dtype=torch.bfloat16)
    one_ulp = torch.tensor([1.0078125, -2.0, 0.5, 4.0], dtype=torch.bfloat16)  # bf16 next after 1.0
    assert EXACT.judge(want.clone(), want) == (0.0, True)
    assert EXACT.judge(one_ulp, want) == (0.0078125, False)
    assert not EXACT.judge(want.float(), want)[1]  # another dtype is not bit for bit
    close = Tolerance(rtol=0, atol=0.01)
    assert close.judge(one_ulp, want)[1] and not Tolerance(atol=0.005).judge(one_ulp, want)[1]
    assert not Tolerance(atol=0.01, min_equal=0.8).judge(one_ulp, want)[1]  # 3 of 4 equal
    nan = torch.tensor([float("nan"), -2.0, 0.5, 4.0], dtype=torch.bfloat16)
    assert not close.judge(nan, want)[1]
    assert not close.judge(want[:3], want)[1]  # another shape
    got, ref = torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5])
    error, passed = Tolerance(relative_l2=0.1).judge(got, ref)
    assert error == pytest.approx(0.5 / (3.0**2 + 4.5**2) ** 0.5) and passed
    assert not Tolerance(relative_l2=0.05).judge(got, ref)[1]


def test_selftest_on_cpu_passes_and_writes_its_json(tmp_path):
    code, output, report, fell_back = run_selftest(tmp_path)
    assert code == 0, output
    counts = [sum(c["passed"] is state for c in report["checks"]) for state in (True, None)]
    assert "selftest: passed on cpu" in output and not fell_back
    assert f" {counts[0]} passed, {counts[1]} skipped, 0 failed of {len(report['checks'])} checks" in output
    assert report["passed"] is True and report["device"] == "cpu" and report["fallen_back"] == {}
    assert report["versions"]["torch"] == torch.__version__
    assert report["versions"]["triton"] and report["versions"]["torch-npu"] is None
    assert set(report["implementations"]) == set(implementations.OPERATORS)
    for check in report["checks"]:
        assert set(check) == CHECK_FIELDS
        assert check["passed"] is not False, check
        assert len(check["max_error"]) == len(check["tolerance"])
    kernels = [c for c in report["checks"] if c["op"] != TINY_MODEL]
    assert {c["op"] for c in kernels} == INTERPRETED_OPS
    assert all(c["implementation"] == INTERPRETED and c["passed"] and c["shape"] and c["ms"] > 0 for c in kernels)
    model = {c["step"]: c for c in report["checks"] if c["op"] == TINY_MODEL}
    assert [model[f"MTP k={k} vs greedy"]["max_error"] for k in (1, 2, 3)] == [[0.0]] * 3
    assert model["greedy, graphs vs eager"]["note"] == "not supported here"
    assert not list(tmp_path.glob(".selftest.json.*"))  # written in place of a temporary file


def test_failing_kernels_are_switched_to_their_references_and_the_run_completes(tmp_path, monkeypatch):
    """The conv update kernel raises (as a kernel that does not compile), the gating kernel returns g off by one:
    each is switched to its reference with exactly one warning - the conv's later prefill check is not run - and
    every other check still runs and passes."""

    def does_not_compile(*args, **kwargs):
        raise RuntimeError("planted: the compiler refuses this kernel")

    def wrong_gating(*args):
        g, beta = gating_module.fused_gdn_gating_reference(*args)
        return g + 1, beta

    monkeypatch.setattr(conv_module, "causal_conv1d_update_triton", does_not_compile)
    monkeypatch.setattr(gating_module, "fused_gdn_gating_triton", wrong_gating)
    gpu = torch.device("cuda")  # what the runtime would take there: a device type, no GPU needed to ask
    with implementations.reset_fall_backs():
        assert implementations.implementation("causal_conv1d", gpu) == implementations.TRITON
        code, output, report, fell_back = run_selftest(tmp_path)
        assert implementations.implementation("causal_conv1d", gpu) == implementations.REFERENCE
        assert implementations.implementation("gdn_gating", gpu) == implementations.REFERENCE
        assert implementations.implementation("rms_norm", gpu) == implementations.TRITON
    assert implementations.implementation("gdn_gating", gpu) == implementations.TRITON  # reset afterwards
    assert code == 1
    assert sorted(message.split()[1] for message in fell_back) == ["causal_conv1d", "gdn_gating"]
    summary = next(line for line in output.splitlines() if line.startswith("selftest:"))
    assert "2 failed of" in summary and summary.endswith(f"wrote {tmp_path / 'selftest.json'}")
    assert set(summary.split("references: ")[1].split(";")[0].split(", ")) == {"causal_conv1d", "gdn_gating"}
    assert set(report["fallen_back"]) == {"causal_conv1d", "gdn_gating"} and report["passed"] is False
    assert "planted: the compiler refuses this kernel" in report["fallen_back"]["causal_conv1d"]
    by_op = {}
    for check in report["checks"]:
        by_op.setdefault(check["op"], []).append(check)
    update, prefill = by_op["causal_conv1d"]
    assert update["passed"] is False and "RuntimeError: planted" in update["error"]
    assert prefill["passed"] is None and prefill["note"].startswith("not run: switched to its reference")
    (gating,) = by_op["gdn_gating"]
    assert gating["passed"] is False and gating["max_error"][0] == pytest.approx(1.0)
    others = [c for op, checks in by_op.items() if op not in ("causal_conv1d", "gdn_gating") for c in checks]
    assert {c["op"] for c in others} == INTERPRETED_OPS - {"causal_conv1d", "gdn_gating"} | {TINY_MODEL}
    assert all(c["passed"] is not False for c in others)


def test_quiet_selftest_runs_nothing_on_the_cpu():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = quiet_selftest(torch.device("cpu"))
    assert result.checks == [] and result.passed and "CPU runs the references" in result.note
    assert not caught


def test_the_implementations_record_names_every_operator_and_why_one_fell_back():
    gpu = torch.device("cuda")
    with implementations.reset_fall_backs(), warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        implementations.fall_back("decode_attention", "planted: disagrees")
        record = implementations_record(gpu)
    assert set(record["implementations"]) == set(implementations.OPERATORS)
    assert record["implementations"]["decode_attention"] == implementations.REFERENCE
    assert record["implementations"]["rms_norm"] == implementations.TRITON
    assert record["fallen_back"] == {"decode_attention": "planted: disagrees"}


def test_on_an_npu_operators_are_checked_native_and_as_batch_invariant_steps_call_them(monkeypatch):
    """Batch-invariant steps take triton-ascend where CANN's operator may reduce in any order: both are checked."""
    monkeypatch.setattr(selftest_kernels, "is_npu", lambda device: True)
    specs = list(selftest_kernels.kernel_checks(torch.device("cuda"), quick=True))  # nothing is allocated yet
    both = implementations.NATIVE_ON_NPU - implementations.ORDER_FREE
    for op in implementations.OPERATORS:
        kinds = {spec.invariant for spec in specs if spec.op == op}
        assert kinds == ({False, True} if op in both else {False}), op


def test_a_non_finite_error_is_written_as_text(tmp_path):
    check = CheckResult("rms_norm", "triton", "35B-A3B", "decode 1x1", max_error=[float("inf"), 0.5],
                        tolerance=["bit-exact", "bit-exact"], passed=False)
    result = SelftestResult("cuda", "a GPU", {}, [check], {}, {}, 1.0)
    write_json_atomically(tmp_path / "selftest.json", result.to_json())
    written = json.loads((tmp_path / "selftest.json").read_text())
    assert written["checks"][0]["max_error"] == ["inf", 0.5] and written["passed"] is False


def test_the_json_is_written_whole_or_not_at_all(tmp_path):
    path = tmp_path / "selftest.json"
    write_json_atomically(path, {"passed": True})
    with pytest.raises(TypeError):
        write_json_atomically(path, {"passed": object()})  # not JSON: fails half-way through
    assert json.loads(path.read_text()) == {"passed": True}
    assert [p.name for p in tmp_path.iterdir()] == ["selftest.json"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_selftest_on_a_gpu_passes_and_switches_a_planted_failure(tmp_path, monkeypatch):
    """The published widths through the kernels' entry points, the tiny model with and without CUDA graphs; then a
    gating kernel returning wrong values is switched to its reference and the model's checks still pass."""
    runner = CliRunner()
    out = tmp_path / "gpu.json"
    assert runner.invoke(main, ["selftest", "--quick", "--device", "cuda", "--out", str(out)]).exit_code == 0
    report = json.loads(out.read_text())
    assert all(c["passed"] for c in report["checks"]) and report["device"] == "cuda"
    monkeypatch.setattr(gating_module, "fused_gdn_gating_triton",
                        lambda *args: tuple(t + 1 for t in gating_module.fused_gdn_gating_reference(*args)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = runner.invoke(main, ["selftest", "--quick", "--device", "cuda", "--out", str(out)])
    assert implementations.implementation("gdn_gating", torch.device("cuda")) == implementations.REFERENCE
    assert [str(w.message).split()[1] for w in caught if "switched to its" in str(w.message)] == ["gdn_gating"]
    report = json.loads(out.read_text())
    assert result.exit_code == 1 and set(report["fallen_back"]) == {"gdn_gating"}
    assert all(c["passed"] is not False for c in report["checks"] if c["op"] != "gdn_gating")


def test_the_summary_counts_passes_skips_and_fallbacks_and_says_how_to_run_the_skipped():
    """It ended "all 4 checks passed" after skipping 21 kernel checks for want of triton, and said nothing of them."""
    no_triton = f"{NO_TRITON}, so its interpreter cannot run the kernel"
    checks = [CheckResult("rms_norm", INTERPRETED, "27B", "decode", passed=True),
              CheckResult("gdn_gating", INTERPRETED, "27B", "decode", note=no_triton),
              CheckResult("kv_write", INTERPRETED, "27B", "decode", note=no_triton),
              CheckResult("causal_conv1d", INTERPRETED, "27B", "decode", passed=False, error="RuntimeError: x"),
              CheckResult("causal_conv1d", INTERPRETED, "27B", "prefill", note="not run: switched earlier")]
    line = summary(SelftestResult("cpu", "a CPU", {}, checks, {}, {"causal_conv1d": "failed"}, 3.0))
    assert line.startswith("selftest: FAILED on cpu") and "1 passed, 3 skipped, 1 failed of 5 checks" in line
    assert "switched to their PyTorch references: causal_conv1d" in line
    assert f"2 skipped as triton is not installed: {INSTALL_TRITON} runs them" in line
    assert "also skipped: causal_conv1d prefill (switched earlier)" in line
    clean = summary(SelftestResult("cpu", "a CPU", {}, checks[:1], {}, {}, 1.0))
    assert clean.startswith("selftest: passed") and "none fell back" in clean and "install" not in clean


def test_the_install_hint_names_the_triton_of_the_test_extra():
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    assert f'"{INSTALL_TRITON.split(chr(39))[1]}"' in pyproject.split("test = [", 1)[1].split("]", 1)[0]


@pytest.mark.parametrize("out", ["", "missing/selftest.json", "/proc/selftest.json", "/proc"])
def test_an_out_that_cannot_be_written_is_refused_before_the_run(tmp_path, monkeypatch, out):
    """They ran the whole self-test and then failed, losing the result."""

    def must_not_run(*args, **kwargs):
        raise AssertionError("the self-test ran")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(selftest_run, "run_selftest", must_not_run)
    result = CliRunner().invoke(main, ["selftest", "--quick", "--device", "cpu", "--out", out])
    assert result.exit_code in (1, 2) and "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    errors = [line for line in result.output.splitlines() if line.lower().startswith("error:")]
    assert len(errors) == 1 and "--out" in errors[0], result.output
