"""CANN's own operators, as torch-npu 2.14.0 exposes them, for the kernel entry points on an Ascend NPU.

standins.py: a PyTorch implementation of what the documentation of each npu_* operator npuport calls says it
computes, with the documented signature - what standing_in_for_npu() puts in place of torch-npu on the CPU, so that
the NPU path's wiring is checked without an NPU. operators.py: which of the two the wrappers call. norms.py, rope.py,
w8a8.py, attention.py, moe.py, conv.py, gdn.py: the wrappers (`*_native`), each adapting npuport's layouts to its
operator's and back, and saying which documented constraint a call breaks (`*_refusal`), where the entry point
steps down to Triton or the reference. Imports only npuport.devices / npuport.errors and other kernels.
"""
