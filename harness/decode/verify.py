"""Verification: pure functions of (drafts, target logits, randomness) -> (accepted count, next token).

Both results stay on the device (the loop reads them in its single per-step sync), and the random numbers are
drawn up front from the per-(prompt, turn) generator, so nothing here waits on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.decode.sampling import SamplingParams, probabilities, sample_from, sample_rows

RESIDUAL_FLOOR = 1e-8  # below this residual mass, p and q agree to rounding: resample from p (the reference's rule)


@dataclass(frozen=True)
class Verdict:
    n_accept: torch.Tensor    # device scalar in 0..W-1
    next_token: torch.Tensor  # device scalar: correction on rejection, bonus when all drafts are accepted


def leading_run(ok: torch.Tensor) -> torch.Tensor:
    """Length of the run of True from the start (0-d long)."""
    return ok.long().cumprod(0).sum()


def exact_match(drafts: torch.Tensor, logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None) -> Verdict:
    """Accept drafts while they equal the target's own choice at each row (argmax, or a sample at T > 0).

    Greedy: standard greedy verification. T > 0 with deterministic drafts: each draft is accepted with
    probability p(draft), the same law as rejection sampling against a one-hot q, hence lossless.
    """
    posterior = sample_rows(logits, params, generator)
    n = leading_run(drafts == posterior[:-1])
    return Verdict(n, posterior.gather(0, n.view(1))[0])


def rejection(drafts: torch.Tensor, q: torch.Tensor, logits: torch.Tensor, params: SamplingParams,
              generator: torch.Generator | None) -> Verdict:
    """Speculative rejection sampling for drafts drawn from q [W-1, V] (probabilities).

    Draft j is accepted with probability min(1, p(d)/q(d)), and always rejected when q(d) = 0; at the first
    rejection the token is drawn from max(p - q, 0) renormalised, and when every draft is accepted the bonus is
    drawn from the last row of p. The output is an exact sample of the (filtered) target distribution.
    """
    p = probabilities(logits, params)                          # [W, V]
    w = p.shape[0]
    u = torch.rand(w - 1, generator=generator, device=p.device)
    pd = p[:-1].gather(1, drafts.view(-1, 1)).squeeze(1)
    qd = q.gather(1, drafts.view(-1, 1)).squeeze(1).float()
    ratio = torch.where(qd > 0, pd / qd.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(pd))
    n = leading_run(u < ratio)
    # A zero row after q makes "bonus from p" the same formula as "residual at the rejected row".
    q_rows = torch.cat((q.float(), torch.zeros_like(p[:1])))
    row = n.view(1, 1).expand(1, p.shape[1])
    residual = (p.gather(0, row) - q_rows.gather(0, row)).clamp(min=0)[0]
    p_row = p.gather(0, row)[0]
    weights = torch.where(residual.sum() > RESIDUAL_FLOOR, residual, p_row)
    return Verdict(n, sample_from(weights, generator))
