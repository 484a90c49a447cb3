"""Lossless sampling through the whole loop, observed row by row: every emitted token, grouped by the verify row
that emitted it, follows the target's conditional distribution given the tokens before it. This reaches what the
first-three-tokens test of test_sampling.py cannot: the bonus row, rows >= 2, the second block after a rollback
(cache and drafter rewound), Td != T, T > 0 with Td = 0 (exact match), and xPress's top-C shortlist at T > 0.

Groups: ("block 1", row r) for each row of the first step, and ("after rollback", any row) for every token of a
step that follows a step with a rejection. Expected counts sum each token's exact conditional probabilities,
computed by one batched forward of the HF model over all samples (tests/stats.py: a valid, slightly conservative
chi-square). POWER (tests/stats.py): a group with n samples detects a TV distortion d with noncentrality
>= 4 n d^2; the groups every case requires (block-1 row 0 with n = N = 400, the after-rollback group with
n >= MIN_ROLLBACK = 300) give lambda >= 48 against a 20% distortion: power >= 0.985 at ALPHA = 1e-4, 5 degrees of
freedom (scipy.stats.ncx2.sf(25.74, 5, 48) = 0.986); against 10% only 0.13, which is why the 10% single-row
bound (>= 0.998) is tested on `rejection` and `exact_match` themselves in test_verify.py, where 5000 verifies
cost what a few hundred generations cost here (about 15 ms each on an idle core).
"""
import dataclasses

import pytest
import torch

from harness.decode.loop import DecodeSettings, generate
from harness.decode.sampling import probabilities
from refiners.xpress import XPressRefiner, random_xpress_head
from stats import ALPHA, pearson_pvalue
from test_sampling import B, PROMPT, V, model, refiner_for  # noqa: F401  (model is a fixture)
from tiny import CPU32

# tiny shapes: one intra-op thread (conftest.one_thread), as the other tiny-model modules run
pytestmark = pytest.mark.usefixtures("one_thread")


# 6 new tokens: the first, then at least two steps of block 4 (the first emits at most 4), the second after a
# rollback unless the first accepted every draft. 9 before, which held two whole blocks; block 1's rows are the same
# draws at 6 (never clipped: 1 + 4 <= 6) and the after-rollback group still holds 785 to 1504 tokens a case (1512
# to 2694 at 9), over MIN_ROLLBACK; a draw costs about 30% less (3.75 steps for xPress K=4, 5.77 at 9).
N, NEW = 400, 6
MIN_ROLLBACK = 300


def emitted_groups(g):
    """(group, position in g.tokens) for every token after the prefill's."""
    out, pos, rolled = [], 1, False
    for j, n in enumerate(g.accept_lengths):
        for r in range(n):
            out.append((("block 1", r) if j == 0 else ("after rollback", 0) if rolled else ("later", 0), pos + r))
        rolled = g.accepted[j] < B - 1
        pos += n
    return out


def check(t, samples, params):
    seqs = torch.tensor([PROMPT + g.tokens for g in samples])
    with torch.no_grad():
        probs = probabilities(t.model(seqs).logits, params)        # [N, P + L, V]
    obs, exp = {}, {}
    for i, g in enumerate(samples):
        for group, k in emitted_groups(g):
            row = probs[i, len(PROMPT) - 1 + k]
            obs.setdefault(group, torch.zeros(V))[g.tokens[k]] += 1
            exp[group] = exp.get(group, torch.zeros(V, dtype=torch.float64)) + row.double()
    for group in sorted(obs, key=lambda x: x[0] != "after rollback"):
        if obs[group].sum() >= 50:
            pv = pearson_pvalue(obs[group], exp[group])
            assert pv > ALPHA, f"{group}: p = {pv:.2e} over {int(obs[group].sum())} tokens"
    return {grp: int(o.sum()) for grp, o in obs.items()}


def draws(t, drafter, refiner, settings, seed):
    return [generate(t, PROMPT, settings, CPU32, drafter=drafter, refiner=refiner,
                     generator=CPU32.generator(seed * 100003 + i)) for i in range(N)]


CASES = {
    "xpress4 T=1": ("xpress4", dict(temperature=1.0)),
    "Td != T": ("drafter-only", dict(temperature=0.8, draft_temperature=1.3)),
    "T>0, Td=0": ("markov", dict(temperature=1.0, draft_temperature=0.0)),
    "top-C T=1": ("topc", dict(temperature=1.0)),
}
_CACHE: dict = {}


def case_samples(model, case):
    if case not in _CACHE:
        t, drafter = model
        method, kw = CASES[case]
        refiner = (XPressRefiner(random_xpress_head(V, 32, 4, B, seed=5, std=0.6, mix_std=0.5), passes=2, topc=3)
                   if method == "topc" else refiner_for(method))
        settings = DecodeSettings(NEW, 64, (), **kw)
        _CACHE[case] = settings, draws(t, drafter, refiner, settings, seed=11)
    return _CACHE[case]


@pytest.mark.parametrize("case", list(CASES))
def test_every_row_follows_the_target(model, case):
    settings, samples = case_samples(model, case)
    counts = check(model[0], samples, settings.target_params)
    assert counts[("block 1", 0)] == N and counts[("after rollback", 0)] >= MIN_ROLLBACK, counts


def test_the_row_check_catches_a_distorted_second_block(model):
    """The same samples with each token after a rollback replaced by token 0 with probability 0.4: a TV distortion
    of 0.4 (1 - p(0)), about 0.3 here, of that group only. The after-rollback group fails."""
    settings, samples = case_samples(model, "xpress4 T=1")
    g = torch.Generator().manual_seed(0)
    wrong = []
    for s in samples:
        tokens = list(s.tokens)
        for group, k in emitted_groups(s):
            if group[0] == "after rollback" and float(torch.rand((), generator=g)) < 0.4:
                tokens[k] = 0
        wrong.append(dataclasses.replace(s, tokens=tokens))
    with pytest.raises(AssertionError, match="after rollback"):
        check(model[0], wrong, settings.target_params)
