"""The Qwen3.5 engine: config, weights loading, model, caches and GDN state, MTP speculative decoding; its
judge lives in runtime.validation. Imports kernels, convert (to read checkpoints) and the shared helpers."""
