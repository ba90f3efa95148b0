"""Triton kernels and the pure-PyTorch references beside them; implementations.py decides which implementation of an
operator runs on a device (torch-npu's own, Triton, the reference), npu/ wraps torch-npu's operators.
Imports only the shared helpers (npuport.devices, npuport.errors): never runtime, convert or validation."""
