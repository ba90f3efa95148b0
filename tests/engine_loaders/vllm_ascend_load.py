"""Subprocess entry: load an artifact with vllm-ascend's and vLLM's own loader code, as `vllm serve ART --quantization
ascend --speculative-config '{"method":"qwen3_5_mtp",...}'` on an NPU does, and print one verdict per tensor (JSON).
Run with the vllm-ascend release's folder (vllm-ascend and the vLLM release it targets) on PYTHONPATH:

    python vllm_ascend_load.py ARTIFACT [ARTIFACT ...]

The platform is vllm-ascend's NPUPlatform (its plugin), with its global patches applied as `vllm serve` applies them
(`pre_register_and_update`, which also registers `--quantization ascend`) and its worker patches and custom ops as its
NPU worker does before it loads a model. The configs are vLLM's own (ModelConfig, SpeculativeConfig, VllmConfig), so
the quantization config is `AscendModelSlimConfig` made from quant_model_description.json by vLLM.

Models, each built by vLLM's `initialize_model` (every layer asks the quantization config for its method) and loaded
by the model's own `load_weights`:
- target: the architecture config.json names.
- mtp-draft: the draft as vllm-ascend's proposer builds it (`llm_base_proposer._get_model`): the target's VllmConfig
  (so the target's model type, and the very quantization config the target's `hf_to_vllm_mapper` was applied to)
  with the draft's model config (`Qwen3_5MTP` / `Qwen3_5MoeMTP`).
- mtp-own-type (reported, not part of the verdicts): the same draft under a VllmConfig whose model config is the
  draft's own (model type `qwen3_5_mtp`), with a quantization config made anew and the target's mapper applied, as
  a proposer that swapped the whole config would build it.

What is the harness's, not the engine's: shims.py's stand-ins (torch_npu, torch.npu); vLLM's model-class inspection
runs in this process, not in a subprocess of its own (the subprocess would import vllm-ascend without the stand-ins);
vllm-ascend's check that the GatedDeltaNet state page size aligns with the attention page size (the KV cache layout,
which the tiny test models' shapes do not meet and real Qwen3.5 sizes do) is caught and its message kept in the
record; process_weights_after_loading (NPU weight formats) is not run."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import socket
import tempfile
import traceback
from pathlib import Path

import shims

# vLLM logs to stdout: the record goes to the original stdout, everything else to stderr
RECORD = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
shims.install()
shims.install_npu_stand_ins()
os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))

import torch  # noqa: E402
from recorder import LoadRecorder, artifact_tensors, refused  # noqa: E402

SPECULATIVE = {"method": "qwen3_5_mtp", "num_speculative_tokens": 3}
NOTES: list[str] = []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prepare() -> None:
    """What `vllm serve` and vllm-ascend's worker do before any model is built (the parts that are not a device)."""
    from vllm.model_executor.models import config as model_configs
    from vllm.model_executor.models import registry
    from vllm.platforms import current_platform

    registry._run_in_subprocess = lambda fn: fn()
    current_platform.pre_register_and_update()  # global patches; registers the "ascend" quantization
    hybrid = model_configs.HybridAttentionMambaModelConfig
    align = hybrid.verify_and_update_config

    def verify_and_update_config(vllm_config) -> None:
        try:
            align(vllm_config)
        except AssertionError as e:  # the KV cache page layout of the tiny shapes; not loading
            NOTES.append(f"HybridAttentionMambaModelConfig.verify_and_update_config: {e}")

    hybrid.verify_and_update_config = verify_and_update_config


def _configs(art: Path):
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig

    model = ModelConfig(model=str(art), quantization="ascend", dtype="bfloat16", max_model_len=4096,
                        enforce_eager=True)
    parallel = ParallelConfig()
    speculative = SpeculativeConfig(**SPECULATIVE, target_model_config=model, target_parallel_config=parallel)
    return VllmConfig(model_config=model, parallel_config=parallel, speculative_config=speculative,
                      load_config=LoadConfig(), device_config=DeviceConfig(device="cpu"))


def _init_worker(vllm_config, moe_config) -> None:
    """One rank: vLLM's and vllm-ascend's process groups (the latter for its MoE communication: mc2, ...) over gloo,
    made before vllm-ascend's worker patches (which make HCCL groups, an NPU's); then those patches and its custom
    ops, as NPUWorker.__init__ applies them."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm_ascend.ascend_config import init_ascend_config
    from vllm_ascend.distributed.parallel_state import init_ascend_model_parallel
    from vllm_ascend.utils import adapt_patch, register_ascend_customop

    config = moe_config or vllm_config  # a MoE model's config: the expert-parallel groups too
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{_free_port()}", 0, "cpu:gloo,npu:gloo")
        ensure_model_parallel_initialized(1, 1)
        init_ascend_config(config)
        init_ascend_model_parallel(config.parallel_config)
    with set_current_vllm_config(vllm_config):
        adapt_patch()
        register_ascend_customop(vllm_config)


def _load(art: Path, vllm_config, model_config=None) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    try:
        with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
            model = initialize_model(vllm_config=vllm_config, model_config=model_config)
    except Exception as e:  # the engine refuses to build the model: every tensor is refused with its message
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=-8),
                "tensors": refused(art, f"{type(e).__name__}: {e}"), "unloaded_params": []}
    recorder = LoadRecorder(model, default_weight_loader)
    try:
        with set_current_vllm_config(vllm_config):
            model.load_weights(recorder.feed(artifact_tensors(art)))
    except Exception as e:
        tensors = recorder.verdicts()
        tensors.update(refused(art, f"{type(e).__name__}: {e}", [recorder.current] if recorder.current else []))
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=-8),
                "tensors": tensors, "unloaded_params": []}
    quant = vllm_config.quant_config
    return {"error": None, "architecture": type(model).__name__,
            "model_type": vllm_config.model_config.hf_config.model_type,
            "quant_config": type(quant).__name__ if quant is not None else None,
            "tensors": recorder.verdicts(), "unloaded_params": recorder.unloaded_params()}


def _own_type_config(art: Path, vllm_config):
    """The draft's own model config (model type qwen3_5_mtp) and a quantization config made anew from the
    description, the target's hf_to_vllm_mapper applied to it."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_architecture

    draft = vllm_config.speculative_config.draft_model_config
    if not isinstance(draft.hf_overrides, dict):  # as vllm-ascend's step3p5 proposer does for its own draft config
        draft.hf_overrides = {}
    quant = VllmConfig._get_quantization_config(draft, vllm_config.load_config)
    target_class, _ = get_model_architecture(vllm_config.model_config)
    mapper = getattr(target_class, "hf_to_vllm_mapper", None)
    compilation = copy.copy(vllm_config.compilation_config)
    compilation.static_forward_context = {}  # its layers are named as the draft's, built already
    own = dataclasses.replace(vllm_config, model_config=draft, quant_config=quant, compilation_config=compilation)
    if mapper is not None and quant is not None:
        with set_current_vllm_config(own):
            quant.apply_vllm_mapper(mapper)
    return own


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifacts", type=Path, nargs="+")
    args = parser.parse_args()

    _prepare()
    import vllm
    from vllm_ascend import _version

    result = {"engine": "vllm-ascend", "version": _version.__version__, "vllm": vllm.__version__,
              "runs": {}, "extra": {}}
    configs: dict[Path, object] = {}
    notes: dict[Path, list[str]] = {}
    for art in (a.resolve() for a in args.artifacts):
        try:
            configs[art] = _configs(art)
        except Exception as e:  # vLLM refuses the model or its speculative config
            failed = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=-8),
                      "tensors": refused(art, f"{type(e).__name__}: {e}"), "unloaded_params": []}
            result["runs"][str(art)] = {"target": failed}
            result["extra"][str(art)] = {}
        notes[art] = list(NOTES)
        NOTES.clear()
    if configs:
        moe = next((c for c in configs.values() if c.model_config.is_moe), None)
        _init_worker(next(iter(configs.values())), moe)
    for art, vllm_config in configs.items():
        NOTES.clear()
        models = {"target": _load(art, vllm_config)}
        draft = vllm_config.speculative_config.draft_model_config
        models["mtp-draft"] = _load(art, vllm_config, draft)
        result["runs"][str(art)] = models
        try:
            own = _load(art, _own_type_config(art, vllm_config), draft)
        except Exception as e:
            own = {"error": f"{type(e).__name__}: {e}", "tensors": {}, "unloaded_params": []}
        result["extra"][str(art)] = {"mtp-own-type": own, "notes": notes[art] + NOTES}
    json.dump(result, RECORD)
    RECORD.flush()


if __name__ == "__main__":
    main()
