"""What the kernel tests share: Triton's CPU interpreter where there is no GPU (chosen before core.kernels
is imported), the skip marks, the device, dtypes, random inputs and the tolerance."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from core import kernels  # noqa: E402
from tolerance import tol as eps_tol  # noqa: E402


def numpy_breaks_interpreter() -> bool:
    """Triton 3.6's CPU interpreter turns size-1 arrays into scalars, which numpy >= 2.4 refuses."""
    import numpy
    return tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4)


# `device`: these run on CUDA where there is one (harness/lab/gpu_check.sh selects -m "gpu or device")
pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not kernels.available(), reason="triton is not installed"),
              pytest.mark.skipif(kernels.available() and kernels.interpreted() and numpy_breaks_interpreter(),
                                 reason="Triton's CPU interpreter needs numpy < 2.4")]
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Triton's interpreter runs tensor-core dots in fp32 only; compiled runs check bf16 too
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV.type == "cuda" else [])


def tol(dtype, magnitude: float = 4.0) -> dict:
    """Outputs up to `magnitude` (unit-normal inputs): fp32 sums in another order differ by a few ulps of it per
    accumulation (4 steps); a bf16 output by about one rounding of it."""
    return eps_tol(dtype, magnitude, 4 if dtype == torch.float32 else 1)


def rnd(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)
