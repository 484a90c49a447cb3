"""Batch-invariant kernels (issue 28, opt-in: Launch.batch_invariant): a row's outputs are the same bits whatever
the number of rows launched beside it (1..MAX_ROWS), so a verify row's logits are AR's at that position.

They sit beside the default kernels (matmul.py, attention.py) as @triton.jit kernels of their own, never as
branches of those: the default kernels' source, and so what Triton compiles for them, is what it was before this
module existed (tests/test_kernel_defaults.py pins it). `core.kernels.linear` and `attention` (select.py) come
here only when the launch asks for it.
- `linear`: tensor-core dots over ROWS-row tiles at every row count, one program per (row tile, column block),
  the tiles matmul.choose_linear picks for ROWS rows (fixed by (n, k) alone), so each row's reduction over K runs
  the same instructions in the same order; the RMSNorm and silu * up before it are launches of their own
  (rows.py: per row already), never folded.
- `attention`: the new tokens' K/V written ROWS at a time (AR's write for each), the query rows taken ROWS at a
  time, BLOCK slots read at a time whatever the rows, and the slots split by slot index (a split per `per` slots
  from slot 0, not by the KV length): a slot past a row's position adds exact zeros, and a split past it merges
  with weight 0.
Under Triton's CPU interpreter the dots take bf16/fp16 operands to fp32 first (`upcast`: numpy has no bf16) and
sum the products with numpy's reduction rather than its BLAS matmul: a BLAS sgemm may round a row differently by
where the row sits in its tile (seen on an AVX-512 CPU with numpy 2.3.5: 10 of 16 positions gave other bits), which
is the machine's, not the kernel's; compiled for a GPU the constexpr is False and the dot is the plain tensor-core
dot.
Verified on a GPU: VERIFIED_ON_GPU records the run (the run facts label a batch-invariant run by it).
"""
from __future__ import annotations

import torch

from core.kernels.attention import BLOCK, MIN_BLOCKS, requests
from core.kernels.common import MAX_ROWS, Launch, after_previous, interpreted, launch_opts, pow2_at_least, prec, \
    shared_memory_limit, triton, tl
from core.kernels.matmul import PREFETCH_TILES, LinearConfig, choose_linear
from core.kernels.rows import argmax_reduce, rms_norm, silu_mul

ROWS = 16  # rows of one tensor-core tile: a linear program's rows, an attention pass's query rows and new tokens
# None until a GPU run shows these kernels compile and give AR's bits at the real shapes
# (tests/test_batch_invariant_gpu.py on CUDA); then the date and commit of that run, e.g. "2026-12-03 abc1234".
# 2026-12-02: 10 passed on one H200 (torch 2.11.0+cu130, Triton 3.6.0, driver 580.159.04), every linear and the
# attention at SmolLM2-135M's and Qwen3-8B's shapes at 1..64 rows in bf16 and fp16, and greedy bf16 decoding of
# every arm equal to AR eagerly and in CUDA graphs (the kernels as of 7f3d20e; results/perf/NOTES.md).
VERIFIED_ON_GPU: str | None = "2026-12-02 7f3d20e"


def upcast(dtype: torch.dtype) -> bool:
    """Whether the dots take 16-bit operands to fp32 first and sum them without BLAS: under Triton's interpreter only
    (whose numpy dot has no bf16). A bf16 or fp16 product is exact in fp32, so only the summation order is the
    interpreter's own, and it is the same for every row of a tile."""
    return interpreted() and dtype in (torch.bfloat16, torch.float16)


def tiles(n: int, k: int, elem: int = 2, limit: int | None = None) -> LinearConfig:
    """The linear tiles for [*, k] x [k, n] at any row count: those matmul.choose_linear picks for ROWS rows."""
    return choose_linear(ROWS, n, k, elem, limit)


def fits(tokens: int) -> bool:
    """Whether a decode forward of `tokens` rows runs on these kernels (any query heads per K/V head: attention
    takes its query rows ROWS at a time)."""
    return tokens <= MAX_ROWS


if triton is not None:  # (the default kernels' helpers exist only with Triton)
    from core.kernels.attention import _norm_rope, _store_kv
    from core.kernels.matmul import _prefetch_l2

    @triton.jit
    def _mma(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
        """a [R, K] @ b [K, C] accumulated in fp32 (UPCAST: interpreter only, see `upcast`)."""
        if UPCAST:  # products (exact in fp32) summed over K by numpy in one order for every row, not by its BLAS
            return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        return tl.dot(a, b, input_precision=PREC)

    @triton.jit
    def _k_slice(ptr, idx, idx_ok, k0, stride, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
        """Rows `idx` [R] of a row-major matrix, columns k0..k0+BLOCK_K (zeros outside)."""
        kk = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            ok = idx_ok[:, None]
        else:
            ok = idx_ok[:, None] & (kk < K)[None, :]
        return tl.load(ptr + idx[:, None] * stride + kk[None, :], mask=ok, other=0.0)

    @triton.jit
    def _inv_linear_kernel(x_ptr, w_ptr, y_ptr, r_ptr, pv_ptr, pi_ptr, M, N, K, sx, sw, sy, sr,
                           RES: tl.constexpr, ARGMAX: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
                           PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PDL: tl.constexpr, PF_COLS: tl.constexpr, LINE: tl.constexpr):
        # programs (row tile, column block); axis 0 is the row tile, so a column block's tiles run side by side
        # and the later ones find its weights in L2. Every row: the same dot over the same K steps.
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        block = tl.program_id(1)
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_ok, cols_ok = rows < M, cols < N
        dt = w_ptr.dtype.element_ty
        if PF_COLS > 0:  # (PDL only) the weights do not depend on the launch before: ask for the first columns
            first = tl.minimum(tl.arange(0, PF_COLS // LINE) * LINE, K - 1)
            _prefetch_l2(w_ptr + tl.minimum(cols, N - 1)[:, None] * sw + first[None, :])
        after_previous(PDL)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = _k_slice(x_ptr, rows, rows_ok, k0, sx, K, EVEN_K, BLOCK_K)
            b = _k_slice(w_ptr, cols, cols_ok, k0, sw, K, EVEN_K, BLOCK_K)
            acc += _mma(a, tl.trans(b), PREC, UPCAST)
        both = rows_ok[:, None] & cols_ok[None, :]
        out = acc.to(dt)
        if RES:  # rounded first, as `h + linear(x)` rounds
            res = tl.load(r_ptr + rows[:, None] * sr + cols[None, :], mask=both, other=0.0).to(tl.float32)
            out = (out.to(tl.float32) + res).to(dt)
        tl.store(y_ptr + rows[:, None] * sy + cols[None, :], out, mask=both)
        if ARGMAX:  # per row: this block's largest output (NaN as +inf) and the lowest column holding it
            v = out.to(tl.float32)
            v = tl.where(both, tl.where(v == v, v, float("inf")), float("-inf"))
            top = tl.max(v, axis=1)
            at = tl.min(tl.where(v == top[:, None], cols[None, :], N), axis=1)
            slot = rows * tl.num_programs(1) + block
            tl.store(pv_ptr + slot, top, mask=rows_ok)
            tl.store(pi_ptr + slot, tl.minimum(at, N - 1), mask=rows_ok)

    @triton.jit
    def _queries(qkv_ptr, qn_ptr, cos_ptr, sin_ptr, pos_ptr, r0, T, h, s_qkv, s_cs, s_ot, eps, NORM: tl.constexpr,
                 GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr):
        """Query rows r0..r0+BLOCK_R of K/V head h (row r: query head h * GROUPS + r // T, token r % T), normed
        and rotated: (q, which rows are real, their positions, their offsets in the output)."""
        r = r0 + tl.arange(0, BLOCK_R)
        tok, qh = r % T, h * GROUPS + r // T
        real = r < GROUPS * T
        d = tl.arange(0, D)
        rot = tok[:, None] * s_cs + d[None, :]
        c = tl.load(cos_ptr + rot, mask=real[:, None], other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + rot, mask=real[:, None], other=0.0).to(tl.float32)
        q = _norm_rope(qkv_ptr + tok[:, None] * s_qkv + qh[:, None] * D, real, qn_ptr, c, s, d, eps, NORM, D)
        return q, real, tl.load(pos_ptr + tok, mask=real, other=0), tok[:, None] * s_ot + qh[:, None] * D + d[None, :]

    @triton.jit
    def _attend(q, qpos, kbase, vbase, lo, hi, s_ks, scale, CAUSAL: tl.constexpr, PREC: tl.constexpr,
                UPCAST: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
        """The query rows q [BLOCK_R, D] over the slots [lo, hi), BLOCK_S at a time: running max, sum, output
        (fp32). A slot a row does not see weighs exactly 0."""
        d = tl.arange(0, D)
        top = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_R], dtype=tl.float32)
        out = tl.zeros([BLOCK_R, D], dtype=tl.float32)
        for s0 in range(lo, hi, BLOCK_S):
            slot = s0 + tl.arange(0, BLOCK_S)
            there = slot < hi
            kv_at = slot[:, None] * s_ks + d[None, :]
            keys = tl.load(kbase + kv_at, mask=there[:, None], other=0.0)
            vals = tl.load(vbase + kv_at, mask=there[:, None], other=0.0)
            seen = there[None, :]
            if CAUSAL:
                seen = seen & (slot[None, :] <= qpos[:, None])
            z = tl.where(seen, _mma(q, tl.trans(keys), PREC, UPCAST) * scale, float("-inf"))
            new_top = tl.maximum(top, tl.max(z, axis=1))
            ref = tl.where(new_top == float("-inf"), 0.0, new_top)  # nothing seen yet: the row stays empty
            kept = tl.exp(top - ref)
            p = tl.exp(z - ref[:, None])
            total = total * kept + tl.sum(p, axis=1)
            out = out * kept[:, None] + _mma(p.to(vals.dtype), vals, PREC, UPCAST)
            top = new_top
        return top, total, out

    @triton.jit
    def _merge(pm_ptr, pl_ptr, pa_ptr, first, active, ROWS_PER, D: tl.constexpr, BLOCK_R: tl.constexpr):
        """The splits' partial results of rows at `first` [BLOCK_R], in split order -> the rows' outputs (fp32)."""
        d = tl.arange(0, D)
        mx = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        for j in range(active):
            mx = tl.maximum(mx, tl.load(pm_ptr + first + j * ROWS_PER, cache_modifier=".cg"))
        den = tl.zeros([BLOCK_R], dtype=tl.float32)
        num = tl.zeros([BLOCK_R, D], dtype=tl.float32)
        for j in range(active):  # key 0 is visible to every row, so mx is finite; a split past the row weighs 0
            at = first + j * ROWS_PER
            wj = tl.exp(tl.load(pm_ptr + at, cache_modifier=".cg") - mx)
            den += tl.load(pl_ptr + at, cache_modifier=".cg") * wj
            num += tl.load(pa_ptr + at[:, None] * D + d[None, :], cache_modifier=".cg") * wj[:, None]
        return num / den[:, None]

    @triton.jit
    def _inv_attention_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, o_ptr, pm_ptr,
                              pl_ptr, pa_ptr, cnt_ptr, T, s_qkv, s_cs, s_kr, s_kh, s_ks, s_ot, HQ, ROWS_PER, scale, eps,
                              NORM: tl.constexpr, GROUPS: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr,
                              CAUSAL: tl.constexpr, UPCAST: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK_S: tl.constexpr, PER: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
        # programs (K/V head, split); split sp reads the slots [sp * PER, (sp + 1) * PER) of [0, last position]
        # (none past it: it returns). Each writes the head's T new keys/values, BLOCK_R tokens at a time (the
        # splits write the same values), then its query rows attend, BLOCK_R at a time. With several active
        # splits each leaves partials (ROWS_PER rows a split) and the head's last to arrive merges them.
        # Axis 2: the request (as in attention._attention_kernel: each request's own rows, positions, cache row at
        # s_kr, counters and partials; one request: every offset below is 0).
        after_previous(PDL)
        h = tl.program_id(0)
        sp = tl.program_id(1)
        rq = tl.program_id(2)
        qkv_ptr += rq * T * s_qkv
        pos_ptr += rq * T
        cos_ptr += rq * T * s_cs
        sin_ptr += rq * T * s_cs
        kc_ptr += rq.to(tl.int64) * s_kr
        vc_ptr += rq.to(tl.int64) * s_kr
        o_ptr += rq * T * s_ot
        hh = rq * tl.num_programs(0) + h  # this request's head among all: its counter and partials
        dt = kc_ptr.dtype.element_ty
        kv_len = (tl.load(pos_ptr + T - 1) + 1).to(tl.int32)
        active = tl.cdiv(kv_len, PER)
        if sp >= active:
            return
        for t0 in range(0, T, BLOCK_R):
            _store_kv(qkv_ptr + t0 * s_qkv, kn_ptr, cos_ptr + t0 * s_cs, sin_ptr + t0 * s_cs, pos_ptr + t0, kc_ptr,
                      vc_ptr, T - t0, s_qkv, s_cs, s_kh, s_ks, HQ, h, tl.num_programs(0), eps, NORM, D, BLOCK_R)
        tl.debug_barrier()  # this program's cache writes above are read below
        lo = sp * PER
        hi = tl.minimum(lo + PER, kv_len)
        d = tl.arange(0, D)
        for r0 in range(0, GROUPS * T, BLOCK_R):
            q, real, qpos, dst = _queries(qkv_ptr, qn_ptr, cos_ptr, sin_ptr, pos_ptr, r0, T, h, s_qkv, s_cs, s_ot,
                                          eps, NORM, GROUPS, D, BLOCK_R)
            top, total, acc = _attend(q, qpos, kc_ptr + h * s_kh, vc_ptr + h * s_kh, lo, hi, s_ks, scale, CAUSAL,
                                      PREC, UPCAST, D, BLOCK_R, BLOCK_S)
            if SPLITS == 1:  # (a constexpr branch: no partials are passed then)
                tl.store(o_ptr + dst, (acc / total[:, None]).to(dt), mask=real[:, None])
            elif active == 1:
                tl.store(o_ptr + dst, (acc / total[:, None]).to(dt), mask=real[:, None])
            else:
                part = (hh * SPLITS + sp) * ROWS_PER + r0 + tl.arange(0, BLOCK_R)
                tl.store(pm_ptr + part, top)
                tl.store(pl_ptr + part, total)
                tl.store(pa_ptr + part[:, None] * D + d[None, :], acc)
        if SPLITS > 1:  # (a constexpr test first: a launch of one split is passed no counter)
            if active > 1:
                tl.debug_barrier()  # all of this split's stores come before its arrival
                if tl.atomic_add(cnt_ptr + hh, 1, sem="acq_rel") == active - 1:
                    for r0 in range(0, GROUPS * T, BLOCK_R):
                        r = r0 + tl.arange(0, BLOCK_R)
                        tok, qh = r % T, h * GROUPS + r // T
                        res = _merge(pm_ptr, pl_ptr, pa_ptr, hh * SPLITS * ROWS_PER + r, active, ROWS_PER, D,
                                     BLOCK_R)
                        tl.store(o_ptr + tok[:, None] * s_ot + qh[:, None] * D + d[None, :], res.to(dt),
                                 mask=(r < GROUPS * T)[:, None])
                    tl.atomic_xchg(cnt_ptr + hh, 0)


def linear(x: torch.Tensor, w: torch.Tensor, *, norm: torch.Tensor | None = None, eps: float = 0.0,
           gated: bool = False, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
           config: LinearConfig | None = None, argmax: bool = False, launch: Launch = Launch()):
    """matmul.linear's contract (the same arguments and results), a row's outputs the same bits at any M: the norm
    (HF's roundings) or silu * up a launch of its own, then tensor-core dots over ROWS-row tiles on `tiles`(n, k)
    (an explicit config: its tiles, as given)."""
    m, (n, k) = x.shape[0], w.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"kernels.linear takes 1..{MAX_ROWS} rows, got {m}")
    if norm is not None and gated:
        raise ValueError("kernels.linear: norm and gated do not combine")
    if x.shape[1] != (2 * k if gated else k) or w.stride(1) != 1:
        raise ValueError(f"kernels.linear: x {tuple(x.shape)} does not fit w {tuple(w.shape)} (or w not row-major)")
    x = x if x.stride(1) == 1 else x.contiguous()
    x = rms_norm(x, norm, eps, launch) if norm is not None else silu_mul(x, launch) if gated else x
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    cfg = config or tiles(n, k, w.element_size(), shared_memory_limit(w.device))
    block_k = min(cfg.block_k, pow2_at_least(k, 16))
    grid = (triton.cdiv(m, ROWS), triton.cdiv(n, cfg.block_n))
    y = out if out is not None else torch.empty((m, n), dtype=w.dtype, device=w.device)
    pv, pi = (torch.empty((m, grid[1]), dtype=dt, device=w.device) for dt in (torch.float32, torch.int32)) \
        if argmax else (y, y)
    opts = launch_opts(launch, w.device, m)
    line = max(128 // w.element_size(), 1)  # elements per 128-byte line
    pf_cols = min(pow2_at_least(PREFETCH_TILES * block_k, line), pow2_at_least(k, line)) \
        if opts["PDL"] and m > 1 else 0  # as kernels.linear: no prefetch at one row
    _inv_linear_kernel[grid](x, w, y, residual if residual is not None else y, pv, pi, m, n, k, x.stride(0),
                             w.stride(0), y.stride(0), (residual if residual is not None else y).stride(0),
                             RES=residual is not None, ARGMAX=argmax, EVEN_K=k % block_k == 0, UPCAST=upcast(w.dtype),
                             PREC=prec(w.dtype), BLOCK_M=ROWS, BLOCK_N=cfg.block_n, BLOCK_K=block_k, PF_COLS=pf_cols,
                             LINE=line, num_warps=cfg.warps, num_stages=cfg.stages, **opts)
    return (y, argmax_reduce(pv, pi, launch)) if argmax else y


def _partials(n_kv: int, splits: int, rows: int, d: int, counters, o: torch.Tensor):
    """pm, pl, pa, counters of a split launch (one split: `o` in their places, never read)."""
    if splits == 1:
        return o, o, o, o
    if counters is None or counters.numel() < n_kv or counters.dtype != torch.int32:
        raise ValueError(f"kernels.attention: a split launch needs int32 counters for its {n_kv} K/V heads")
    shape = (n_kv, splits, rows)
    return (torch.empty(shape, dtype=torch.float32, device=o.device), torch.empty(shape, dtype=torch.float32,
            device=o.device), torch.empty(shape + (d,), dtype=torch.float32, device=o.device), counters)


def attention(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
              cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, n_q: int, scale: float, causal: bool = True, counters: torch.Tensor | None = None,
              launch: Launch = Launch(), splits: int | None = None, min_blocks: int = MIN_BLOCKS,
              block: int = BLOCK) -> torch.Tensor:
    """attention.attention's contract (any T * n_q / n_kv), a row's outputs and K/V writes the same bits at any T
    and any KV length past its position: `block` slots read at a time, a split per min_blocks 64-slot blocks
    (whole blocks) from slot 0, as many splits as the cache's capacity needs (so `splits` may not be given).
    Rows of R requests in one launch as attention.attention takes them (positions [R, T], caches [R, n_kv, capacity,
    d], counters [>= R * n_kv]): each request's the same bits as its own launch's."""
    if splits is not None or launch.attention_splits is not None:
        raise ValueError("kernels.attention: a batch-invariant launch splits the slots by index; give no splits")
    positions, r, t, s_kr = requests(qkv, cos, positions, k_cache)
    n_kv, cap, d = k_cache.shape[-3], k_cache.shape[-2], k_cache.shape[-1]
    groups = n_q // n_kv
    rows = triton.cdiv(groups * t, ROWS) * ROWS
    per = triton.cdiv(max(min_blocks * 64, block), block) * block
    n_splits = triton.cdiv(cap, per)
    o = torch.empty((r * t, n_q * d), dtype=qkv.dtype, device=qkv.device)
    pm, pl, pa, cnt = _partials(r * n_kv, n_splits, rows, d, counters, o)
    norm = q_norm is not None
    _inv_attention_kernel[(n_kv, n_splits, r)](
        qkv, q_norm if norm else k_cache, k_norm if norm else k_cache, cos, sin, positions, k_cache, v_cache, o,
        pm, pl, pa, cnt, t, qkv.stride(0), cos.stride(0), s_kr, k_cache.stride(-3), k_cache.stride(-2), o.stride(0),
        n_q, rows, scale, eps, NORM=norm, GROUPS=groups, D=d, PREC=prec(qkv.dtype), CAUSAL=causal,
        UPCAST=upcast(qkv.dtype), BLOCK_R=ROWS, BLOCK_S=block, PER=per, SPLITS=n_splits,
        num_warps=8 if block >= 128 else 4,
        **launch_opts(launch, qkv.device, r * t))
    return o
