"""The skinny matmul of a decode step: y = x W^T for 1..MAX_ROWS rows, with epilogues.

Contract: x [M, K] (or [M, 2K] gate | up with gated=True), w [N, K] row-major, M in 1..MAX_ROWS, fp32/bf16/fp16
(x and w one dtype; a residual [M, N] of w's dtype). At one row, narrow outputs use a broadcast-multiply loop
(no tensor cores), where the RMSNorm before the matmul folds into the loop; several rows use tensor-core dots
with the rows padded to 16, the norm and the activation as launches of their own (core.kernels.rows).
Epilogues: the residual add (rounded as `h + linear(x)` rounds) and each row's argmax (each program its columns'
best, one reduction launch after). Tiles come from `choose_linear` (a sweep on one H200,
results/perf/kernels_h200_16gb.json, fitted to the device's shared memory). With PDL, tensor-core programs ask their first weight tile into L2 before
they wait for the launch before (one tile: the setting results/perf/NOTES.md kept).
`wide_linear` takes MAX_ROWS + 1 to WIDE_ROWS rows (a batched verify or draft from B x W = 128) as launches of
`linear` over row tiles of MAX_ROWS, each tile exactly the launch of its rows alone; core.ops.TritonOps runs it
only under Launch.wide_rows (opt-in, not yet measured against the torch ops that take those rows otherwise).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from core.kernels.common import MAX_ROWS, Launch, after_previous, launch_opts, pow2_at_least, prec, \
    shared_memory_limit, triton, tl
from core.kernels.rows import argmax_reduce, rms_norm, silu_mul

PREFETCH_TILES = 1    # weight tiles a tensor-core program prefetches under PDL
WIDE_ROWS = 1024      # rows wide_linear takes (a batched verify of 64 requests x 16)
SHARED_SPARE = 8192   # bytes of shared memory fit_shared leaves free


@dataclass(frozen=True)
class LinearConfig:
    block_n: int
    block_k: int
    warps: int
    stages: int
    dot: bool = True  # tensor-core dot with the rows padded to 16; False: broadcast-multiply (one row only)


def _largest_pow2_dividing(k: int, cap: int) -> int:
    b = 16
    while b * 2 <= cap and k % (b * 2) == 0:
        b *= 2
    return b


def choose_linear(m: int, n: int, k: int, elem: int = 2, limit: int | None = None) -> LinearConfig:
    """The tiles for an [m, k] x [k, n] launch of `elem`-byte values: the measured ones (_measured_tiles), a
    tensor-core launch's fitted to `limit` bytes of shared memory (fit_shared; None: as measured)."""
    cfg = _measured_tiles(m, n, k)
    if not cfg.dot:
        return cfg
    block_k, stages = fit_shared(cfg, pow2_at_least(m, 16), cfg.block_k, elem, limit)
    return replace(cfg, block_k=block_k, stages=stages)


def _measured_tiles(m: int, n: int, k: int) -> LinearConfig:
    """Tiles by shape, from the sweep over a whole step's worth of weight copies (16 GB, so that address
    translation misses are the model's) on one H200, bf16: results/perf/kernels_h200_16gb.json. One row: long row
    reads with the broadcast-multiply kernel for the narrow matrices, tensor-core dots for the wide ones. Several
    rows: dots, wider tiles for wider outputs."""
    bk = _largest_pow2_dividing
    if m == 1:
        if k >= 8192:   # down_proj (12288 -> 4096): 3.76 TB/s
            return LinearConfig(block_n=4, block_k=bk(k, 1024), warps=4, stages=1, dot=False)
        if n <= 4096:   # o_proj: 3.09 TB/s
            return LinearConfig(block_n=16, block_k=bk(k, 1024), warps=4, stages=1, dot=False)
        if n <= 8192:   # q/k/v: 3.46 TB/s
            return LinearConfig(block_n=8, block_k=bk(k, 512), warps=4, stages=1, dot=False)
        return LinearConfig(block_n=64, block_k=bk(k, 128), warps=4, stages=3, dot=True)  # gate/up, lm_head: 4.2-4.4
    if n <= 4096:
        return LinearConfig(block_n=32, block_k=bk(k, 512), warps=4, stages=4, dot=True)
    if n <= 8192:
        return LinearConfig(block_n=64, block_k=bk(k, 256), warps=4, stages=4, dot=True)
    return LinearConfig(block_n=64, block_k=bk(k, 128), warps=4, stages=3, dot=True)


if triton is not None:
    @triton.jit
    def _prefetch_l2(ptrs):
        """Ask for the lines at `ptrs` to be brought into L2 (no registers, no wait): one address per line."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, y_ptr, r_ptr, pv_ptr, pi_ptr, g_ptr, M, N, K, sx, sw, sy, sr, eps,
                       PRO: tl.constexpr, NORM: tl.constexpr, RES: tl.constexpr, DOT: tl.constexpr,
                       EVEN_K: tl.constexpr,
                       PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       ARGMAX: tl.constexpr, PDL: tl.constexpr, PF_COLS: tl.constexpr, LINE: tl.constexpr):
        # PRO: 0 plain x; 2 silu(x[:, :K]) * x[:, K:] with HF's roundings. NORM (one row without tensor cores):
        # the RMSNorm of x (weight at g_ptr) folded in: the loop multiplies x by the norm weight and sums x's
        # squares on the way, and the reciprocal RMS scales the outputs at the end, so nothing waits for the
        # norm. Tensor-core loops keep the norm a launch of its own: any elementwise op between the load of x and
        # the dot cost more than the launch, as did a prologue that normalises first and an epilogue in the last
        # program of the matmul before (results/perf/NOTES.md). ARGMAX: each program also writes, per row, the
        # largest output of its columns and the lowest column holding it (pv/pi [M, programs];
        # _argmax_reduce_kernel).
        pid = tl.program_id(0)
        rm = tl.arange(0, BLOCK_M)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        dt = w_ptr.dtype.element_ty
        if PDL:
            if PF_COLS > 0:  # weights do not depend on the launch before: stream the first columns meanwhile
                lines = tl.minimum(tl.arange(0, PF_COLS // LINE) * LINE, K - 1)
                _prefetch_l2(w_ptr + tl.minimum(rn, N - 1)[:, None] * sw + lines[None, :])
        after_previous(PDL)
        if DOT:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if NORM:  # (one row, no tensor-core dot) x's squares per column, summed at the end
            tl.static_assert(not DOT, "the norm folds into one-row matmuls only")
            ss = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            if EVEN_K:
                xmask = m_ok[:, None]
                wmask = n_ok[:, None]
            else:
                xmask = m_ok[:, None] & (kk < K)[None, :]
                wmask = n_ok[:, None] & (kk < K)[None, :]
            w = tl.load(w_ptr + rn[:, None] * sw + kk[None, :], mask=wmask, other=0.0)
            xf = tl.load(x_ptr + rm[:, None] * sx + kk[None, :], mask=xmask, other=0.0).to(tl.float32)
            if PRO == 2:
                up = tl.load(x_ptr + rm[:, None] * sx + K + kk[None, :], mask=xmask, other=0.0).to(tl.float32)
                act = (xf / (1.0 + tl.exp(-xf))).to(dt)
                xf = (act.to(tl.float32) * up).to(dt).to(tl.float32)
            if NORM:
                ss += xf * xf
                xf = xf * tl.load(g_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
            if DOT:
                acc += tl.dot(xf.to(dt), tl.trans(w), input_precision=PREC)
            else:
                acc += w.to(tl.float32) * xf  # one row: [1, BK] against [BN, BK]
        if DOT:
            y = acc
        else:
            y = tl.sum(acc, axis=1)[None, :]
        if NORM:
            y = y * tl.rsqrt(tl.sum(ss, axis=1) / K + eps)[:, None]
        y = y.to(dt)
        out_mask = m_ok[:, None] & n_ok[None, :]
        if RES:
            r = tl.load(r_ptr + rm[:, None] * sr + rn[None, :], mask=out_mask, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(y_ptr + rm[:, None] * sy + rn[None, :], y, mask=out_mask)
        if ARGMAX:
            yf = y.to(tl.float32)
            yf = tl.where(out_mask, tl.where(yf != yf, float("inf"), yf), float("-inf"))  # NaN counts as +inf
            best = tl.max(yf, axis=1)
            col = tl.minimum(tl.min(tl.where(yf == best[:, None], rn[None, :], N), axis=1), N - 1)
            part = rm * tl.num_programs(0) + pid
            tl.store(pv_ptr + part, best, mask=m_ok)
            tl.store(pi_ptr + part, col, mask=m_ok)


def fit_shared(cfg: LinearConfig, block_m: int, block_k: int, elem: int, limit: int | None) -> tuple[int, int]:
    """(block_k, stages) for a tensor-core launch whose pipelined tiles fit `limit` bytes of shared memory: `buffers`
    tiles of x [block_m, block_k] and of w [block_n, block_k]. The tiles were chosen for bf16 at up to 16 rows;
    fp32, or more rows, halves block_k (not below 16), then the stages. SHARED_SPARE bytes stay free for what the
    count does not show (epilogue scratch)."""
    if limit is None:
        return block_k, cfg.stages
    bk, stages, room = block_k, cfg.stages, limit - SHARED_SPARE
    need = lambda: buffers(stages, block_m) * (block_m + cfg.block_n) * bk * elem  # noqa: E731
    while need() > room and bk > 16:
        bk //= 2
    while need() > room and stages > 2:
        stages -= 1
    return bk, stages


def buffers(stages: int, block_m: int) -> int:
    """The tiles Triton 3.6 keeps in shared memory for a pipelined dot, as an H200 showed them: stages - 1 up to 32
    rows (its out-of-resources error for an fp32 16-row down_proj at SmolLM2-135M's shapes: 3 x (16 + 32) x 512 x 4 =
    294912 > 232448; bf16 32-row launches at Qwen3-8B's o_proj, 3 x (32 + 32) x 512 x 2, ran in the B = 2 verify),
    all `stages` from 64 rows, where Hopper's warp-group dots take the tile (a bf16 64-row q/k/v launch of a B = 4
    verify at Qwen3-8B's shapes: 4 x (64 + 64) x 256 x 2 = 262144 > 232448, results/perf/NOTES.md)."""
    return stages if block_m >= 64 else max(stages - 1, 1)


def linear(x: torch.Tensor, w: torch.Tensor, *, norm: torch.Tensor | None = None, eps: float = 0.0,
           gated: bool = False, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
           config: LinearConfig | None = None, argmax: bool = False, launch: Launch = Launch()):
    """x [M, K] (or [M, 2K] with gated=True) and w [N, K] -> [M, N] in w's dtype.

    norm: RMSNorm weight [K] applied to x first (eps its epsilon). At one row without tensor cores it is folded
    into the matmul: x times the weight goes through the product and the output is scaled by x's reciprocal
    RMS, rounded once at the end (HF rounds the normed row before the product; the difference is of the order
    of that one rounding); otherwise it is a launch of its own with HF's roundings. gated: x holds gate|up,
    the input is silu(gate) * up (not with norm); residual [M, N]: added to the product (rounded first, as
    `h + linear(x)` would).
    argmax: also return each row's argmax [M] (int64, lowest column among equal maxima as torch.argmax; a NaN
    counts as +inf, so a row holding both a +inf before a NaN differs from torch.argmax, which picks the first
    NaN), found by the matmul's programs and one small reduction launch: (y, ids)."""
    m = x.shape[0]
    n, k = w.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"kernels.linear takes 1..{MAX_ROWS} rows, got {m}")
    if x.stride(1) != 1:
        x = x.contiguous()  # a few rows: the copy is one small launch
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()  # the epilogue reads whole rows
    if x.shape[1] != (2 * k if gated else k) or w.stride(1) != 1:
        raise ValueError(f"kernels.linear: x {tuple(x.shape)} does not fit w {tuple(w.shape)} (or w not row-major)")
    cfg = config or choose_linear(m, n, k, w.element_size(), shared_memory_limit(w.device))
    dot = cfg.dot or m > 1
    if norm is not None and gated:
        raise ValueError("kernels.linear: norm and gated do not combine")
    if norm is not None and dot:  # folded into one-row loops only (see the kernel)
        x, norm = rms_norm(x, norm, eps, launch), None
    if gated and dot and config is None:
        # the activation inside a tensor-core loop runs at a quarter of the weight rate (sweep): apply it once
        x, gated = silu_mul(x, launch), False
    y = out if out is not None else torch.empty((m, n), dtype=w.dtype, device=w.device)
    r = residual if residual is not None else y
    block_k = min(cfg.block_k, pow2_at_least(k, 16))  # an explicit config (the benches' sweep) runs as given
    grid = (triton.cdiv(n, cfg.block_n),)
    opts = launch_opts(launch, w.device, m)
    line = max(128 // w.element_size(), 1)  # elements per 128-byte line
    pf_cols = min(pow2_at_least(PREFETCH_TILES * block_k, line), pow2_at_least(k, line)) \
        if opts["PDL"] and dot and m > 1 else 0  # one row (Launch.one_row_pdl): it slowed the AR step (NOTES)
    if argmax:
        pv = torch.empty((m, grid[0]), dtype=torch.float32, device=w.device)
        pi = torch.empty((m, grid[0]), dtype=torch.int32, device=w.device)
    else:
        pv = pi = y
    _linear_kernel[grid](x, w, y, r, pv, pi, w if norm is None else norm, m, n, k, x.stride(0), w.stride(0),
                         y.stride(0), r.stride(0), float(eps), PRO=2 if gated else 0, NORM=norm is not None,
                         RES=residual is not None, DOT=dot, EVEN_K=k % block_k == 0,
                         PREC=prec(w.dtype), BLOCK_M=pow2_at_least(m, 16) if dot else 1, BLOCK_N=cfg.block_n,
                         BLOCK_K=block_k, ARGMAX=argmax, PF_COLS=pf_cols, LINE=line, num_warps=cfg.warps,
                         num_stages=cfg.stages, **opts)
    if not argmax:
        return y
    return y, argmax_reduce(pv, pi, launch)


def wide_linear(x: torch.Tensor, w: torch.Tensor, *, residual: torch.Tensor | None = None, argmax: bool = False,
                **kw):
    """`linear` over x [M, K] of 1..WIDE_ROWS rows: one launch of `linear` per row tile of MAX_ROWS, each writing
    its rows of one output (its keywords, residual and argmax as linear's), so every tile is bit for bit the launch
    of its rows alone. With a weight small enough for L2 the later tiles read it from there."""
    m, n = x.shape[0], w.shape[0]
    if not 1 <= m <= WIDE_ROWS:
        raise ValueError(f"kernels.wide_linear takes 1..{WIDE_ROWS} rows, got {m}")
    if m <= MAX_ROWS:
        return linear(x, w, residual=residual, argmax=argmax, **kw)
    y = torch.empty((m, n), dtype=w.dtype, device=w.device)
    ids = torch.empty(m, dtype=torch.long, device=w.device) if argmax else None
    for lo in range(0, m, MAX_ROWS):
        hi = min(lo + MAX_ROWS, m)
        got = linear(x[lo:hi], w, residual=None if residual is None else residual[lo:hi], out=y[lo:hi],
                     argmax=argmax, **kw)
        if argmax:
            ids[lo:hi] = got[1]
    return (y, ids) if argmax else y
