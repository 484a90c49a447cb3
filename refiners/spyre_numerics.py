"""xPress refinement with Spyre's numerics (--refine-numerics spyre), in plain torch, on any device.

The IBM Spyre integration cannot run xPress the way a GPU does: device argmax falls back to the host, FP16 topk
corrupts large ids, and integer gathers per pass are slow. So, per block (docs/SPYRE_GEMMA.md):
  1. the base logits come to the CPU once, as one direct conversion to float32, and the CPU takes each slot's
     top-C candidates, ordered by base score (ties: lowest id first); the seed draft is position 0 of every slot;
  2. the candidate table goes to the device once; the candidates' w2 readout rows and their projected input
     embeddings (w1 rows through in_proj's token half) are gathered there once per block: the per-block cache;
  3. each of the K passes scores the C candidates in FP16 and selects on the device, keeping the FIRST shortlist
     position among equal maxima; the selection feeds the next pass as a one-hot row times the cached candidate
     embeddings (a matmul: no integer gather on the device inside the passes);
  4. only the final shortlist positions (int32, 4 bytes a slot) return to the CPU, where the token ids are read
     from the candidate table.
Where the FP16 scores have no ties, the drafts equal the standard shortlist path's (rounding to FP16 is monotone,
so it can merge two scores but never swap them). Drafts are greedy; q is the base distribution (verification
of greedy drafts is an exact match, which never reads q).
"""
from __future__ import annotations

import torch

from core.protocols import Proposal, RefineContext
from refiners.xpress import XPressHead, check_geometry, validate_passes, validate_topc

SCORE_DTYPE = torch.float16
HOST = torch.device("cpu")


def candidate_order(base: torch.Tensor, c: int) -> torch.Tensor:
    """[n, V] host logits -> [n, C] ids: the C best by base score, descending, equal scores by lowest id first
    (the CPU top-k order that the first-position tie rule refers to)."""
    return torch.sort(-base, dim=-1, stable=True).indices[:, :c]


def first_best(scores: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest position whose score equals the row maximum (min over positions where score == max):
    [n, C] -> [n] int32, no argmax and no gather."""
    c = scores.shape[-1]
    order = torch.arange(c, device=scores.device, dtype=torch.int32)
    best = scores.amax(-1, keepdim=True)
    return torch.where(scores == best, order, torch.full_like(order, c)).amin(-1)


class _Block:
    """The per-block cache: hidden half of in_proj, candidate base scores (FP16), w2 rows and projected w1 rows."""

    def __init__(self, head: XPressHead, hidden: torch.Tensor, ids: torch.Tensor, base_c: torch.Tensor,
                 lead: torch.Tensor):
        dt = head.w2.weight.dtype
        self.head, self.base_c = head, base_c
        self.cache = head.block_cache(hidden.to(dt))                                       # [B, r]
        self.lead = head.token_input(lead)                                                 # [2, r]
        self.w2_c = head.w2.weight.index_select(0, ids.flatten()).view(*ids.shape, -1)     # [B-1, C, r]
        self.emb_c = head.token_input(ids[:-1].flatten()).view(*ids[:-1].shape, head.rank)
        self.order = torch.arange(ids.shape[-1], device=ids.device, dtype=torch.int32)

    def onehot(self, positions: torch.Tensor) -> torch.Tensor:
        return (positions.unsqueeze(-1) == self.order).to(self.emb_c.dtype)

    def scores(self, onehot: torch.Tensor) -> torch.Tensor:
        """FP16 refined scores [B-1, C] of the candidates, given the previous pass's one-hot selection."""
        fed = torch.bmm(onehot[:-1].unsqueeze(1), self.emb_c).squeeze(1)                   # [B-2, r]
        x = self.cache + torch.cat((self.lead, fed))
        y = self.head.mix(x)[1:]
        z = y + self.head.mlp(y)
        bias = torch.bmm(self.w2_c, z.unsqueeze(-1)).squeeze(-1)
        return (self.base_c.to(bias.dtype) + bias).to(SCORE_DTYPE)


class SpyreXPressRefiner:
    """K Jacobi passes of an xPress head over a top-C shortlist with Spyre's numerics (module docstring).
    `counters` holds the last block's logical transfer sizes in bytes and the device selection count."""
    name = "xpress"
    compile_helps = False

    def __init__(self, head: XPressHead, passes: int, topc: int, prev_anchor: bool = False, record: bool = False):
        if not topc:
            raise ValueError("Spyre numerics score a shortlist: top-C must be >= 1 (0 means full vocabulary)")
        self.head, self.passes, self.prev_anchor = head, validate_passes(passes), prev_anchor
        self.topc = validate_topc(topc, head.vocab)
        self.counters: dict[str, int] = {}
        self.record, self.pass_scores = record, []  # record=True (tests): each pass's FP16 scores, last block

    @torch.no_grad()
    def refine(self, proposal: Proposal, ctx: RefineContext) -> Proposal:
        if self.passes == 0:
            return proposal
        if ctx.sampler is not None:
            raise ValueError("Spyre numerics draft greedily; drop the draft temperature")
        check_geometry(self.head, proposal)
        dev = proposal.logits.device
        base = proposal.logits.to(HOST, torch.float32)               # one direct D2H conversion
        ids = candidate_order(base, self.topc)                        # CPU top-k, [B-1, C]
        lead = torch.stack((ctx.anchor if self.prev_anchor else ctx.prev_token, ctx.anchor)).reshape(2).long()
        blk = _Block(self.head, proposal.hidden, ids.to(dev, torch.int32), base.gather(-1, ids).to(dev, SCORE_DTYPE), lead)
        positions = torch.zeros(ids.shape[0], dtype=torch.int32, device=dev)  # the seed: each slot's best base
        self.pass_scores = []
        for _ in range(self.passes):
            scores = blk.scores(blk.onehot(positions))
            if self.record:
                self.pass_scores.append(scores)
            positions = first_best(scores)
        final = positions.to(HOST)                                    # the only D2H of the passes
        tokens = ids.gather(-1, final.long().unsqueeze(-1)).squeeze(-1).to(dev)
        self.counters = {"logits_d2h_bytes": base.numel() * 4, "positions_d2h_bytes": final.numel() * 4,
                         "candidates_h2d_bytes": ids.numel() * 4 + ids.numel() * 2,
                         "device_selections": self.passes}
        return proposal.with_tokens(tokens, proposal.logits)
