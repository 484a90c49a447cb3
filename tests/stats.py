"""Goodness-of-fit helpers shared by the sampling tests, and the power they have.

POWER. Every test compares the counts of one verify row (or one emitted position) with its target distribution
by Pearson's chi-square at ALPHA = 1e-4 over at most 6 categories. A bug that moves the row's distribution by
total variation TV has noncentrality lambda = n * sum(delta^2 / p) >= n * 4 * TV^2 (the minimum puts +TV and -TV
on two halves of the mass), so with n >= MIN_ROW = 1500 samples of the row a 10% TV distortion gives
lambda >= 60 and the test fails with probability >= 0.9986 (noncentral chi-square, 5 degrees of freedom,
critical value 25.7; scipy.stats.ncx2.sf(25.74, 5, 60) = 0.9986; 0.9992 for 4 degrees of freedom). Each test
asserts that every row it checks had at least MIN_ROW samples, so the power holds for the data it saw.
"""
from __future__ import annotations

import torch

ALPHA = 1e-4
MIN_ROW = 1500


def pearson_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square p-value of counts `observed` [V] against expected counts [V] (same total). Cells with
    expected count < 5 are pooled into one. The expected counts may be sums of per-sample probabilities (a
    conditional test): the statistic is then stochastically at most chi-square, so the test stays valid."""
    observed, expected = observed.double(), expected.double()
    small = expected < 5
    obs = torch.cat((observed[~small], observed[small].sum().view(1)))
    exp = torch.cat((expected[~small], expected[small].sum().view(1)))
    keep = exp > 0
    if (observed[expected == 0] > 0).any():
        return 0.0  # a sample where the distribution has no mass
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    if dof < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))
