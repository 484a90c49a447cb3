"""Triton kernels for the target's decode step at batch 1 (one AR token or one verify block of a few rows).

At batch 1 every weight is read once per step and used for a handful of rows, so the step is a stream of weight
bytes plus a few hundred small launches. Three kernels cover a layer in six launches instead of about forty:
- `linear`: y = x W^T for up to 64 rows, with optional fused prologues (the RMSNorm that feeds the matmul, or
  silu(gate) * up from a fused gate/up output) and an optional residual add in the epilogue.
- `qk_rope_kv`: per-head RMSNorm of q and k (Qwen3), rotary embedding, and the K/V write into the static cache.
- `attention`: causal attention of the block's rows over the cache up to the block's last position (read from
  the device, so one captured graph serves every KV length), grouped-query heads folded into the rows.
Rounding follows HF's modules step by step (each elementwise op computed in fp32 and rounded to the model's dtype
where HF's bf16 op would round), so the only differences from the torch path are the matmul and softmax summation
orders. With TRITON_INTERPRET=1 the same kernels run on CPU tensors (the tests use that for correctness).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path is used instead (harness.target checks `available()`)
    triton = None
    tl = None

MAX_ROWS = 64      # rows one `linear` / `attention` call takes (verify blocks up to 64 tokens)
MAX_KV = 1 << 30   # attention has no KV-length limit of its own (it loops over the valid slots)


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
    """Tiles by shape, from the sweep in results/perf/kernels_h200.json (one H200, bf16, Qwen3-8B shapes). One row:
    the broadcast-multiply kernel with long row reads (best for every shape there: 3.0-4.5 TB/s against cuBLAS's
    2.5-4.4). Several rows: tensor-core dots, wider tiles for wider outputs."""
    block_k = _largest_pow2_dividing(k, 512)
    if m == 1:
        if n <= 8192:
            return LinearConfig(block_n=8, block_k=block_k, warps=4, stages=1, dot=False)
        return LinearConfig(block_n=32, block_k=min(block_k, 256), warps=8, stages=1, dot=False)
    if n <= 4096:
        return LinearConfig(block_n=32, block_k=block_k, warps=4, stages=4, dot=True)
    return LinearConfig(block_n=64, block_k=min(block_k, 128), warps=4, stages=6 if n <= 8192 else 3, dot=True)


if triton is not None:
    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, y_ptr, r_ptr, g_ptr, M, N, K, sx, sw, sy, sr, eps,
                       PRO: tl.constexpr, RES: tl.constexpr, DOT: tl.constexpr, EVEN_K: tl.constexpr,
                       PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # PRO: 0 plain x; 1 rms_norm(x) * g (HF rounding); 2 silu(x[:, :K]) * x[:, K:] (HF rounding)
        pid = tl.program_id(0)
        rm = tl.arange(0, BLOCK_M)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        dt = w_ptr.dtype.element_ty
        if PRO == 1:
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk
                xf = tl.load(x_ptr + rm[:, None] * sx + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :],
                             other=0.0).to(tl.float32)
                ss += tl.sum(xf * xf, axis=1)
            rstd = tl.rsqrt(ss / K + eps)
        if DOT:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            if EVEN_K:
                xmask = m_ok[:, None]
                wmask = n_ok[:, None]
            else:
                xmask = m_ok[:, None] & (kk < K)[None, :]
                wmask = n_ok[:, None] & (kk < K)[None, :]
            xk = tl.load(x_ptr + rm[:, None] * sx + kk[None, :], mask=xmask, other=0.0)
            if PRO == 1:
                g = tl.load(g_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
                xn = (xk.to(tl.float32) * rstd[:, None]).to(dt)
                xk = (xn.to(tl.float32) * g[None, :]).to(dt)
            if PRO == 2:
                up = tl.load(x_ptr + rm[:, None] * sx + K + kk[None, :], mask=xmask, other=0.0).to(tl.float32)
                gf = xk.to(tl.float32)
                act = (gf / (1.0 + tl.exp(-gf))).to(dt)
                xk = (act.to(tl.float32) * up).to(dt)
            w = tl.load(w_ptr + rn[:, None] * sw + kk[None, :], mask=wmask, other=0.0)
            if DOT:
                acc += tl.dot(xk.to(dt), tl.trans(w), input_precision=PREC)
            else:
                acc += w.to(tl.float32) * xk.to(tl.float32)  # one row: [1, BK] against [BN, BK]
        if DOT:
            y = acc.to(dt)
        else:
            y = tl.sum(acc, axis=1)[None, :].to(dt)
        out_mask = m_ok[:, None] & n_ok[None, :]
        if RES:
            r = tl.load(r_ptr + rm[:, None] * sr + rn[None, :], mask=out_mask, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(y_ptr + rm[:, None] * sy + rn[None, :], y, mask=out_mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, y_ptr, K, sx, sy, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < K
        dt = y_ptr.dtype.element_ty
        gf = tl.load(x_ptr + row * sx + c, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * sx + K + c, mask=ok, other=0.0).to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(dt)
        tl.store(y_ptr + row * sy + c, (act.to(tl.float32) * up).to(dt), mask=ok)

    @triton.jit
    def _qk_rope_kv_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr,
                           s_qkv, s_cs, s_q, s_kh, s_ks, HQ, HKV, eps, NORM: tl.constexpr, HALF: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        i = tl.arange(0, HALF)
        dt = qkv_ptr.dtype.element_ty
        src = qkv_ptr + t * s_qkv + h * (2 * HALF)
        x1 = tl.load(src + i)
        x2 = tl.load(src + HALF + i)
        pos = tl.load(pos_ptr + t)
        if h >= HQ + HKV:  # a value head: straight into the cache
            dst = vc_ptr + (h - HQ - HKV) * s_kh + pos * s_ks
            tl.store(dst + i, x1)
            tl.store(dst + HALF + i, x2)
        else:
            a = x1.to(tl.float32)
            b = x2.to(tl.float32)
            if NORM:
                if h < HQ:
                    wp = qn_ptr
                else:
                    wp = kn_ptr
                rstd = tl.rsqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / (2 * HALF) + eps)
                a = ((a * rstd).to(dt).to(tl.float32) * tl.load(wp + i).to(tl.float32)).to(dt).to(tl.float32)
                b = ((b * rstd).to(dt).to(tl.float32) * tl.load(wp + HALF + i).to(tl.float32)).to(dt).to(tl.float32)
            c1 = tl.load(cos_ptr + t * s_cs + i).to(tl.float32)
            c2 = tl.load(cos_ptr + t * s_cs + HALF + i).to(tl.float32)
            s1 = tl.load(sin_ptr + t * s_cs + i).to(tl.float32)
            s2 = tl.load(sin_ptr + t * s_cs + HALF + i).to(tl.float32)
            # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), each product rounded as in bf16 torch
            o1 = ((a * c1).to(dt).to(tl.float32) + (-b * s1).to(dt).to(tl.float32)).to(dt)
            o2 = ((b * c2).to(dt).to(tl.float32) + (a * s2).to(dt).to(tl.float32)).to(dt)
            if h < HQ:
                dst = q_ptr + t * s_q + h * (2 * HALF)
            else:
                dst = kc_ptr + (h - HQ) * s_kh + pos * s_ks
            tl.store(dst + i, o1)
            tl.store(dst + HALF + i, o2)

    @triton.jit
    def _attention_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, o_ptr, T, s_qt, s_kh, s_ks, s_ot, scale,
                          GROUPS: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_S: tl.constexpr):
        h = tl.program_id(0)
        r = tl.arange(0, BLOCK_R)
        g = r // T
        t = r % T
        r_ok = r < GROUPS * T
        d = tl.arange(0, D)
        head = h * GROUPS + g
        dt = kc_ptr.dtype.element_ty
        q = tl.load(q_ptr + t[:, None] * s_qt + head[:, None] * D + d[None, :], mask=r_ok[:, None], other=0.0)
        qpos = tl.load(pos_ptr + t, mask=r_ok, other=0)
        kv_len = (tl.load(pos_ptr + T - 1) + 1).to(tl.int32)
        m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, D], dtype=tl.float32)
        s = tl.arange(0, BLOCK_S)
        kbase = kc_ptr + h * s_kh
        vbase = vc_ptr + h * s_kh
        for s0 in range(0, kv_len, BLOCK_S):
            ss = s0 + s
            s_ok = ss < kv_len
            k = tl.load(kbase + ss[:, None] * s_ks + d[None, :], mask=s_ok[:, None], other=0.0)
            v = tl.load(vbase + ss[:, None] * s_ks + d[None, :], mask=s_ok[:, None], other=0.0)
            sc = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
            sc = tl.where((ss[None, :] <= qpos[:, None]) & s_ok[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))  # finite from the first block: key 0 is always visible
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(dt), v, input_precision=PREC)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + t[:, None] * s_ot + head[:, None] * D + d[None, :], out.to(dt), mask=r_ok[:, None])


def _prec(dtype: torch.dtype) -> str | None:
    """fp32 products in full precision (tensor cores would round the inputs to tf32); other dtypes: the default."""
    return "ieee" if dtype == torch.float32 else None


def linear(x: torch.Tensor, w: torch.Tensor, *, norm: torch.Tensor | None = None, eps: float = 0.0,
           gated: bool = False, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
           config: LinearConfig | None = None) -> torch.Tensor:
    """x [M, K] (or [M, 2K] with gated=True) and w [N, K] -> [M, N] in w's dtype.

    norm: RMSNorm weight [K] applied to x first (eps its epsilon); gated: x holds gate|up, the input is
    silu(gate) * up; residual [M, N]: added to the product (rounded first, as `h + linear(x)` would)."""
    m = x.shape[0]
    n, k = w.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"kernels.linear takes 1..{MAX_ROWS} rows, got {m}")
    if x.shape[1] != (2 * k if gated else k) or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"kernels.linear: x {tuple(x.shape)} does not fit w {tuple(w.shape)} (or not row-major)")
    cfg = config or choose_linear(m, n, k)
    dot = cfg.dot or m > 1
    if gated and dot and config is None:
        # the activation inside a tensor-core loop runs at a quarter of the weight rate (sweep): apply it once
        x, gated = silu_mul(x), False
    y = out if out is not None else torch.empty((m, n), dtype=w.dtype, device=w.device)
    r = residual if residual is not None else y
    block_k = min(cfg.block_k, _pow2_at_least(k, 16))
    grid = (triton.cdiv(n, cfg.block_n),)
    _linear_kernel[grid](x, w, y, r, norm if norm is not None else w, m, n, k, x.stride(0), w.stride(0),
                         y.stride(0), r.stride(0), eps, PRO=1 if norm is not None else (2 if gated else 0),
                         RES=residual is not None, DOT=dot, EVEN_K=k % block_k == 0, PREC=_prec(w.dtype),
                         BLOCK_M=_pow2_at_least(m, 16) if dot else 1, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                         num_warps=cfg.warps, num_stages=cfg.stages)
    return y


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2K] = gate | up -> silu(gate) * up [M, K], rounded as HF's two bf16 ops."""
    m, k = x.shape[0], x.shape[1] // 2
    y = torch.empty((m, k), dtype=x.dtype, device=x.device)
    _silu_mul_kernel[(m, triton.cdiv(k, 1024))](x, y, k, x.stride(0), y.stride(0), BLOCK=1024, num_warps=4)
    return y


def qk_rope_kv(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
               cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, n_q: int, n_kv: int) -> torch.Tensor:
    """qkv [T, (n_q + 2 n_kv) d] -> rotated q [T, n_q, d]; rotated k and v written at `positions` into the caches
    [n_kv, capacity, d] (one layer's slice). q_norm/k_norm: per-head RMSNorm weights [d] or None (Llama)."""
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    q = torch.empty((t, n_q, d), dtype=qkv.dtype, device=qkv.device)
    norm = q_norm is not None
    _qk_rope_kv_kernel[(t, n_q + 2 * n_kv)](
        qkv, q_norm if norm else qkv, k_norm if norm else qkv, cos, sin, positions, q, k_cache, v_cache,
        qkv.stride(0), cos.stride(0), q.stride(0), k_cache.stride(0), k_cache.stride(1), n_q, n_kv, eps,
        NORM=norm, HALF=d // 2, num_warps=1)
    return q


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
              scale: float) -> torch.Tensor:
    """q [T, n_q, d] at increasing `positions` [T] (the last one is the highest); causal over the cache slots
    [0, positions[-1]]. Returns [T, n_q * d]."""
    t, n_q, d = q.shape
    n_kv = k_cache.shape[0]
    groups = n_q // n_kv
    o = torch.empty((t, n_q * d), dtype=q.dtype, device=q.device)
    rows = _pow2_at_least(groups * t, 16)
    _attention_kernel[(n_kv,)](q, k_cache, v_cache, positions, o, t, q.stride(0), k_cache.stride(0),
                               k_cache.stride(1), o.stride(0), scale, GROUPS=groups, D=d, PREC=_prec(q.dtype),
                               BLOCK_R=rows, BLOCK_S=64 if rows <= 32 else 32, num_warps=4)
    return o


def unsupported_reason(target) -> str | None:
    """Why the target's layers cannot run on these kernels (None: they can)."""
    if triton is None:
        return "triton is not installed"
    cfg = target.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} (the kernels fuse silu)"
    d = target.head_dim
    if d < 16 or d & (d - 1):
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


def interpreted() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1): the tests' way to run these on CPU."""
    import os
    return triton is not None and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
