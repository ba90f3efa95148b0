"""What a newcomer no longer trips on: the runtime computes in float32 on a CPU unless told otherwise (bfloat16 there is
emulated, about 10x slower) and bfloat16 on an NPU or GPU, and the command's first line says which; `--a8w8` and
`--gsm8k`, each the only choice, are the defaults (and still accepted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import npuport.devices as devices
from npuport.cli import main
from npuport.errors import NpuportError
from npuport.fixtures.tiny_checkpoint import TinySpec, make_tiny

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("defaults") / "Qwen3.5-tiny", TinySpec(layout="text"))


def test_the_default_dtype_is_float32_on_a_cpu_and_bfloat16_on_an_accelerator(monkeypatch):
    assert devices.default_dtype("cpu") == "float32"
    monkeypatch.setattr(devices, "_available", lambda kind: True)
    assert devices.default_dtype("cuda") == devices.default_dtype("npu") == "bfloat16"


@pytest.mark.parametrize(("given", "used"), [([], "float32"), (["--dtype", "bfloat16"], "bfloat16")])
def test_generate_says_which_dtype_it_runs_in(source, given, used):
    args = ["generate", str(source), "--device", "cpu", "--prompt-ids", "1,2,3", "--max-new-tokens", "2", *given]
    shown, as_json = (CliRunner().invoke(main, [*args, *extra]) for extra in ([], ["--json"]))
    assert shown.exit_code == as_json.exit_code == 0, shown.output + as_json.output
    assert shown.output.splitlines()[0] == f"{source} on cpu in {used}"
    assert json.loads(as_json.output)["dtype"] == used


def test_serve_runs_float32_on_a_cpu_by_default(source, monkeypatch):
    import npuport.runtime.serving.serve as serve

    asked = {}
    monkeypatch.setattr(serve, "serve_model", lambda *args, **kwargs: asked.update(kwargs))
    result = CliRunner().invoke(main, ["serve", str(source), "--device", "cpu", "--port", "0"])
    assert result.exit_code == 0, result.output
    assert asked["dtype"] == "float32"  # its line once it listens names it: tests/test_serve_limits.py


def test_validate_needs_no_gsm8k_flag_and_runs_float32_on_a_cpu(source, tmp_path, monkeypatch):
    import npuport.runtime.validation.validate as validate

    asked = []

    def stop_here(options, out, log):
        asked.append(options)
        raise NpuportError("stopped by the test")

    monkeypatch.setattr(validate, "run_validation", stop_here)
    result = CliRunner().invoke(main, ["validate", str(source), "--device", "cpu", "--out", str(tmp_path / "report")])
    assert result.exit_code == 1 and "stopped by the test" in result.output, result.output
    assert asked[0].dtype == "float32"


def test_convert_needs_no_a8w8_flag(source, tmp_path):
    result = CliRunner().invoke(main, ["convert-qwen35", str(source), str(tmp_path / "out"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "quant_model_description.json").is_file()
    again = CliRunner().invoke(main, ["convert-qwen35", "--a8w8", str(source), str(tmp_path / "out2"), "--quiet"])
    assert again.exit_code == 0, again.output
