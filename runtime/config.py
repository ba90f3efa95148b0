"""The sizes of a Qwen3.5 text model, read from config.json (its `text_config` when there is one). They are
declared once, in npuport.convert.source, where convert, `npuport check` and the loader check the tensors against
them; the engine builds its model from the same ModelConfig."""

from __future__ import annotations

from npuport.convert.source import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig, load_config

__all__ = ["FULL_ATTENTION", "LINEAR_ATTENTION", "ModelConfig", "load_config"]
