"""The batched greedy step of harness.decode.batch_loop as an object that outlives the batch that made it.

`RowsStep.run(length)` is one fixed-shape function of persistent state: the BatchTarget's pos, cache, output rows
and live/spec masks (harness.decode.batch_target), the drafter group's cache and context, the refiner, the state
slot's stop ids, and this object's own constants (block offsets, the idle row). A CUDA graph of it
(harness.decode.graphs.StepGraphs) is captured by one batch and replayed by every later batch of the same size and
arm, so everything it reads must live as long as the graph: the graph entry keeps this object (its `refs`), and the
DecodeState finds it again for the next batch (`RowsStep.of`; a weak map: an eager batch's step goes with it). A
tensor of the batch that captured the graph (a `_Batch` is made per generate_batch call) would be freed with it, and
a replay would read whatever took its memory: on the H200 that was a block offset read as an out-of-range scatter
index (a device-side assert).

What the step does, per row, finished or not (the batch loop's docstring has the why): the group's draft, the
refinement of every row (one BatchRefiner call, else the refiner's own refine() per row), one verify, the
exact-match verdict of every row at once ([B, W] argmax, the accepted run, the next token: the rule of
verify.exact_match; scripted acceptance forces min(N, W-1)), the emitted tokens written to each row, the first stop
per row, and the commit and the group's observe masked by `live`. A row with spec False keeps row 0 of its block
only (n = 0: its plain target step).
"""
from __future__ import annotations

import torch

from core.protocols import IdentityRefiner, Proposal, RefineContext


class RowsStep:
    """One arm's batched step over one BatchTarget (see the module's docstring)."""

    @classmethod
    def of(cls, state, batch, width: int, group, refiner, refines, forced: int | None,
           stops: torch.Tensor) -> "RowsStep":
        """The state's step for this arm and shape (made on first need): the same object, so the same tensors, for
        every batch that replays its graphs."""
        key = (id(batch), width, id(group), id(refiner), id(refines), forced, id(stops))
        steps = state.rows_steps
        step = steps.get(key)
        if step is None:  # while it lives it keeps its keyed objects alive, so their ids are not reused
            step = steps[key] = cls(batch, width, group, refiner, refines, forced, stops)
        return step

    def __init__(self, batch, width: int, group, refiner, refines, forced, stops: torch.Tensor):
        self.batch, self.width, self.group = batch, width, group
        self.refiner, self.refines, self.forced, self.stops = refiner, refines, forced, stops
        self.spec_arm = group is not None
        device = batch.pos.device
        self.offsets = torch.arange(width, device=device)
        self.idle = torch.tensor([0, width], dtype=torch.long, device=device)

    def key(self, length: int) -> tuple:
        """The graph key at this KV-length bucket."""
        return ("batch", self.batch.rows, id(self), length)

    def layout(self) -> tuple:
        """The addresses of the reallocatable buffers the step reads (a change drops the graphs that read them)."""
        bt, g = self.batch, self.group
        return (bt.out.data_ptr(), bt.kv.k.data_ptr(), getattr(getattr(g, "kv", None), "k", bt.kv.k).data_ptr())

    def live(self) -> list:
        """The state a step changes that a warmup run must restore (the commit and the group's context)."""
        return [self.batch.pos] + ([self.group.ctx] if hasattr(self.group, "ctx") else [])

    def _drafts(self, anchors: torch.Tensor, length: int):
        """Every row's (drafts [B, W-1], q [B, W-1, V], hidden [B, W, H]) from the group's prefetch."""
        g = self.group
        g.prefetch(anchors, self.batch.pos, length)
        if hasattr(g, "proposals"):
            return g.proposals()
        ps = [m.propose(anchors[b], self.batch.pos[b], length) for b, m in enumerate(g.members)]
        return (torch.stack([p.tokens for p in ps]), torch.stack([p.logits for p in ps]),
                torch.stack([p.hidden for p in ps]))

    def _refine_all(self, drafts, q, hidden, anchors, prev) -> torch.Tensor:
        """Every row's refined drafts: one BatchRefiner call, else the refiner's own refine() row by row."""
        if isinstance(self.refiner, IdentityRefiner):
            return drafts
        if self.refines is not None:
            return self.refines.refine_stacked(drafts, q, hidden, anchors, prev)[0]
        return torch.stack([self.refiner.refine(Proposal(drafts[b], q[b], hidden[b]),
                                                RefineContext(anchor=anchors[b], prev_token=prev[b])).tokens
                            for b in range(drafts.shape[0])])

    def run(self, length: int) -> torch.Tensor:
        """The device work of one greedy step for every row at once; returns the packed [B, 2] (accepted, first
        stop) the host reads, a finished row's being (0, width)."""
        bt, w = self.batch, self.width
        out, pos, live, spec = bt.out, bt.pos, bt.live, bt.spec
        anchors = out.gather(1, pos.view(-1, 1)).view(-1)
        if self.spec_arm:
            drafts, q, hidden = self._drafts(anchors, length)
            prev = out.gather(1, (pos - 1).view(-1, 1)).view(-1)
            drafts = self._refine_all(drafts, q, hidden, anchors, prev)
            blocks = torch.cat((anchors.view(-1, 1), drafts), 1)
        else:
            drafts, blocks = anchors.new_zeros((anchors.shape[0], 0)), anchors.view(-1, 1)
        logits, feats = bt.verify(blocks, length, want_features=self.spec_arm)
        choice = logits.argmax(-1)  # [B, W]: the target's greedy token after each block row
        if self.forced is not None:
            n = torch.full_like(pos, self.forced)
        else:  # the run of drafts equal to the target's choices (verify.leading_run, per row)
            n = (drafts == choice[:, :-1]).long().cumprod(1).sum(1)
        n = torch.where(spec, n, 0)  # a plain target step (AR, or a row near the context limit): row 0 only
        nxt = choice.gather(1, n.view(-1, 1))
        idx = self.offsets
        emitted = torch.where(idx < n.view(-1, 1), torch.cat((drafts, nxt), 1), nxt)
        out.scatter_(1, pos.view(-1, 1) + 1 + idx, emitted)
        width = 1 + (w - 1) * spec.long()
        hits = (emitted.unsqueeze(-1) == self.stops).any(-1) & (idx <= n.view(-1, 1)) & (idx < width.view(-1, 1))
        first_stop = torch.where(hits.any(1), hits.long().argmax(1), width)
        step = torch.where(live, n + 1, 0)
        pos.add_(step)
        if self.spec_arm:
            self.group.observe(feats, torch.where(spec, step, 0))
        return torch.where(live.view(-1, 1), torch.stack((n, first_stop), 1), self.idle)
