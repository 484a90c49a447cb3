"""The kernel families' entry points as `core.kernels` exports them: the default kernels (matmul.py,
attention.py), or with Launch.batch_invariant those of invariant.py, which sit beside them. Nothing here
changes what the default path launches: each call hands its arguments on unchanged."""
from __future__ import annotations

import core.kernels.invariant as _invariant
from core.kernels.attention import attention as _attention, fits as _fits
from core.kernels.common import Launch
from core.kernels.matmul import LinearConfig, choose_linear as _choose_linear, linear as _linear


def linear(x, w, *, launch: Launch = Launch(), **kw):
    """matmul.linear (its contract and keywords); with launch.batch_invariant, invariant.linear."""
    return (_invariant.linear if launch.batch_invariant else _linear)(x, w, launch=launch, **kw)


def attention(*args, launch: Launch = Launch(), **kw):
    """attention.attention (its contract and arguments); with launch.batch_invariant, invariant.attention."""
    return (_invariant.attention if launch.batch_invariant else _attention)(*args, launch=launch, **kw)


def fits(tokens: int, groups: int, invariant: bool = False) -> bool:
    """Whether a decode forward of `tokens` rows with `groups` query heads per K/V head runs on the kernels
    (attention.fits; invariant: on the batch-invariant ones, invariant.fits)."""
    return _invariant.fits(tokens) if invariant else _fits(tokens, groups)


def choose_linear(m: int, n: int, k: int, elem: int = 2, limit: int | None = None,
                  invariant: bool = False) -> LinearConfig:
    """matmul.choose_linear; invariant: the batch-invariant launch's tiles (invariant.tiles, any m)."""
    return _invariant.tiles(n, k, elem, limit) if invariant else _choose_linear(m, n, k, elem, limit)
