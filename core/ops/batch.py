"""BatchOps: a model's ops over the rows of several requests, each request over its own row of a batched
core.cache.StaticKV (rows > 1). The target's batched verify (harness.decode.batch_target) and the dFlash drafter's
batched block (drafters.dflash_batch) run on it."""
from __future__ import annotations

import torch

from core.cache import StaticKV, attend, causal_mask, rotate
from core.ops.base import Ops, Span
from core.ops.torch_impl import rms


def _heads(rows: torch.Tensor, r: int, d: int, norm, eps, cos, sin) -> torch.Tensor:
    """Rows [R*T, heads*d] -> [R, heads, T, d], per-head norm and rotary (cos/sin [R, 1, T, d]) where given."""
    y = rows.view(r, rows.shape[0] // r, -1, d)
    if norm is not None:
        y = rms(y, norm, eps)
    y = y.transpose(1, 2)
    return y if cos is None else rotate(y, cos, sin)


class BatchOps(Ops):
    """A model's ops for the rows of several requests: linear and rms_norm are the model's own (row-wise);
    attention and write_kv take positions [R, T] (request r's rows at its own positions) and a StaticKV of R rows,
    and keep each request in its own row. A causal span (the target's) masks by position; a span with a `limit`
    [R] (the dFlash drafter's block, harness.decode.batch_draft) shows row r every slot below limit[r], which is
    its last position + 1 (core.ops.Span). Attention runs as one launch of the Triton attention kernel (the
    batch-invariant one under Launch.batch_invariant) for every request's rows where the inner ops are the Triton
    ops and the kernel takes the shape (TritonOps.rows_attention: each request the bits of its own launch), else on
    the torch ops: SDPA under a per-row mask over the slots up to the span's host bound."""

    def __init__(self, inner: Ops):
        self.inner, self.name = inner, inner.name

    def linear(self, x, w, **kw):
        return self.inner.linear(x, w, **kw)

    def rms_norm(self, x, weight, eps):
        return self.inner.rms_norm(x, weight, eps)

    def attention(self, qkv, kv: StaticKV, layer, span: Span, cos, sin, n_q, scale, q_norm=None, k_norm=None,
                  eps=0.0):
        fused = getattr(self.inner, "rows_attention", None)  # the Triton ops: one launch for every request's rows
        o = fused(qkv, kv, layer, span, cos, sin, n_q, scale, q_norm, k_norm, eps) if fused is not None else None
        if o is not None:
            return o
        r, t = span.positions.shape
        d, n_kv = kv.head_dim, kv.n_kv_heads
        q, k, v = qkv.split((n_q * d, n_kv * d, n_kv * d), dim=-1)
        cos, sin = cos.view(r, 1, t, d), sin.view(r, 1, t, d)
        q = _heads(q, r, d, q_norm, eps, cos, sin)
        kv.write_rows(layer, span.positions, _heads(k, r, d, k_norm, eps, cos, sin),
                      _heads(v, r, d, None, eps, None, None))
        ks, vs = kv.read(layer, span.length)  # [R, n_kv, length, d]: every request's own row
        if span.window is not None:
            raise NotImplementedError("batched attention over a sliding window is not built")
        if span.limit is None:
            mask = causal_mask(span.positions, span.length)
        else:  # every slot below the row's limit, for each of its T queries
            mask = (torch.arange(span.length, device=qkv.device) < span.limit.view(r, 1, 1)).expand(r, t, -1)
        o = attend(q, ks, vs, mask, scale, span.impl)
        return o.reshape(r * t, n_q * d)

    def write_kv(self, rows, kv, layer, positions, cos, sin, k_norm=None, eps=0.0):
        """rows [R*T, 2 * n_kv * d] (k then v) at positions [R, T], into each request's own cache row."""
        r, t = positions.shape
        d, n_kv = kv.head_dim, kv.n_kv_heads
        k, v = rows.split((n_kv * d, n_kv * d), dim=-1)
        cos, sin = cos.view(r, 1, t, d), sin.view(r, 1, t, d)
        kv.write_rows(layer, positions, _heads(k, r, d, k_norm, eps, cos, sin), _heads(v, r, d, None, eps, None, None))
