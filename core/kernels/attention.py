"""One layer's decode attention, fused with the K/V cache write; and that cache write alone (`write_kv`).

Contract: T new rows (1..MAX_ROWS) at increasing positions [T] (int64, on the device), a fused projection qkv
[T, (n_q + 2 n_kv) d] (q heads, then k heads, then v heads), one layer's caches [n_kv, capacity, d] with a
power-of-two head_dim d >= 16 and n_q a multiple of n_kv, T * n_q / n_kv <= MAX_ATTN_ROWS query rows per program.
Per-head RMSNorm of q and k (Qwen3; None for Llama), rotary (cos/sin [T, d], the half-split layout), the new k/v
written at `positions`, then attention over the slots [0, positions[-1]] (read on the device, so one captured
graph serves every KV length): causal, or (causal=False, the drafter's block) every slot.
Split attention: up to MAX_SPLITS programs per K/V head share the slots, each at least `min_blocks` blocks; with
more than one active split each leaves partial results and the head's last split to arrive merges them, in split
order, counting arrivals in `counters` [>= n_kv] (int32). Assumes the counters are 0 at launch (the merging
split puts its head's back to 0) and that no other launch uses them meanwhile: they belong to one cache and
its stream (StaticKV.counters), and StaticKV.check_counters finds a leftover count (an aborted launch).
"""
from __future__ import annotations

import torch

from core.kernels.common import MAX_ROWS, MAX_SPLITS, Launch, after_previous, launch_opts, \
    pow2_at_least, prec, triton, tl

MAX_ATTN_ROWS = 128   # query rows (tokens x query heads per K/V head) one attention program keeps in registers
BLOCK = 128           # slots a program reads at a time when it has at most 32 query rows (more rows: 32)
MIN_BLOCKS = 4        # the fewest 64-slot blocks a split reads (a merge costs about as much as a few blocks)


def fits(tokens: int, groups: int) -> bool:
    """Whether a decode forward of `tokens` rows with `groups` query heads per K/V head runs on these kernels."""
    return tokens <= MAX_ROWS and tokens * groups <= MAX_ATTN_ROWS


def heads_fit(head_dim: int, n_q: int, n_kv: int) -> bool:
    """Attention shapes these kernels take: a power-of-two head_dim >= 16 and whole query groups."""
    return head_dim >= 16 and not head_dim & (head_dim - 1) and n_q % n_kv == 0


if triton is not None:
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
        after_previous(PDL)
        _store_kv(kv_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, T, s_kv, s_cs, s_kh, s_ks, 0,
                  tl.program_id(0), tl.num_programs(0), eps, NORM, D, BLOCK_T)

    @triton.jit
    def _attention_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, o_ptr, pm_ptr, pl_ptr,
                          pa_ptr, cnt_ptr, T, s_qkv, s_cs, s_kr, s_kh, s_ks, s_ot, HQ, scale, eps, NORM: tl.constexpr,
                          GROUPS: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr, CAUSAL: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, SPLITS: tl.constexpr,
                          MIN_BLOCKS: tl.constexpr, PDL: tl.constexpr):
        # programs (K/V head, split): each split with slots to read writes its head's T new keys/values (norm,
        # rope) into the cache (the splits write the same values), then its GROUPS*T query rows (norm, rope)
        # attend over its share of the slots [0, last position]: causally, or all of them (the drafter's
        # block). With several splits each leaves its running max, sum and output in pm/pl/pa, and the head's
        # last split to arrive (a counter at cnt_ptr + head, left at 0) merges them in split order.
        # Axis 2: the request (rows of several requests, each with its own T rows, positions and cache row at
        # s_kr; one request: axis 2 has one program and every offset below is 0).
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
        hh = rq * tl.num_programs(0) + h  # this request's head among all: its counter and partial results
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
            part = (hh * SPLITS + sp) * BLOCK_R + r
            tl.store(pm_ptr + part, m_i)
            tl.store(pl_ptr + part, l_i)
            tl.store(pa_ptr + part[:, None] * D + d[None, :], acc)
            tl.debug_barrier()  # all of this split's stores come before its arrival
            if tl.atomic_add(cnt_ptr + hh, 1, sem="acq_rel") == active - 1:
                first = hh * SPLITS * BLOCK_R + r
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
                tl.atomic_xchg(cnt_ptr + hh, 0)


def requests(qkv: torch.Tensor, cos: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor):
    """(positions, R, T, the cache's stride between requests) of an attention call: one request (positions [T],
    caches [n_kv, capacity, d]; stride 0) or R (positions [R, T], caches [R, n_kv, capacity, d], qkv and cos/sin of
    R * T rows)."""
    if positions.dim() == 1:
        return positions, 1, qkv.shape[0], 0
    r, t = positions.shape
    if qkv.shape[0] != r * t or cos.shape[0] != r * t or k_cache.dim() != 4 or k_cache.shape[0] != r:
        raise ValueError(f"kernels.attention: {r} requests of {t} rows need qkv and cos/sin of {r * t} rows and "
                         f"caches of {r} rows, got {qkv.shape[0]}, {cos.shape[0]} and {tuple(k_cache.shape)}")
    return positions.contiguous(), r, t, k_cache.stride(0)


def attention(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
              cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, n_q: int, scale: float, causal: bool = True, counters: torch.Tensor | None = None,
              launch: Launch = Launch(), splits: int | None = None, min_blocks: int = MIN_BLOCKS,
              block: int = BLOCK) -> torch.Tensor:
    """See the module docstring; returns [T, n_q * d]. splits: programs per K/V head (None: `launch`'s, else by
    the cache's capacity); min_blocks, block: as the constants (the tests vary them). A split launch needs
    `counters`.

    Rows of R requests in one launch: positions [R, T] (request r's T rows at its own positions), qkv and cos/sin
    [R * T, ...] (request r's rows r*T..), caches [R, n_kv, capacity, d] (a batched StaticKV layer, one row per
    request) and counters [>= R * n_kv]; returns [R * T, n_q * d]. Each request is computed as a launch of its own
    T rows over its own cache row would compute it, with the same splits (bitwise: the programs of one request
    read and write only its rows)."""
    positions, r, t, s_kr = requests(qkv, cos, positions, k_cache)
    n_kv, d = k_cache.shape[-3], k_cache.shape[-1]
    batched = positions.dim() == 2
    groups = n_q // n_kv
    o = torch.empty((r * t, n_q * d), dtype=qkv.dtype, device=qkv.device)
    rows = pow2_at_least(groups * t, 16)
    norm = q_norm is not None
    block_s = block if rows <= 32 else 32
    splits = splits or launch.attention_splits
    if block_s > 64:  # the minimum counts 64-slot blocks
        min_blocks = max(1, min_blocks * 64 // block_s)
    if splits is None:  # one block of slots per split up to MAX_SPLITS, by the cache's capacity (a host bound)
        splits = max(1, min(MAX_SPLITS, -(-k_cache.shape[-2] // block_s)))
    if splits > 1:
        if counters is None or counters.numel() < r * n_kv or counters.dtype != torch.int32:
            raise ValueError(f"kernels.attention: a split launch needs int32 counters for its {r * n_kv} K/V heads"
                             + (f" ({r} requests x {n_kv})" if batched else ""))
        pm = torch.empty((r * n_kv, splits, rows), dtype=torch.float32, device=qkv.device)
        pl = torch.empty_like(pm)
        pa = torch.empty((r * n_kv, splits, rows, d), dtype=torch.float32, device=qkv.device)
        cnt = counters
    else:
        pm = pl = pa = cnt = o
    _attention_kernel[(n_kv, splits, r)](
        qkv, q_norm if norm else k_cache, k_norm if norm else k_cache, cos, sin, positions, k_cache, v_cache, o,
        pm, pl, pa, cnt, t, qkv.stride(0), cos.stride(0), s_kr, k_cache.stride(-3), k_cache.stride(-2), o.stride(0),
        n_q, scale, eps, NORM=norm, GROUPS=groups, D=d, PREC=prec(qkv.dtype), CAUSAL=causal,
        BLOCK_T=pow2_at_least(t, 1), BLOCK_R=rows, BLOCK_S=block_s, SPLITS=splits, MIN_BLOCKS=min_blocks,
        num_warps=8 if block_s >= 128 else 4, **launch_opts(launch, qkv.device, r * t))
    return o


def write_kv(kv: torch.Tensor, k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
             positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, launch: Launch = Launch()) -> None:
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
                              BLOCK_T=pow2_at_least(t, 1), num_warps=4, **launch_opts(launch, kv.device, t))
