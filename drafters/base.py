"""What the loop knows about a drafter: a fixed-shape proposal per step, and nothing about how it was made."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch


@dataclass(frozen=True)
class Proposal:
    """One block's draft. Shapes are fixed per run: tokens [B-1], logits [B-1, V], hidden [B, H].

    `logits` is the distribution the tokens were drawn from (q); `seed` keeps the drafter's own tokens when a
    refiner replaces them, for traces and for drafter-only comparisons.
    """
    tokens: torch.Tensor
    logits: torch.Tensor
    hidden: torch.Tensor
    seed: torch.Tensor | None = None

    def with_tokens(self, tokens: torch.Tensor, logits: torch.Tensor) -> "Proposal":
        return replace(self, tokens=tokens, logits=logits, seed=self.tokens if self.seed is None else self.seed)


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
