"""Checkpoint reading, recipes, W8A8 quantization math and the ascendV1 writer."""
