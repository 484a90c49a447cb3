"""Row-wise kernels: HF's RMSNorm, silu(gate) * up, and the reduction behind `linear`'s argmax epilogue.

Contract: x [M, K] row-major rows (any row stride), fp32/bf16/fp16; one program per row (silu_mul: per row and
1024 columns). Rounding as HF's modules: each elementwise op in fp32, rounded to the dtype where HF's op rounds.
"""
from __future__ import annotations

import torch

from core.kernels.common import Launch, after_previous, launch_opts, pow2_at_least, triton, tl

if triton is not None:
    @triton.jit
    def _argmax_reduce_kernel(pv_ptr, pi_ptr, out_ptr, P, PDL: tl.constexpr, BLOCK: tl.constexpr):
        # one program per row: the best of the per-program maxima, the lowest column among equal ones
        after_previous(PDL)
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        ok = c < P
        v = tl.load(pv_ptr + row * P + c, mask=ok, other=float("-inf"))
        i = tl.load(pi_ptr + row * P + c, mask=ok, other=0)
        best = tl.max(v, axis=0)
        tl.store(out_ptr + row, tl.min(tl.where(ok & (v == best), i, 2147483647), axis=0).to(tl.int64))

    @triton.jit
    def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, N, sx, sy, eps, PDL: tl.constexpr, BLOCK: tl.constexpr):
        after_previous(PDL)
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        ok = c < N
        dt = y_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * sx + c, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * sy + c, ((x * rstd).to(dt).to(tl.float32) * w).to(dt), mask=ok)

    @triton.jit
    def _silu_mul_kernel(x_ptr, y_ptr, K, sx, sy, PDL: tl.constexpr, BLOCK: tl.constexpr):
        after_previous(PDL)
        row = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < K
        dt = y_ptr.dtype.element_ty
        gf = tl.load(x_ptr + row * sx + c, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * sx + K + c, mask=ok, other=0.0).to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(dt)
        tl.store(y_ptr + row * sy + c, (act.to(tl.float32) * up).to(dt), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, launch: Launch = Launch()) -> torch.Tensor:
    """HF's RMSNorm of rows x [M, K] in one launch: normalised in fp32, rounded, times the weight, rounded."""
    m, k = x.shape
    y = torch.empty_like(x)
    _rmsnorm_kernel[(m,)](x, weight, y, k, x.stride(0), y.stride(0), eps, BLOCK=pow2_at_least(k, 16),
                          num_warps=8 if k >= 2048 else 4, **launch_opts(launch, x.device, m))
    return y


def silu_mul(x: torch.Tensor, launch: Launch = Launch()) -> torch.Tensor:
    """x [M, 2K] = gate | up -> silu(gate) * up [M, K], rounded as HF's two bf16 ops."""
    m, k = x.shape[0], x.shape[1] // 2
    y = torch.empty((m, k), dtype=x.dtype, device=x.device)
    _silu_mul_kernel[(m, triton.cdiv(k, 1024))](x, y, k, x.stride(0), y.stride(0), BLOCK=1024, num_warps=4,
                                                **launch_opts(launch, x.device, m))
    return y


def argmax_reduce(pv: torch.Tensor, pi: torch.Tensor, launch: Launch = Launch()) -> torch.Tensor:
    """Per row of the per-program maxima pv [M, P] (fp32) and their columns pi [M, P] (int32): the column of the
    largest, the lowest among equal ones -> [M] int64."""
    m, p = pv.shape
    ids = torch.empty(m, dtype=torch.long, device=pv.device)
    _argmax_reduce_kernel[(m,)](pv, pi, ids, p, BLOCK=pow2_at_least(p, 16), num_warps=4,
                                **launch_opts(launch, pv.device, m))
    return ids
