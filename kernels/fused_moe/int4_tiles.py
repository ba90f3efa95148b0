"""W4A8's packed experts as the Triton kernels read them: a tile of int8 bytes, each holding two int4 values of
adjacent weight rows (StackedExperts.int4: row 2j in byte j's low nibble, row 2j + 1 in its high one), loaded once and
split into the two rows' signed values - the one decoding the matvec kernels and the grouped GEMMs share."""

from __future__ import annotations

from npuport.kernels.launch import jit, tl


@jit
def load_nibbles(pairs_ptrs, mask):
    """(low, high) int32, the shape of pairs_ptrs: the sign-extended low and high nibbles of the bytes there (0 where
    masked) - the even and the odd weight rows of each byte's pair."""
    b = tl.load(pairs_ptrs, mask=mask, other=0).to(tl.int32)
    low = ((b & 0xF) ^ 8) - 8  # sign-extends the low nibble
    high = b >> 4  # b sign-extended from int8: the arithmetic shift leaves the high nibble, signed
    return low, high
