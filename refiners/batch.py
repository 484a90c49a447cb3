"""Batched refinement: the B live requests' proposals of one step refined in ONE call (issue 29).

`batch_refiner(refiner)` gives a BatchRefiner for a refiner that can be batched (xPress with K >= 1, Markov; both
on TorchOps), else None (the batch loop then refines each request alone, as at B=1). `BatchRefiner.refine`
stacks the requests' drafter logits [N, W-1, V], hidden rows [N, W, H], drafts [N, W-1], anchors [N] and the
tokens before them [N], and runs the refiner's OWN `refine` once over that leading dim through torch.func.vmap:
every kernel of every pass (hidden cache, shortlist, latent, mixer, MLP, w2 + base add + argmax) launches once
for all N rows, and no line of the head's math is restated here. Row b is handed back as its own refine() returns
it (`proposal.with_tokens(tokens, q)`). The heads themselves take one block ([W, H], a mean over dim 0, a
transposed mixer, per-slot 1-d Markov steps), which is why the leading dim is vmap's and not the head's.

Numbers: the matmuls see N x rows instead of rows, so a row's refined logits match its B=1 ones to fp32 rounding
(CPU BLAS picks kernels by row count: gemv for one row, gemm for several), not always bit for bit; the tokens are
the same unless a refined argmax sits on such a near-tie.

`BatchRefiner(refiner, ops=...)` batches a refiner whose own ops cannot be vmapped (TritonOps: vmap cannot look
inside a Triton launch) through a twin of it on `ops` over the same head (`twin` True): the harness gives it
core.ops.stacked's StackedTritonOps, the same kernels as vmappable custom ops: the latent launches once a pass (a
slot) for the whole batch instead of once per request, and so does the readout while the batch's rows fit one
launch (kernels.MAX_ROWS: 64; xPress reads out 15 rows a request at block 16, so four requests, the Markov
head one a request a slot; beyond, it runs on the torch ops). Which refiners take a twin is the harness's choice
(harness.protocol.algorithms.batch_refiner, which knows the backends); this module only runs it. The drafts alone,
never the target's output, depend on it (at T=0 the verify decides every token). The batch loop uses a twin from
B = 2 (harness.decode.batch_loop): one request keeps the refiner's own launches.

Not batched here (None): draft sampling (Td > 0: each request's frozen noise is its own sampler's), ops other
than TorchOps, wrapped refiners (compiled, captured, Spyre numerics), xPress K = 0 (its refine is the identity).

harness.decode.batch_loop calls it once per step after the drafter group's prefetch, for the requests that draft,
and each request's Stepper verifies and settles its own row.
"""
from __future__ import annotations

import copy

import torch
from torch.func import vmap

from core.ops.torch_impl import TorchOps
from core.protocols import Proposal, RefineContext
from refiners.markov import MarkovRefiner
from refiners.xpress import XPressRefiner


def batchable(refiner) -> bool:
    """A refiner whose refine() can run over a stack of requests (on TorchOps, or through a twin on vmappable
    ops)."""
    if type(refiner) not in (XPressRefiner, MarkovRefiner):
        return False
    return not (type(refiner) is XPressRefiner and refiner.passes == 0)


def batch_refiner(refiner) -> "BatchRefiner | None":
    """A BatchRefiner over `refiner` when it can refine a stack of requests at once on its own ops, else None."""
    if not batchable(refiner) or type(refiner.ops) is not TorchOps:
        return None
    return BatchRefiner(refiner)


class BatchRefiner:
    """One refiner's refine() over a stack of requests (see the module docstring). `refiner` is the run's refiner
    (the batch loop checks it is the one it batches); `inner` is what runs: the refiner itself, or with `ops` its
    twin on those ops over the same head (`twin`)."""

    def __init__(self, refiner, ops=None):
        if not batchable(refiner):
            raise TypeError(f"BatchRefiner: {type(refiner).__name__} cannot refine a stack of requests")
        self.refiner = refiner
        self.name, self.passes = refiner.name, refiner.passes
        self.twin, self.inner = ops is not None, refiner
        if ops is not None:  # a shallow copy: the same head and settings, its own ops
            self.inner = copy.copy(refiner)
            self.inner.ops = ops
        self._stacked = vmap(self._one)

    def _one(self, tokens, logits, hidden, anchor, prev):
        out = self.inner.refine(Proposal(tokens, logits, hidden), RefineContext(anchor=anchor, prev_token=prev))
        return out.tokens, out.logits

    @torch.no_grad()
    def refine_stacked(self, tokens, logits, hidden, anchors, prev_tokens) -> tuple[torch.Tensor, torch.Tensor]:
        """The same over stacked rows (drafts [N, W-1], q [N, W-1, V], hidden [N, W, H], anchors [N], tokens
        before them [N]): (refined drafts [N, W-1], their q [N, W-1, V])."""
        return self._stacked(tokens, logits, hidden, anchors.reshape(-1), prev_tokens.reshape(-1))

    @torch.no_grad()
    def refine(self, proposals: list[Proposal], anchors: torch.Tensor, prev_tokens: torch.Tensor) -> list[Proposal]:
        """Greedy: row b is refiner.refine(proposals[b], RefineContext(anchors[b], prev_tokens[b])); one call."""
        tokens, logits = self.refine_stacked(torch.stack([p.tokens for p in proposals]),
                                             torch.stack([p.logits for p in proposals]),
                                             torch.stack([p.hidden for p in proposals]), anchors, prev_tokens)
        return [p.with_tokens(tokens[b], logits[b]) for b, p in enumerate(proposals)]
