"""How `npuport selftest` holds an operator's output to its reference: the tolerances of the kernels' tests, and
what CANN's own operators are held to where our kernels are bit-exact."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    """How an output is held to its reference: |got - want| <= atol + rtol |want| everywhere (as
    torch.testing.assert_close) with at least `min_equal` of the values bit-equal; `exact`: bit for bit, same dtype;
    `relative_l2`: ||got - want|| / ||want|| at most this."""

    rtol: float = 0.0
    atol: float = 0.0
    min_equal: float = 0.0
    relative_l2: float | None = None

    @property
    def exact(self) -> bool:
        return self.relative_l2 is None and self.rtol == self.atol == 0.0

    def describe(self) -> str:
        if self.exact:
            return "bit-exact"
        if self.relative_l2 is not None:
            return f"relative L2 <= {self.relative_l2:g}"
        equal = f", >= {self.min_equal:.0%} bit-equal" if self.min_equal else ""
        return f"rtol {self.rtol:g}, atol {self.atol:g}{equal}"

    def judge(self, got: torch.Tensor, want: torch.Tensor) -> tuple[float, bool]:
        """(the error this tolerance bounds - max |got - want|, or the relative L2 error - and whether it holds)."""
        if got.shape != want.shape or (self.exact and got.dtype != want.dtype):
            return float("inf"), False
        g, w = got.detach().cpu().double(), want.double()
        if not torch.isfinite(g).all() and torch.isfinite(w).all():
            return float("nan"), False
        if self.relative_l2 is not None:
            error = ((g - w).norm() / w.norm().clamp_min(1e-30)).item() if w.numel() else 0.0
            return error, error <= self.relative_l2
        diff = (g - w).abs()
        error = diff.max().item() if diff.numel() else 0.0
        if self.exact:
            return error, torch.equal(got.detach().cpu(), want)
        equal = (g == w).double().mean().item() if g.numel() else 1.0
        return error, bool((diff <= self.atol + self.rtol * w.abs()).all()) and equal >= self.min_equal


EXACT = Tolerance()
# RMSNorm rounds its fp32 row sum in another order: the same bf16 values but for rare rounding boundaries.
NORMED = Tolerance(rtol=8e-3, atol=8e-3, min_equal=0.98)
# bf16 outputs of kernels that compute in fp32, against the fp32 reference on the same values: one bf16 step.
ONE_BF16_STEP = Tolerance(rtol=1e-2, atol=1e-2)


def native_tolerance(tolerance: Tolerance, dtype: torch.dtype) -> Tolerance:
    """What CANN's own operator is held to where our kernel is bit-exact: it rounds its own way, so within one step
    of the output's dtype (int8: one unit), 99% of the values bit-equal. Other tolerances stand as they are."""
    if not tolerance.exact:
        return tolerance
    if not dtype.is_floating_point:
        return Tolerance(atol=1.0, min_equal=0.99)
    eps = torch.finfo(dtype).eps
    return Tolerance(rtol=eps, atol=eps, min_equal=0.99)
