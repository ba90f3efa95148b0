"""Triton kernels and the pure-PyTorch references beside them.
Imports only the shared helpers (npuport.devices, npuport.errors): never runtime, convert or validation."""
