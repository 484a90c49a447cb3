"""Triton kernels for the target's decode step at batch 1 (one AR token or one verify block of a few rows).

At batch 1 every weight is read once per step and used for a handful of rows, so the step is a stream of weight
bytes plus a few hundred small launches. A layer is six launches at one row (eight for a block of rows) instead
of about forty:
- `linear`: y = x W^T for up to 64 rows, with the residual add in its epilogue and, at one row, silu(gate) * up
  of a fused gate/up output in its prologue. An RMSNorm in front of a one-row matmul without tensor cores (the
  q/k/v projection) folds into its loop; elsewhere it is its own small launch (measured faster than folding it
  into a tensor-core loop, than a prologue that every output tile repeats, and than splitting it between the
  epilogue of the matmul before and the one after; results/perf/NOTES.md). Optionally each row's argmax from
  the epilogue (the drafter's lm_head, the refiners' greedy scoring).
- `attention`: per-head RMSNorm of q and k (Qwen3), rotary embedding and the K/V write into the static cache,
  then causal attention of the block's rows over the cache up to the block's last position (read from the
  device, so one captured graph serves every KV length), grouped-query heads folded into the rows, split over
  the slots when the cache is long. `write_kv` is its cache write alone (the drafter's context).
On Hopper, launches of several rows use programmatic dependent launch (`set_launch`).
Rounding follows HF's modules step by step (each elementwise op computed in fp32 and rounded to the model's dtype
where HF's bf16 op would round); only the matmul and softmax summation orders differ from the torch path, and a
folded norm, which skips one rounding of the normed row (`linear`).
With TRITON_INTERPRET=1 the same kernels run on CPU tensors (the tests use that for correctness).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path is used instead (harness.decode.target checks `available()`)
    triton = None
    tl = None
try:  # grid dependency control (programmatic dependent launch): Triton releases from 2025 on
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAS_GDC = True
except ImportError:  # the kernels still run, without PDL (the names are only read under PDL=True)
    gdc_launch_dependents = gdc_wait = None
    _HAS_GDC = False

MAX_ROWS = 64         # rows one `linear` call takes (verify blocks up to 64 tokens)
MAX_ATTN_ROWS = 128   # query rows (tokens x query heads per K/V head) one attention program keeps in registers
MAX_SPLITS = 16       # programs per K/V head that share one attention's slots


def fits(tokens: int, groups: int) -> bool:
    """Whether a decode forward of `tokens` rows with `groups` query heads per K/V head runs on these kernels."""
    return tokens <= MAX_ROWS and tokens * groups <= MAX_ATTN_ROWS


def available() -> bool:
    return triton is not None


@dataclass(frozen=True)
class LinearConfig:
    block_n: int
    block_k: int
    warps: int
    stages: int
    dot: bool = True  # tensor-core dot with the rows padded to 16; False: broadcast-multiply (one row only)


def _pow2_at_least(n: int, lo: int) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


def _largest_pow2_dividing(k: int, cap: int) -> int:
    b = 16
    while b * 2 <= cap and k % (b * 2) == 0:
        b *= 2
    return b


def choose_linear(m: int, n: int, k: int) -> LinearConfig:
    """Tiles by shape, from the sweep over a whole step's worth of weight copies (16 GB, so that address
    translation misses are the model's) on one H200: results/perf/kernels_h200_16gb.json. One row: long row reads
    with the broadcast-multiply kernel for the narrow matrices, tensor-core dots for the wide ones. Several rows:
    dots, wider tiles for wider outputs."""
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
    def _after_previous(PDL: tl.constexpr):
        """With programmatic dependent launch this launch may start while the one before it drains: wait for it
        (its writes are this launch's inputs), then let the next launch start early in turn."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

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
        _after_previous(PDL)
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

    @triton.jit
    def _argmax_reduce_kernel(pv_ptr, pi_ptr, out_ptr, P, PDL: tl.constexpr, BLOCK: tl.constexpr):
        # one program per row: the best of the per-program maxima, the lowest column among equal ones
        _after_previous(PDL)
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        ok = c < P
        v = tl.load(pv_ptr + row * P + c, mask=ok, other=float("-inf"))
        i = tl.load(pi_ptr + row * P + c, mask=ok, other=0)
        best = tl.max(v, axis=0)
        tl.store(out_ptr + row, tl.min(tl.where(ok & (v == best), i, 2147483647), axis=0).to(tl.int64))

    @triton.jit
    def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, N, sx, sy, eps, PDL: tl.constexpr, BLOCK: tl.constexpr):
        _after_previous(PDL)
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
        _after_previous(PDL)
        row = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < K
        dt = y_ptr.dtype.element_ty
        gf = tl.load(x_ptr + row * sx + c, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * sx + K + c, mask=ok, other=0.0).to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(dt)
        tl.store(y_ptr + row * sy + c, (act.to(tl.float32) * up).to(dt), mask=ok)

    @triton.jit
    def _norm_rope(ptrs, ok, w_ptr, cos, sin, d, eps, NORM: tl.constexpr, D: tl.constexpr):
        """Rows of heads at `ptrs` [R, D] -> rms_norm(x) * w (HF's roundings, if NORM), then x*cos +
        rotate_half(x)*sin with each product rounded as torch's bf16 ops round. fp32 result, dt-exact."""
        dt = w_ptr.dtype.element_ty
        half: tl.constexpr = D // 2
        shift = (d + half) % D
        x = tl.load(ptrs + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        xr = tl.load(ptrs + shift[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        if NORM:
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
            x = ((x * rstd).to(dt).to(tl.float32) * tl.load(w_ptr + d).to(tl.float32)[None, :]).to(dt).to(tl.float32)
            xr = ((xr * rstd).to(dt).to(tl.float32) * tl.load(w_ptr + shift).to(tl.float32)[None, :]).to(dt)
            xr = xr.to(tl.float32)
        rot = tl.where(d[None, :] < half, -xr, xr)
        return ((x * cos).to(dt).to(tl.float32) + (rot * sin).to(dt).to(tl.float32)).to(dt)

    @triton.jit
    def _store_kv(rows_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, T, s_rows, s_cs, s_kh, s_ks, HQ, h,
                  n_kv, eps, NORM: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr):
        """K/V head h of T projected rows (k heads from column block HQ, v heads after the n_kv k heads): k
        normed (if NORM) and rotated, both written into the caches at the rows' positions."""
        d = tl.arange(0, D)
        tt = tl.arange(0, BLOCK_T)
        t_ok = tt < T
        tpos = tl.load(pos_ptr + tt, mask=t_ok, other=0)
        cs = tt[:, None] * s_cs + d[None, :]
        cos = tl.load(cos_ptr + cs, mask=t_ok[:, None], other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + cs, mask=t_ok[:, None], other=0.0).to(tl.float32)
        k = _norm_rope(rows_ptr + tt[:, None] * s_rows + (HQ + h) * D, t_ok, kn_ptr, cos, sin, d, eps, NORM, D)
        dst = h * s_kh + tpos[:, None] * s_ks + d[None, :]
        tl.store(kc_ptr + dst, k, mask=t_ok[:, None])
        v = tl.load(rows_ptr + tt[:, None] * s_rows + (HQ + n_kv + h) * D + d[None, :], mask=t_ok[:, None])
        tl.store(vc_ptr + dst, v, mask=t_ok[:, None])

    @triton.jit
    def _kv_write_kernel(kv_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, T, s_kv, s_cs, s_kh, s_ks,
                         eps, NORM: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
        # one program per K/V head: the drafter's context write (no attention)
        _after_previous(PDL)
        _store_kv(kv_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, T, s_kv, s_cs, s_kh, s_ks, 0,
                  tl.program_id(0), tl.num_programs(0), eps, NORM, D, BLOCK_T)

    @triton.jit
    def _attention_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, o_ptr, pm_ptr, pl_ptr,
                          pa_ptr, cnt_ptr, T, s_qkv, s_cs, s_kh, s_ks, s_ot, HQ, scale, eps, NORM: tl.constexpr,
                          GROUPS: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr, CAUSAL: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, SPLITS: tl.constexpr,
                          MIN_BLOCKS: tl.constexpr, PDL: tl.constexpr):
        # programs (K/V head, split): each split with slots to read writes its head's T new keys/values (norm,
        # rope) into the cache (the splits write the same values), then its GROUPS*T query rows (norm, rope)
        # attend over its share of the slots [0, last position]: causally, or all of them (the drafter's
        # block). With several splits each leaves its running max, sum and output in pm/pl/pa, and the head's
        # last split to arrive (a counter at cnt_ptr + head, left at 0) merges them in split order.
        _after_previous(PDL)
        h = tl.program_id(0)
        sp = tl.program_id(1)
        d = tl.arange(0, D)
        dt = kc_ptr.dtype.element_ty
        kv_len = (tl.load(pos_ptr + T - 1) + 1).to(tl.int32)
        # slots per split: whole blocks, at least MIN_BLOCKS of them (a merge costs about as much as a few
        # blocks), so short caches use fewer splits and one split writes its result directly
        per = tl.maximum(tl.cdiv(tl.cdiv(kv_len, SPLITS), BLOCK_S), MIN_BLOCKS) * BLOCK_S
        active = tl.cdiv(kv_len, per)
        if sp >= active:
            return
        _store_kv(qkv_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, T, s_qkv, s_cs, s_kh, s_ks, HQ, h,
                  tl.num_programs(0), eps, NORM, D, BLOCK_T)

        r = tl.arange(0, BLOCK_R)
        g = r // T
        t = r % T
        r_ok = r < GROUPS * T
        head = h * GROUPS + g
        qpos = tl.load(pos_ptr + t, mask=r_ok, other=0)
        cs = t[:, None] * s_cs + d[None, :]
        cos = tl.load(cos_ptr + cs, mask=r_ok[:, None], other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + cs, mask=r_ok[:, None], other=0.0).to(tl.float32)
        q = _norm_rope(qkv_ptr + t[:, None] * s_qkv + head[:, None] * D, r_ok, qn_ptr, cos, sin, d, eps, NORM, D)
        tl.debug_barrier()  # this program's cache writes above are read below

        lo = sp * per
        hi = tl.minimum(lo + per, kv_len)
        m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, D], dtype=tl.float32)
        s = tl.arange(0, BLOCK_S)
        kbase = kc_ptr + h * s_kh
        vbase = vc_ptr + h * s_kh
        for s0 in range(lo, hi, BLOCK_S):
            sj = s0 + s
            s_ok = sj < hi
            kb = tl.load(kbase + sj[:, None] * s_ks + d[None, :], mask=s_ok[:, None], other=0.0)
            vb = tl.load(vbase + sj[:, None] * s_ks + d[None, :], mask=s_ok[:, None], other=0.0)
            sc = tl.dot(q, tl.trans(kb), input_precision=PREC) * scale
            if CAUSAL:
                sc = tl.where((sj[None, :] <= qpos[:, None]) & s_ok[None, :], sc, float("-inf"))
            else:
                sc = tl.where(s_ok[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible slot yet stays empty
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(sc - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(dt), vb, input_precision=PREC)
            m_i = m_new
        dst = o_ptr + t[:, None] * s_ot + head[:, None] * D + d[None, :]
        if SPLITS == 1:  # (a constexpr branch: no counter is passed then)
            tl.store(dst, (acc / l_i[:, None]).to(dt), mask=r_ok[:, None])
        elif active == 1:
            tl.store(dst, (acc / l_i[:, None]).to(dt), mask=r_ok[:, None])
        else:
            part = (h * SPLITS + sp) * BLOCK_R + r
            tl.store(pm_ptr + part, m_i)
            tl.store(pl_ptr + part, l_i)
            tl.store(pa_ptr + part[:, None] * D + d[None, :], acc)
            tl.debug_barrier()  # all of this split's stores come before its arrival
            if tl.atomic_add(cnt_ptr + h, 1, sem="acq_rel") == active - 1:
                first = h * SPLITS * BLOCK_R + r
                mx = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
                for j in range(active):
                    mx = tl.maximum(mx, tl.load(pm_ptr + first + j * BLOCK_R, cache_modifier=".cg"))
                den = tl.zeros([BLOCK_R], dtype=tl.float32)
                num = tl.zeros([BLOCK_R, D], dtype=tl.float32)
                for j in range(active):  # key 0 is visible to every row, so mx is finite
                    at = first + j * BLOCK_R
                    wj = tl.exp(tl.load(pm_ptr + at, cache_modifier=".cg") - mx)
                    den += tl.load(pl_ptr + at, cache_modifier=".cg") * wj
                    num += tl.load(pa_ptr + at[:, None] * D + d[None, :], cache_modifier=".cg") * wj[:, None]
                tl.store(dst, (num / den[:, None]).to(dt), mask=r_ok[:, None])
                tl.atomic_xchg(cnt_ptr + h, 0)


_LAUNCH = {"pdl": None, "prefetch_tiles": 1, "attention_splits": None, "attention_min_blocks": 4,
           "attention_block": 128, "fold_norms": True}  # None: automatic (see set_launch)
_PDL_DEVICES: dict = {}


def set_launch(pdl: bool | None = None, prefetch_tiles: int = 1, attention_splits: int | None = None,
               attention_min_blocks: int = 4, attention_block: int = 128, fold_norms: bool = True) -> None:
    """How the kernels are launched. pdl: programmatic dependent launch (a launch starts while the one before it
    drains and waits on the device for its writes; Hopper and later), None = wherever the GPU supports it.
    prefetch_tiles: with pdl, how many of its first weight tiles each tensor-core matmul program (several rows)
    asks into L2 before it waits. attention_splits: programs per K/V head in `attention` (None: by the cache's
    capacity); attention_block: slots an attention program reads at a time when it has at most 32 query rows
    (more rows: 32; 128 measured 0.01-0.03 ms faster per AR step than 64 on the H200); attention_min_blocks: the
    fewest slots a split reads, in blocks of 64 (of 32 for more rows). fold_norms: the RMSNorm in front of a
    one-row matmul without tensor cores folded into it (False: its own launch first, as HF rounds it). Clears
    nothing: graphs captured before keep the launches they captured."""
    if prefetch_tiles < 0:
        raise ValueError(f"prefetch_tiles must be >= 0, got {prefetch_tiles}")
    if attention_splits is not None and not 1 <= attention_splits <= MAX_SPLITS:
        raise ValueError(f"attention_splits must be in 1..{MAX_SPLITS}, got {attention_splits}")
    if attention_min_blocks < 1:
        raise ValueError(f"attention_min_blocks must be >= 1, got {attention_min_blocks}")
    if attention_block not in (16, 32, 64, 128):
        raise ValueError(f"attention_block must be one of 16, 32, 64, 128, got {attention_block}")
    _LAUNCH.update(pdl=pdl, prefetch_tiles=prefetch_tiles, attention_splits=attention_splits,
                   attention_min_blocks=attention_min_blocks, attention_block=attention_block,
                   fold_norms=bool(fold_norms))


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: compiled kernels on a Hopper or later GPU."""
    device = torch.device(device)
    if device.type != "cuda" or interpreted() or triton is None or not _HAS_GDC:
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _PDL_DEVICES:
        _PDL_DEVICES[idx] = torch.cuda.get_device_capability(idx) >= (9, 0)
    return _PDL_DEVICES[idx]


def _launch_opts(device: torch.device, rows: int) -> dict:
    """The PDL constexpr and, when on, the launch attribute that lets the kernel start early. Only launches of
    several rows (verify blocks, the drafter's block): measured on the H200, PDL made the drafter-only step
    0.2 ms faster and left the one-row AR step as it was, or slower where matmuls follow each other."""
    on = rows > 1 and _LAUNCH["pdl"] is not False and pdl_supported(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


_COUNTERS: dict = {}


def _counter(device: torch.device) -> torch.Tensor:
    """Arrival counters on this device (int32, 0 between launches: the last program to arrive resets its own),
    [h] for K/V head h of a split attention. Launches on one stream never overlap their counting (with PDL they
    count after waiting). Made by `prepare` before any graph capture."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one device, one set of counters
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    if key not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("kernels: call kernels.prepare(device) before capturing graphs with split attention")
        _COUNTERS[key] = torch.zeros(1024, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def prepare(device: torch.device) -> None:
    """Allocate what the kernels keep per device (outside any graph capture)."""
    _counter(device)


def _prec(dtype: torch.dtype) -> str | None:
    """fp32 products in full precision (tensor cores would round the inputs to tf32); other dtypes: the default."""
    return "ieee" if dtype == torch.float32 else None


def linear(x: torch.Tensor, w: torch.Tensor, *, norm: torch.Tensor | None = None, eps: float = 0.0,
           gated: bool = False, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
           config: LinearConfig | None = None, argmax: bool = False):
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
    cfg = config or choose_linear(m, n, k)
    dot = cfg.dot or m > 1
    if norm is not None and gated:
        raise ValueError("kernels.linear: norm and gated do not combine")
    if norm is not None and (dot or not _LAUNCH["fold_norms"]):  # folded into one-row loops only (see kernel)
        x, norm = rms_norm(x, norm, eps), None
    if gated and dot and config is None:
        # the activation inside a tensor-core loop runs at a quarter of the weight rate (sweep): apply it once
        x, gated = silu_mul(x), False
    y = out if out is not None else torch.empty((m, n), dtype=w.dtype, device=w.device)
    r = residual if residual is not None else y
    block_k = min(cfg.block_k, _pow2_at_least(k, 16))
    grid = (triton.cdiv(n, cfg.block_n),)
    opts = _launch_opts(w.device, m)
    line = max(128 // w.element_size(), 1)  # elements per 128-byte line
    # measured on the H200: the prefetch helps the tensor-core (several-row) launches and slows one-row ones
    pf_cols = min(_pow2_at_least(_LAUNCH["prefetch_tiles"] * block_k, line), _pow2_at_least(k, line)) \
        if opts["PDL"] and _LAUNCH["prefetch_tiles"] and dot else 0
    if argmax:
        pv = torch.empty((m, grid[0]), dtype=torch.float32, device=w.device)
        pi = torch.empty((m, grid[0]), dtype=torch.int32, device=w.device)
    else:
        pv = pi = y
    _linear_kernel[grid](x, w, y, r, pv, pi, w if norm is None else norm, m, n, k, x.stride(0), w.stride(0),
                         y.stride(0), r.stride(0), float(eps), PRO=2 if gated else 0, NORM=norm is not None,
                         RES=residual is not None, DOT=dot, EVEN_K=k % block_k == 0,
                         PREC=_prec(w.dtype), BLOCK_M=_pow2_at_least(m, 16) if dot else 1, BLOCK_N=cfg.block_n,
                         BLOCK_K=block_k, ARGMAX=argmax, PF_COLS=pf_cols, LINE=line, num_warps=cfg.warps,
                         num_stages=cfg.stages, **opts)
    if not argmax:
        return y
    ids = torch.empty(m, dtype=torch.long, device=w.device)
    _argmax_reduce_kernel[(m,)](pv, pi, ids, grid[0], BLOCK=_pow2_at_least(grid[0], 16), num_warps=4, **opts)
    return y, ids


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm of rows x [M, K] in one launch: normalised in fp32, rounded, times the weight, rounded."""
    m, k = x.shape
    y = torch.empty_like(x)
    _rmsnorm_kernel[(m,)](x, weight, y, k, x.stride(0), y.stride(0), eps, BLOCK=_pow2_at_least(k, 16),
                          num_warps=8 if k >= 2048 else 4, **_launch_opts(x.device, m))
    return y


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2K] = gate | up -> silu(gate) * up [M, K], rounded as HF's two bf16 ops."""
    m, k = x.shape[0], x.shape[1] // 2
    y = torch.empty((m, k), dtype=x.dtype, device=x.device)
    _silu_mul_kernel[(m, triton.cdiv(k, 1024))](x, y, k, x.stride(0), y.stride(0), BLOCK=1024, num_warps=4,
                                                **_launch_opts(x.device, m))
    return y


def attention(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
              cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, n_q: int, scale: float, causal: bool = True,
              splits: int | None = None, min_blocks: int | None = None) -> torch.Tensor:
    """One layer's attention for T new tokens at increasing `positions` [T], from the fused projection output
    qkv [T, (n_q + 2 n_kv) d]: per-head RMSNorm of q and k (q_norm/k_norm weights [d], None for Llama), rotary
    (cos/sin [T, d]), k and v written into the caches [n_kv, capacity, d] (one layer's slice) at `positions`,
    then attention over the slots [0, positions[-1]], causal or (causal=False: a drafter's block) not, split
    over the slots into up to `splits` programs per K/V head (None: by the cache's capacity), each with at
    least `min_blocks` blocks of 64 slots (of 32 for more than 32 query rows; read on the device: short caches
    use one), whose partial results the last of them merges (None: `set_launch`'s). Returns [T, n_q * d]."""
    t = qkv.shape[0]
    n_kv, d = k_cache.shape[0], k_cache.shape[-1]
    groups = n_q // n_kv
    o = torch.empty((t, n_q * d), dtype=qkv.dtype, device=qkv.device)
    rows = _pow2_at_least(groups * t, 16)
    norm = q_norm is not None
    block_s = _LAUNCH["attention_block"] if rows <= 32 else 32
    splits = splits or _LAUNCH["attention_splits"]
    min_blocks = min_blocks or _LAUNCH["attention_min_blocks"]
    if block_s > 64:  # the minimum counts 64-slot blocks
        min_blocks = max(1, min_blocks * 64 // block_s)
    if splits is None:  # one block of slots per split up to MAX_SPLITS, by the cache's capacity (a host bound)
        splits = max(1, min(MAX_SPLITS, -(-k_cache.shape[1] // block_s)))
    if splits > 1:
        pm = torch.empty((n_kv, splits, rows), dtype=torch.float32, device=qkv.device)
        pl = torch.empty_like(pm)
        pa = torch.empty((n_kv, splits, rows, d), dtype=torch.float32, device=qkv.device)
        cnt = _counter(qkv.device)
        if n_kv > cnt.numel():
            raise ValueError(f"kernels.attention: {n_kv} K/V heads, at most {cnt.numel()}")
    else:
        pm = pl = pa = cnt = o
    _attention_kernel[(n_kv, splits)](
        qkv, q_norm if norm else k_cache, k_norm if norm else k_cache, cos, sin, positions, k_cache, v_cache, o,
        pm, pl, pa, cnt, t, qkv.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1), o.stride(0), n_q,
        scale, eps, NORM=norm, GROUPS=groups, D=d, PREC=_prec(qkv.dtype), CAUSAL=causal,
        BLOCK_T=_pow2_at_least(t, 1), BLOCK_R=rows, BLOCK_S=block_s, SPLITS=splits, MIN_BLOCKS=min_blocks,
        num_warps=8 if block_s >= 128 else 4,
        **_launch_opts(qkv.device, t))
    return o


def write_kv(kv: torch.Tensor, k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
             positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Projected rows kv [T, 2 n_kv d] (k heads, then v heads) into one layer's caches [n_kv, capacity, d] at
    `positions`: k through its per-head RMSNorm (k_norm weight [d], None: none) and the rotary (cos/sin [T, d]),
    v as it is. One launch; the rounding of `attention`'s own cache write."""
    t = kv.shape[0]
    if kv.stride(1) != 1:
        kv = kv.contiguous()
    n_kv, d = k_cache.shape[0], k_cache.shape[-1]
    if kv.shape[1] != 2 * n_kv * d:
        raise ValueError(f"kernels.write_kv: rows of {kv.shape[1]} values, expected {2 * n_kv * d}")
    norm = k_norm is not None
    _kv_write_kernel[(n_kv,)](kv, k_norm if norm else k_cache, cos, sin, positions, k_cache, v_cache, t,
                              kv.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1), eps, NORM=norm, D=d,
                              BLOCK_T=_pow2_at_least(t, 1), num_warps=4, **_launch_opts(kv.device, t))


def _eps(norm) -> float:
    """An RMSNorm module's epsilon: HF's modules call it variance_epsilon, the dFlash drafter's eps."""
    eps = getattr(norm, "variance_epsilon", None)
    return norm.eps if eps is None else eps


def decoder_layer(h: torch.Tensor, layer, qkv_w: torch.Tensor, gate_up_w: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, n_q: int,
                  scale: float, causal: bool = True) -> torch.Tensor:
    """One pre-norm decoder layer (HF Llama/Qwen module names: input_layernorm, self_attn.{q_norm, k_norm,
    o_proj}, post_attention_layernorm, mlp.down_proj) over rows h [T, H], with the fused q/k/v and gate/up
    weights; writes the layer's K/V at `positions`."""
    attn, ln1, ln2 = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    qkv = linear(h, qkv_w, norm=ln1.weight, eps=_eps(ln1))
    o = attention(qkv, None if qn is None else qn.weight, None if kn is None else kn.weight,
                  0.0 if qn is None else _eps(qn), cos, sin, positions, k_cache, v_cache, n_q, scale, causal)
    h = linear(o, attn.o_proj.weight, residual=h)
    gate_up = linear(h, gate_up_w, norm=ln2.weight, eps=_eps(ln2))
    return linear(gate_up, layer.mlp.down_proj.weight, gated=True, residual=h)


def decoder_stack(h: torch.Tensor, layers, weights, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor, n_q: int, scale: float, causal: bool = True,
                  taps=()) -> tuple[torch.Tensor, dict]:
    """Every decoder layer over rows h [T, H]; `weights(i)` gives layer i's (q/k/v weight, gate/up weight,
    K cache, V cache). Returns the last layer's residual rows (before the final norm: callers apply it with
    `final_norm`, or with `normed_linear` in their lm_head) and {i: residual rows after layer i} for i in `taps`.
    The target's decode step and the drafter's block share it."""
    tapped = {}
    for i, layer in enumerate(layers):
        h = decoder_layer(h, layer, *weights(i), cos, sin, positions, n_q, scale, causal)
        if i in taps:
            tapped[i] = h
    return h, tapped


def final_norm(h: torch.Tensor, norm) -> torch.Tensor:
    """An RMSNorm module applied to rows h [T, H] in one launch."""
    return rms_norm(h, norm.weight, _eps(norm))


def normed_linear(h: torch.Tensor, norm, w: torch.Tensor, argmax: bool = False):
    """linear(norm(h), w) for the RMSNorm module `norm`: folded into the matmul where `linear` can (one row, no
    tensor cores), else a norm launch first."""
    return linear(h, w, norm=norm.weight, eps=_eps(norm), argmax=argmax)


def fuse_rows(modules) -> torch.Tensor:
    """One weight for several projections of the same input (q/k/v, gate/up): concatenated once, and each module's
    weight becomes a view into it, so no memory is added and the modules still work on their own."""
    w = torch.cat([m.weight for m in modules])
    start = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight = torch.nn.Parameter(w[start:start + n], requires_grad=False)
        start += n
    return w


def _heads_fit(head_dim: int, n_q: int, n_kv: int) -> bool:
    """Attention shapes these kernels take: a power-of-two head_dim >= 16 and whole query groups."""
    return head_dim >= 16 and not head_dim & (head_dim - 1) and n_q % n_kv == 0


def drafter_fits(config) -> bool:
    """A dFlash drafter config whose heads these kernels take."""
    return triton is not None and _heads_fit(config.head_dim, config.num_attention_heads, config.num_key_value_heads)


def unsupported_reason(target) -> str | None:
    """Why the target's layers cannot run on these kernels (None: they can)."""
    if triton is None:
        return "triton is not installed"
    cfg = target.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} (the kernels fuse silu)"
    d = target.head_dim
    if not _heads_fit(d, cfg.num_attention_heads, target.n_kv_heads):
        return f"head_dim {d} is not a power of two >= 16"
    if target._fused is None or any(f is None for f in target._fused):
        return "projections with biases (or unfused q/k/v and gate/up)"
    for layer in target.layers:
        if getattr(layer.self_attn.o_proj, "bias", None) is not None or \
                getattr(layer.mlp.down_proj, "bias", None) is not None:
            return "o_proj/down_proj biases"
    if getattr(target.lm_head, "bias", None) is not None:
        return "an lm_head bias"
    return None


def attach(drafters=(), refiners=(), on: bool = True) -> None:
    """Put the arms' dFlash drafters (those whose heads fit) and refiners (through a compile wrapper too) on these
    kernels, or with on=False back on torch ops. The target is switched by its own `use_kernels`."""
    me = sys.modules[__name__]
    for d in drafters:
        model = getattr(d, "model", None)
        if hasattr(model, "use_kernels"):
            model.use_kernels(me if on and drafter_fits(model.config) else None)
    for r in refiners:
        inner = getattr(r, "inner", r)
        if hasattr(inner, "use_kernels"):
            inner.use_kernels(me if on else None)


def interpreted() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1): the tests' way to run these on CPU."""
    import os
    return triton is not None and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
