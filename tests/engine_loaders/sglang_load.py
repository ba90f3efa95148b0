"""Subprocess entry: load an artifact with sglang's own loader code, as `--quantization modelslim` on an NPU does, and
print one verdict per tensor (JSON). Run with the sglang release's folder on PYTHONPATH:

    python sglang_load.py ARTIFACT [ARTIFACT ...] [--draft-quantization unquant]

Several artifacts are loaded one after the other in the one process (sglang imported once; the server arguments
published anew for each, as sglang allows when it rebuilds an engine in one process).

sglang's model loader builds the target model (the architecture config.json names) and, for NEXTN, the MTP draft
(`Qwen3_5ForCausalLMMTP`, quantized as `--speculative-draft-model-quantization` says: unset = the target's). Each is
built by `model_loader.loader._initialize_model` with the quantization config `_get_quantization_config` makes from
quant_model_description.json, and loaded by the model's `load_weights`. Two module flags are set to what they are on
an NPU (the harness runs on a CPU): `model_loader.loader._is_npu` (the NPU's packed-module names for ModelSlim) and
`is_npu` of qwen3_5_mtp (how the MTP draft picks its quantization); process_weights_after_loading (NPU kernels) is
not run."""

from __future__ import annotations

import argparse
import inspect
import json
import socket
import sys
import traceback
from pathlib import Path

import shims

shims.install(kernel_modules=("vllm._custom_ops",))

import torch  # noqa: E402
from recorder import LoadRecorder, artifact_tensors, refused  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_args(art: Path, draft_quantization: str | None):
    from sglang.srt.server_args import ServerArgs

    kwargs = dict(model_path=str(art), quantization="modelslim", device="cpu", tp_size=1, dtype="bfloat16",
                  disable_radix_cache=True, speculative_algorithm="NEXTN", speculative_num_steps=1,
                  speculative_eagle_topk=1, speculative_num_draft_tokens=2)
    if draft_quantization:
        kwargs["speculative_draft_model_quantization"] = draft_quantization
    return ServerArgs(**kwargs)


def _publish(server_args) -> None:
    """Make the server arguments the process's own, as the scheduler does (the API moved between releases)."""
    try:
        from sglang.srt.runtime_context import SpawnRanks, publish
    except ImportError:
        from sglang.srt.server_args import set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(server_args)
        return
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0))


def _init_distributed(server_args, model_config) -> None:
    """One rank, gloo: the groups the scheduler builds before it builds the model."""
    from sglang.srt.distributed import parallel_state

    parallel_state.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
    try:
        parallel_state.initialize_model_parallel()
    except TypeError:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    from sglang.srt.layers import dp_attention

    parameters = inspect.signature(dp_attention.initialize_dp_attention).parameters
    extra = {"model_config": model_config} if "model_config" in parameters else {}
    dp_attention.initialize_dp_attention(server_args=server_args, **extra)


def _build(model_config, load_config):
    from sglang.srt.model_loader import loader
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    loader._is_npu = True
    try:
        quant_config = loader._get_quantization_config(model_config, load_config)
    finally:
        loader._is_npu = False
    with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
        return loader._initialize_model(model_config, load_config, quant_config), quant_config


def _load(art: Path, model_config, load_config) -> dict:
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    try:
        model, quant_config = _build(model_config, load_config)
    except Exception as e:  # the engine refuses to build the model: every tensor is refused with its message
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=-6),
                "tensors": refused(art, f"{type(e).__name__}: {e}"), "unloaded_params": []}
    recorder = LoadRecorder(model, default_weight_loader)
    try:
        model.load_weights(recorder.feed(artifact_tensors(art)))
    except Exception as e:
        tensors = recorder.verdicts()
        tensors.update(refused(art, f"{type(e).__name__}: {e}", [recorder.current] if recorder.current else []))
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=-6),
                "tensors": tensors, "unloaded_params": []}
    return {"error": None, "architecture": type(model).__name__,
            "quant_config": type(quant_config).__name__ if quant_config is not None else None,
            "tensors": recorder.verdicts(), "unloaded_params": recorder.unloaded_params()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifacts", type=Path, nargs="+")
    parser.add_argument("--draft-quantization", default=None)
    args = parser.parse_args()

    import sglang
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models import qwen3_5_mtp

    qwen3_5_mtp.is_npu = lambda: True
    load_config = LoadConfig()
    result = {"engine": "sglang", "version": sglang.__version__, "runs": {}}
    for i, art in enumerate(a.resolve() for a in args.artifacts):
        server_args = _server_args(art, args.draft_quantization)
        _publish(server_args)
        target = ModelConfig.from_server_args(server_args)
        if i == 0:
            _init_distributed(server_args, target)
        models = {"target": _load(art, target, load_config)}
        draft = ModelConfig.from_server_args(server_args, model_path=str(art), is_draft_model=True)
        models["mtp-draft"] = _load(art, draft, load_config)
        result["runs"][str(art)] = models
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
