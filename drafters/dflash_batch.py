"""The dFlash drafts of B requests in one forward: a DrafterGroup over one DFlashDrafter's weights.

Each request keeps its own context, in its own row of one batched core.cache.StaticKV ([layers, B, kv heads,
capacity, head_dim]) at its own positions, so a request's drafts are computed from exactly what it would see alone.
- `members[b]` is request b's Drafter (core.protocols): `begin` writes its prompt's context into row b through the
  base drafter's own one-row cache (the B=1 code, then a copy), `propose` returns its row of the group's last
  `prefetch`, `observe` is refused: the batch observes every row at once (`observe`).
- `prefetch(anchors [B], positions [B], length)`: one block forward of B x block rows (core.ops.batch.BatchOps:
  row b attends over its own slots below positions[b] + block), one lm_head; every row is computed whether or not
  its request drafts this step (fixed shapes), and the batch loop reads the rows of those that do.
- `observe(features [B, W, F], counts [B])`: the verified block's context K/V for every row at its own positions,
  then each row's context advances by its count (0: a request that did not draft keeps its context; what was
  written past it is stale and overwritten before anything reads it).
Numbers: the matmuls see B x W rows instead of W, so a row's drafts match its B=1 drafts up to the kernels' tiling
by row count (bitwise where they do not tile by it). The drafts never change the target's output at T=0; they
change tau only through such rounding. One row (B = 1) runs on the base drafter's own ops, its single-request
attention included, over row 0 of the group's cache. Sliding-window drafters (Gemma 4's) are refused: BatchOps has
no window.
"""
from __future__ import annotations

import torch

from core.cache import StaticKV
from core.errors import UsageError
from core.ops.batch import BatchOps
from core.protocols import Proposal


class _Member:
    """Request b's view of the group: what generate_batch hands its `_Decode` as the request's drafter."""

    def __init__(self, group: "DFlashGroup", b: int):
        self.group, self.b, self.block_size = group, b, group.block_size

    def ensure_capacity(self, n: int) -> None:
        self.group.ensure_capacity(n)

    def begin(self, features: torch.Tensor) -> None:
        self.group.begin(self.b, features)

    def propose(self, anchor: torch.Tensor, position: torch.Tensor, length: int) -> Proposal:
        return self.group.proposal(self.b)

    def observe(self, features: torch.Tensor, count: torch.Tensor) -> None:
        raise RuntimeError("a DFlashGroup's rows are observed together (DFlashGroup.observe), not one at a time")


class DFlashGroup:
    """B requests' dFlash drafters over `base`'s weights, embedding, lm_head and ops (see the module docstring)."""

    def __init__(self, base, rows: int):
        c = base.model.config
        if "sliding_attention" in c.layer_types:
            raise UsageError("batched drafting supports full-attention dFlash drafters only; this drafter has "
                             "sliding-window layers: decode its requests one at a time")
        self.base, self.rows, self.block_size = base, rows, base.block_size
        device = base.ctx.device
        self.kv = StaticKV(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 0, base.kv.dtype, device,
                           rows=rows)
        self.ctx = torch.zeros(rows, dtype=torch.long, device=device)
        self.members = [_Member(self, b) for b in range(rows)]
        self._offsets = torch.arange(self.block_size, device=device)
        self._masks = torch.full((rows, self.block_size - 1), c.mask_token_id, dtype=torch.long, device=device)
        self._groups = c.num_attention_heads // c.num_key_value_heads
        self._last: tuple | None = None

    def ensure_capacity(self, n: int) -> None:
        self.base.ensure_capacity(n)
        self.kv.ensure(n + self.block_size)  # observe writes a whole block past the context, as the base does

    def begin(self, b: int, features: torch.Tensor) -> None:
        """Request b's prompt context: the base drafter's write (its one-row cache as scratch), copied to row b."""
        n = features.shape[0]
        self.base.begin(features)
        self.kv.k[:, b, :, :n] = self.base.kv.k[:, 0, :, :n]
        self.kv.v[:, b, :, :n] = self.base.kv.v[:, 0, :, :n]
        self.ctx[b] = n

    def _ops(self, n_rows: int):
        """The rows' ops; for one request the base drafter's own (its single-request attention, over row 0 of this
        cache, whose layout is the base's own cache's): B = 1 drafts on the kernels of the single-request loop."""
        if self.rows == 1:
            return self.base.ops.sized(n_rows, self._groups)
        return BatchOps(self.base.ops.sized(n_rows, self._groups, request_rows=n_rows // self.rows))

    def _at(self, t: torch.Tensor) -> torch.Tensor:
        """[B, ...] per-row positions (limits) as the ops take them: one request's without the row dimension."""
        return t[0] if self.rows == 1 else t

    @torch.no_grad()
    def prefetch(self, anchors: torch.Tensor, positions: torch.Tensor, length: int) -> None:
        """Every row's block [anchor, mask x W-1] at positions[b].., one forward; `length` bounds the slots read."""
        b, w = self.rows, self.block_size
        ids = torch.cat((anchors.view(b, 1), self._masks), 1)
        pos = positions.view(b, 1) + self._offsets
        model = self.base.model
        hidden = model.block(self.base.embed(ids.reshape(-1)), self._at(pos), self.kv, self._at(positions + w),
                             length, self._ops(b * w))
        rows = hidden.view(b, w, -1)
        lm = self.base.lm_head
        # (one request: sized as the base drafter sizes its lm_head, by the block)
        lm_ops = self._ops(w if b == 1 else b * (w - 1))
        logits, tokens = lm_ops.linear(rows[:, 1:].reshape(b * (w - 1), -1), lm.weight, bias=lm.bias, argmax=True)
        self._last = (tokens.view(b, w - 1), logits.view(b, w - 1, -1), rows)

    def proposal(self, b: int) -> Proposal:
        tokens, logits, hidden = self.proposals()
        return Proposal(tokens=tokens[b], logits=logits[b], hidden=hidden[b])

    def proposals(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every row's (drafts [B, W-1], q [B, W-1, V], hidden [B, W, H]) of the last prefetch (the batch loop's
        batched step reads them whole)."""
        if self._last is None:
            raise RuntimeError("DFlashGroup.prefetch must run before a member proposes")
        return self._last

    @torch.no_grad()
    def observe(self, features: torch.Tensor, counts: torch.Tensor) -> None:
        """features [B, W, F] of every row's verified block at its context; counts [B] (0: the row did not draft)."""
        b, w = features.shape[0], features.shape[1]
        pos = self.ctx.view(b, 1) + self._offsets[:w]
        self.base.model.write_context(features.reshape(b * w, -1), self._at(pos), self.kv, self._ops(b * w))
        self.ctx.add_(counts)
