"""Verification: a pure function of (drafts, target logits, randomness) -> (accepted count, next token).

Both results stay on the device; the loop reads them in its single per-step sync.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.sampling import sample_rows


@dataclass(frozen=True)
class Verdict:
    n_accept: torch.Tensor    # device scalar in 0..W-1
    next_token: torch.Tensor  # device scalar: correction on rejection, bonus when all drafts are accepted


def leading_matches(drafts: torch.Tensor, posterior: torch.Tensor) -> torch.Tensor:
    """Length of the run of drafts[j] == posterior[j] from the start (0-d long)."""
    return (drafts == posterior[:-1]).long().cumprod(0).sum()


def exact_match(drafts: torch.Tensor, logits: torch.Tensor, temperature: float,
                generator: torch.Generator | None) -> Verdict:
    """Accept drafts while they equal the target's own choice at each row (argmax, or a sample at T > 0).

    Greedy: standard greedy verification. T > 0 with deterministic drafts: each draft is accepted with
    probability p(draft), the same law as rejection sampling against a one-hot q, hence lossless.
    """
    posterior = sample_rows(logits, temperature, generator)
    n = leading_matches(drafts, posterior)
    return Verdict(n, posterior.gather(0, n.view(1))[0])
