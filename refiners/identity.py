"""Drafter-only (K = 0): the drafter's own seed is the draft."""
from __future__ import annotations

from drafters.base import Proposal
from refiners.base import RefineContext


class IdentityRefiner:
    name = "drafter-only"
    passes = 0

    def refine(self, proposal: Proposal, ctx: RefineContext) -> Proposal:
        return proposal
