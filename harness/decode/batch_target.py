"""B requests' rows in one target forward, each request over its own row of a batched KV cache.

`BatchTarget` wraps a Target (its weights, ops, rotary and layer loop) with a core.cache.StaticKV of `rows`
rows ([layers, rows, n_kv, capacity, head_dim]: row b is request b's KV region, addressed by that request's own
positions) and `pos` [rows], each request's committed length on the device. A batch dimension rather than one
long cache of concatenated regions: a row then attends over its own slots only (a packed cache would make every
row read, and mask, all B regions), and each request keeps the positions it has alone, so its rotary and its
causal mask are the B=1 ones.

`verify(blocks [R, W], length)`: the R blocks as R*W rows of one Target.forward (its `batch` argument). Every
matmul and norm takes all rows at once; these are row-wise, so batching changes a row's numbers only as far as
the kernels tile by row count (as AR's 1 row and verify's W rows already differ at B=1). Attention (`BatchOps`)
writes each row's K/V at its request's positions in that request's cache row and attends there: on the Triton
ops one launch of the attention kernel for every request's rows, else one SDPA over [R, ...] with a causal mask
per request (core.ops.batch). The ops are sized by one request's W rows (Ops.sized(request_rows=W)): what the
attention kernel takes is one request's shape, and matmuls past the linear kernels' rows take the torch ops call
by call. One request (R = 1) runs on the target's own
single-request ops instead, its fused attention included, over this cache's one row (the target's own cache's
layout): the kernels, and so the numbers and the step cost, of the single-request loop. The prompt is prefilled
by the target itself, one request at a time, so its numbers are exactly those of B=1, and then copied into the
request's row (`load_prompt`).

`Row` is what one request's Stepper (harness.decode.loop) sees as its target: `pos` (a view of element b of
`pos`) and `commit`.

Persistent beside the cache (a captured step graph reads them by address, harness.decode.batch_loop): `out` [rows,
n], every request's output tokens (request b's output buffer is row b), and `live` / `spec` [rows], which requests
still step and which of them take a whole block this step (set by the host between steps).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from core.cache import StaticKV
from core.errors import UsageError
from core.ops import Ops, Span
from core.ops.batch import BatchOps
from harness.decode.target import Target


@dataclass(frozen=True)
class BatchRows:
    """What Target.forward(batch=...) uses instead of its own ops, cache and span."""
    ops: Ops
    kv: StaticKV
    span: Span


class Row:
    """One request's view of a BatchTarget: the target a per-request Stepper commits to."""

    def __init__(self, pos: torch.Tensor):
        self.pos = pos  # 0-d view of BatchTarget.pos

    def commit(self, n: torch.Tensor) -> None:
        self.pos.add_(n)


class BatchTarget:
    """A Target's forward over `rows` requests at once (see the module's docstring)."""

    def __init__(self, target: Target, rows: int):
        if type(target).forward is not Target.forward:
            raise UsageError(f"batched decoding runs the Llama/Qwen layer loop; {type(target).__name__} has its "
                             "own forward (decode it one request at a time)")
        self.target, self.rows = target, rows
        b = target.backend
        self.kv = StaticKV(target.n_layers, target.n_kv_heads, target.head_dim, 0, b.dtype, b.device, rows=rows)
        self.pos = torch.zeros(rows, dtype=torch.long, device=b.device)
        self.out = torch.full((rows, 0), -1, dtype=torch.long, device=b.device)
        self.live = torch.zeros(rows, dtype=torch.bool, device=b.device)
        self.spec = torch.zeros(rows, dtype=torch.bool, device=b.device)

    def outputs(self, n: int) -> torch.Tensor:
        """`out`, at least n tokens a row (a larger one is a new address: graphs reading the old one recapture)."""
        if self.out.shape[1] < n:
            self.out = torch.full((self.rows, n), -1, dtype=torch.long, device=self.out.device)
        return self.out

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    def ensure_capacity(self, n: int) -> None:
        self.kv.ensure(n)

    def row(self, b: int) -> Row:
        return Row(self.pos[b])

    def load_prompt(self, b: int, n: int) -> None:
        """Request b's prompt of n tokens, just prefilled by the target into its own cache, into row b; its
        committed length with it."""
        t = self.target
        self.kv.k[:, b, :, :n] = t.kv.k[:, 0, :, :n]
        self.kv.v[:, b, :, :n] = t.kv.v[:, 0, :, :n]
        self.pos[b] = n

    def verify(self, blocks: torch.Tensor, length: int, want_features: bool):
        """blocks [R = rows, W], request r's at positions pos[r]..pos[r]+W-1, not committed; `length`: a host
        bound (>= every pos[r] + W) on the slots read. Returns logits [R, W, V] and features [R, W, F] (or None)."""
        t = self.target
        r, w = blocks.shape
        positions = self.pos.unsqueeze(1) + torch.arange(w, device=blocks.device)
        if r == 1:  # one request: the target's own single-request ops (its fused attention) over this cache's row,
            # whose layout is the target's own cache's: B = 1 runs the kernels of the single-request loop
            rows = BatchRows(t.ops.sized(w, t.groups), self.kv, Span(positions.view(-1), length, impl=t.attn_impl))
        else:
            rows = BatchRows(BatchOps(t.ops.sized(r * w, t.groups, request_rows=w)), self.kv,
                             Span(positions, length, impl=t.attn_impl))
        logits, feats = t.forward(blocks.reshape(-1), positions.reshape(-1), length, want_features, batch=rows)
        return logits.view(r, w, -1), None if feats is None else feats.view(r, w, -1)
