"""Triton kernels and the pure-PyTorch references beside them."""
