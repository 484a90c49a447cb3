"""The protocols between the decode loop and the algorithms: what a drafter proposes (`Proposal`, `Drafter`), what
a refiner does to a proposal (`RefineContext`, `Refiner`), and the null refiner (`IdentityRefiner`, the
drafter-only arm). The loop drives any object that has these methods; algorithms live in drafters/ and refiners/.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch


@dataclass(frozen=True)
class Proposal:
    """One block's draft. Shapes are fixed per run: tokens [B-1], logits [B-1, V], hidden [B, H].

    `logits` is the distribution the tokens were drawn from (q); `drafted` keeps the drafter's own tokens when a
    refiner replaces them, for traces and for drafter-only comparisons (None: the tokens are the drafter's).
    """
    tokens: torch.Tensor
    logits: torch.Tensor
    hidden: torch.Tensor
    drafted: torch.Tensor | None = None

    def with_tokens(self, tokens: torch.Tensor, logits: torch.Tensor) -> "Proposal":
        return replace(self, tokens=tokens, logits=logits,
                       drafted=self.tokens if self.drafted is None else self.drafted)


class Drafter(Protocol):
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int

    def ensure_capacity(self, n: int) -> None: ...

    def begin(self, features: torch.Tensor) -> None:
        """Context features of the whole prompt [P, F] (positions 0..P-1)."""

    def observe(self, features: torch.Tensor, count: torch.Tensor) -> None:
        """Features of one verify [W, F]; the first `count` rows (a device scalar) are committed context."""

    def propose(self, anchor: torch.Tensor, position: torch.Tensor, length: int) -> Proposal:
        """Draft the B-1 tokens after `anchor`, which sits at absolute `position` (both device scalars).

        `length` is a host-side upper bound (>= position + B) on the cache slots worth reading; it only trims work.
        """


@dataclass(frozen=True)
class RefineContext:
    anchor: torch.Tensor       # device scalar: the verified token at slot 0
    prev_token: torch.Tensor   # device scalar: the committed token before the anchor
    # Draft sampling at Td > 0 (harness.decode.sampling.DraftSampler, noise frozen for this block); None = greedy.
    # A refiner picks tokens with sampler.select(scores, ids, slot) and returns as logits the scores its final
    # tokens were picked from, so that q is honest.
    sampler: object | None = None


class Refiner(Protocol):
    """A fixed-shape map from a proposal to a proposal, with no host syncs and no per-step state.

    Contract at T > 0 (draft noise frozen per block, verified by rejection sampling against the returned logits):
    slot k's final scores, and so its token, may depend on the proposal, the context and the noise of slots 0..k,
    never on the noise of a later slot. Lossless verification needs it: the verifier treats slot k's token as drawn
    from q_k given the slots before it, which fails when q_k peeks at noise that later slots' draws still use.
    Every registered refiner is tested for it (tests/test_refiner_contract.py)."""
    name: str
    passes: int

    def refine(self, proposal: Proposal, ctx: RefineContext) -> Proposal: ...


class IdentityRefiner:
    """Drafter-only (K = 0): the drafter's own draft is the draft."""
    name = "drafter-only"
    passes = 0

    def refine(self, proposal: Proposal, ctx: RefineContext) -> Proposal:
        return proposal
