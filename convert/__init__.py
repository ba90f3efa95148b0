"""Checkpoint reading, recipes, W8A8 quantization math and the ascendV1 writer.
Imports only the shared helpers: never the runtime, the kernels or the release code."""
