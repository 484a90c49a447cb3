"""What a refiner is: a fixed-shape map from a proposal to a proposal, with no host syncs and no per-step state."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from drafters.base import Proposal


@dataclass(frozen=True)
class RefineContext:
    anchor: torch.Tensor       # device scalar: the verified token at slot 0
    prev_token: torch.Tensor   # device scalar: the committed token before the anchor
    # Draft sampling at Td > 0 (harness.decode.sampling.DraftSampler, noise frozen for this block); None = greedy.
    # A refiner picks tokens with sampler.select(scores, ids, slot) and returns as logits the scores its final
    # tokens were picked from, so that q is honest.
    sampler: object | None = None


class Refiner(Protocol):
    name: str
    passes: int

    def refine(self, proposal: Proposal, ctx: RefineContext) -> Proposal: ...
