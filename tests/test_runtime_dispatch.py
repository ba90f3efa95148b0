"""Context-scoped MoE dispatch (BF16 or int8 tokens) and the device choice: settings never leak between
threads or tasks, a forced int8 dispatch into BF16 experts is refused, nothing writes the environment, and
only devices.py names a device."""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path

import pytest
import torch

import npuport.kernels
import npuport.runtime
import npuport.runtime.model as runtime_model
from npuport import devices
from npuport.errors import NpuportError
from npuport.runtime.dispatch import (
    BF16_ENV,
    INT8_ENV,
    DispatchConfig,
    DispatchError,
    config_from_env,
    current_dispatch,
    dispatch,
)
from npuport.runtime.loader import load_model

pytestmark = pytest.mark.usefixtures("one_cpu_thread")



def runtime_sources() -> dict[str, str]:
    """The engine's modules (runtime/ and its self-test, without the validation and serving sub-packages), the
    kernels and the device module."""
    runtime_dir = Path(npuport.runtime.__file__).parent
    kernels_dir = Path(npuport.kernels.__file__).parent
    files = [*sorted(runtime_dir.glob("*.py")), *sorted((runtime_dir / "selftest").glob("*.py")),
             *sorted(kernels_dir.rglob("*.py")), Path(devices.__file__)]
    return {str(p.relative_to(p.parents[1])): p.read_text() for p in files}


def test_dispatch_is_restored_on_exit_and_on_exceptions():
    default = current_dispatch()
    with dispatch(bf16=True):
        assert current_dispatch() == DispatchConfig(bf16=True)
        with pytest.raises(RuntimeError), dispatch(bf16=False):
            assert current_dispatch() == DispatchConfig(bf16=False)
            raise RuntimeError("boom")
        assert current_dispatch() == DispatchConfig(bf16=True)
    assert current_dispatch() == default


def test_threads_never_see_each_others_setting():
    barrier, seen, errors = threading.Barrier(2), {True: set(), False: set()}, []

    def worker(bf16: bool) -> None:
        try:
            with dispatch(bf16=bf16):
                for _ in range(200):
                    barrier.wait()  # both threads are inside their blocks at the same time
                    seen[bf16].add(current_dispatch().bf16)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(b,)) for b in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and seen == {True: {True}, False: {False}}


def test_asyncio_tasks_never_see_each_others_setting():
    async def task(bf16: bool) -> set:
        seen = set()
        with dispatch(bf16=bf16):
            for _ in range(50):
                await asyncio.sleep(0)
                seen.add(current_dispatch().bf16)
        return seen

    async def main() -> list:
        return await asyncio.gather(task(True), task(False))

    assert asyncio.run(main()) == [{True}, {False}]


def test_defaults_come_from_the_engines_environment_variables():
    assert config_from_env({}) == DispatchConfig(bf16=None)
    assert config_from_env({BF16_ENV: "1"}) == DispatchConfig(bf16=True)
    assert config_from_env({INT8_ENV: "true"}) == DispatchConfig(bf16=False)
    assert config_from_env({INT8_ENV: "0"}) == DispatchConfig(bf16=None)


def test_the_runtime_never_writes_the_environment():
    writes = re.compile(r"environ\s*\[[^\]]*\]\s*=(?!=)|environ\.(update|setdefault|pop|clear)\(|putenv|unsetenv")
    assert {name: writes.findall(src) for name, src in runtime_sources().items() if writes.search(src)} == {}


@pytest.fixture(scope="module")
def moe_artifact_model(tiny_artifacts):
    """W8A8 experts in the target, BF16 experts in the MTP head."""
    return load_model(tiny_artifacts["moe-text-per-expert"], "cpu", torch.float32)


def test_target_and_mtp_threads_running_together_each_get_their_own_dispatch(moe_artifact_model, monkeypatch):
    """The target thread stops inside its int8 block, mid-forward, until the MTP thread's head has dispatched."""
    model = moe_artifact_model
    records, lock = [], threading.Lock()
    target_inside, mtp_dispatched = threading.Event(), threading.Event()
    real = runtime_model.int8_dispatch

    def recording(experts_quantized: bool, layer: str) -> bool:
        me = threading.current_thread().name
        if me == "mtp":
            assert target_inside.wait(timeout=30)
        result = real(experts_quantized, layer)
        with lock:
            records.append((me, layer, result))
        if me == "mtp":
            mtp_dispatched.set()
        else:
            target_inside.set()
            assert mtp_dispatched.wait(timeout=30)
        return result

    monkeypatch.setattr(runtime_model, "int8_dispatch", recording)
    tokens = torch.randint(3, 2000, (2, 6), generator=torch.Generator().manual_seed(0))
    errors = []

    def target() -> None:
        with dispatch(bf16=False):  # int8 tokens into the W8A8 experts
            for _ in range(10):
                model.prefill(tokens, model.new_state(2, 8), torch.full((2,), 6))

    def mtp() -> None:
        for _ in range(10):  # mtp_forward sets BF16 dispatch; seeing int8 would raise DispatchError
            model.mtp_forward(tokens, torch.randn(2, 6, model.config.hidden_size), model.new_mtp_state(2, 8))

    def run(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,), name=fn.__name__) for fn in (target, mtp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [name for name, _, _ in records[:2]] == ["target", "mtp"]
    by_thread = {(name, layer.startswith("mtp."), int8) for name, layer, int8 in records}
    assert by_thread == {("target", False, True), ("mtp", True, False)}


def test_forced_int8_dispatch_into_bf16_experts_is_refused(tiny_checkpoints):
    model = load_model(tiny_checkpoints["moe-multimodal-fused"], "cpu", torch.float32)
    tokens = torch.tensor([[5, 6, 7]])
    with pytest.raises(DispatchError, match=r"layers\.0\.mlp: int8 dispatch was forced, but the experts .* are BF16"):
        with dispatch(bf16=False):
            model.prefill(tokens, model.new_state(1, 4), torch.tensor([3]))
    model.prefill(tokens, model.new_state(1, 4), torch.tensor([3]))  # follows the experts by default


def test_device_choice_prefers_npu_then_cuda_then_cpu(monkeypatch):
    present = {"npu": False, "cuda": False, "cpu": True}
    monkeypatch.setattr(devices, "_available", lambda kind: present[kind])
    assert devices.device_kind() == "cpu"
    present["cuda"] = True
    assert devices.device_kind() == "cuda"
    present["npu"] = True
    assert devices.device_kind() == "npu"
    assert devices.device_kind("cpu") == "cpu"
    present["npu"] = False
    with pytest.raises(NpuportError, match="not available"):
        devices.device_kind("npu")
    with pytest.raises(NpuportError, match="unknown device"):
        devices.device_kind("tpu")
    assert devices.pick_device("cpu") == torch.device("cpu")


def test_only_devices_py_names_a_device():
    names = re.compile(r"""["'](npu|cuda|cpu)["']|torch\.(npu|cuda)\b|torch_npu|\.(cuda|npu)\(""")
    found = {name: names.findall(src) for name, src in runtime_sources().items() if name != "npuport/devices.py"}
    assert {name: hits for name, hits in found.items() if hits} == {}


def test_with_index_fills_in_the_current_device_and_leaves_named_ones(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert devices.with_index(torch.device("cuda")) == torch.device("cuda", 3)
    assert devices.with_index(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert devices.with_index(torch.device("cpu")) == torch.device("cpu")


def test_the_dispatch_option_reaches_every_moe_layer_of_a_generate_run(tiny_artifacts, tiny_checkpoints, monkeypatch):
    """`npuport generate --dispatch` decides the setting once for the run: each target MoE layer of a W8A8 artifact
    sees it (the MTP head's layers always BF16), the report names it, and int8 into BF16 experts is one error line."""
    from click.testing import CliRunner

    from npuport.cli import main

    seen = set()
    real = runtime_model.int8_dispatch

    def recording(experts_quantized: bool, layer: str) -> bool:
        result = real(experts_quantized, layer)
        seen.add((layer.startswith("mtp."), result))
        return result

    monkeypatch.setattr(runtime_model, "int8_dispatch", recording)
    artifact = str(tiny_artifacts["moe-text-per-expert"])
    for choice, int8 in (("bf16", False), ("int8", True), ("auto", True)):
        seen.clear()
        result = CliRunner().invoke(main, ["generate", artifact, "--prompt-ids", "5,6,7", "--max-new-tokens", "3",
                                           "--mtp", "1", "--dtype", "float32", "--dispatch", choice, "--json"])
        assert result.exit_code == 0, result.output
        assert seen == {(False, int8), (True, False)}, choice
        assert f'"dispatch": "{choice}"' in result.output
    refused = CliRunner().invoke(main, ["generate", str(tiny_checkpoints["moe-multimodal-fused"]), "--prompt-ids",
                                        "5,6,7", "--max-new-tokens", "2", "--dispatch", "int8"])
    assert refused.exit_code == 1
    assert refused.output.count("\n") == 1 and "int8 dispatch was forced" in refused.output
