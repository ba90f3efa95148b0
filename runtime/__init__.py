"""The Qwen3.5 runtime: model, caches and GDN state, MTP speculative decoding, devices, validation."""
