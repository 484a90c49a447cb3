"""Tolerances from the dtype's epsilon and the values' magnitude, never from one machine's BLAS.

Two computations of the same values that differ in summation order (another BLAS, another kernel, a fused op)
differ by a few units of the last place of the largest intermediate, per rounding step they go through. So the
allowance is `MARGIN x steps x eps x magnitude`, where magnitude is the largest absolute value of the reference
(the residual stream's size bounds what a summation can lose) and steps the rounding steps in series (layers).
A real bug moves values by a fraction of their size, orders of magnitude above that.
"""
from __future__ import annotations

import torch

MARGIN = 8  # ulps per step: summation-order differences measured here stay under 3


def tol(dtype: torch.dtype, magnitude: float = 1.0, steps: int = 1) -> dict:
    """atol/rtol for torch.testing.assert_close."""
    eps = torch.finfo(dtype).eps
    return {"atol": MARGIN * steps * eps * float(magnitude), "rtol": MARGIN * steps * eps}


def assert_close(got: torch.Tensor, want: torch.Tensor, steps: int = 1, magnitude: float | None = None) -> None:
    """assert_close with `tol` for want's dtype, magnitude by default want's largest finite absolute value."""
    if magnitude is None:
        finite = want[torch.isfinite(want)]
        magnitude = float(finite.abs().max()) if finite.numel() else 1.0
    torch.testing.assert_close(got, want, **tol(want.dtype, max(magnitude, 1.0), steps))
