"""Checkpoint reading, recipes, W8A8 quantization math, the ascendV1 writer, and what serving engines are known to
do with an artifact (engine_facts.py). Imports only the shared helpers: never the runtime, the kernels or the
release code."""
