"""harness.decode.verify: deterministic cases of `rejection` and `exact_match`, and the law of every verify row
(bonus included) under rejection sampling and exact matching, 5000 to 20000 verifies per case.
The power of the statistical tests is computed in tests/stats.py: >= 0.998 against a 10% TV distortion of any
single row."""
import pytest
import torch

from harness.decode import verify
from harness.decode.sampling import SamplingParams, probabilities, sample_from
from harness.decode.verify import exact_match, rejection
from stats import ALPHA, MIN_ROW, pearson_pvalue

NEG = float("-inf")
T1 = SamplingParams(1.0)


def one_hot_logits(ids, vocab=6):
    """Logits whose T=1 distribution is exactly one-hot at each row's id."""
    z = torch.full((len(ids), vocab), NEG)
    z[torch.arange(len(ids)), torch.tensor(ids)] = 0.0
    return z


def onehot_q(ids, vocab=6):
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def verdict(v):
    return int(v.n_accept), int(v.next_token)


# ----------------------------------------------------------------------------------------- deterministic cases

@pytest.mark.parametrize("drafts, expect", [
    ([1, 2, 3], (3, 4)),   # all accepted: the bonus comes from the LAST row
    ([5, 2, 3], (0, 1)),   # none: the correction is row 0's choice
    ([1, 2, 0], (2, 3)),   # partial: two accepted, the correction from row 2
])
def test_rejection_deterministic_cases(drafts, expect):
    p = one_hot_logits([1, 2, 3, 4])                 # the target wants 1, 2, 3 then bonus 4
    q = onehot_q(drafts)                              # deterministic drafts: q one-hot at each draft
    g = torch.Generator().manual_seed(0)
    for _ in range(20):                               # any randomness: always the same verdict
        assert verdict(rejection(torch.tensor(drafts), q, p, T1, g)) == expect


def test_rejection_rejects_a_draft_whose_q_is_zero():
    """q(d) = 0 says the draft could not have been drawn: reject it even where p(d) = 1 (p/q would be inf)."""
    p = one_hot_logits([2, 2, 2])
    q = torch.full((2, 6), 0.2)
    q[:, 2] = 0.0
    assert verdict(rejection(torch.tensor([2, 2]), q, p, T1, torch.Generator().manual_seed(0))) == (0, 2)


def test_rejection_falls_back_to_p_below_the_residual_floor():
    """Rejected (q(d) = 0) where p = q: the residual max(p - q, 0) has no mass, so the token comes from p. Without
    the fallback the draw from all-zero weights would return token 0."""
    p = one_hot_logits([3, 1])
    q = onehot_q([3])
    assert verify.RESIDUAL_FLOOR > 0
    assert verdict(rejection(torch.tensor([0]), q, p, T1, torch.Generator().manual_seed(0))) == (0, 3)


@pytest.mark.parametrize("drafts, expect", [([1, 2, 3], (3, 4)), ([0, 2, 3], (0, 1)), ([1, 2, 5], (2, 3))])
def test_exact_match_deterministic_cases(drafts, expect):
    logits = torch.tensor([[0.0, 9, 0, 0, 0, 0], [0, 0, 9, 0, 0, 0], [0, 0, 0, 9, 0, 0], [0, 0, 0, 0, 9, 0]])
    assert verdict(exact_match(torch.tensor(drafts), logits, SamplingParams(0.0), None)) == expect
    # T > 0 with one-hot target rows: the same verdicts (the sample is the only token with mass)
    hot = one_hot_logits([1, 2, 3, 4])
    assert verdict(exact_match(torch.tensor(drafts), hot, T1, torch.Generator().manual_seed(1))) == expect


# --------------------------------------------------------------------------------------------- every row's law

W, V, N = 5, 6, 5000


def rows_emitted(n, nxt, drafts):
    """Per verify row k: the tokens the step emitted at row k (a draft where n > k, the correction or bonus where
    n == k), over the verifies that reached row k."""
    out = []
    for k in range(W):
        reached = n >= k
        tok = torch.where(n[reached] > k, drafts[reached, k] if k < W - 1 else nxt[reached], nxt[reached])
        out.append(tok)
    return out


def check_rows(p_rows, n, nxt, drafts):
    for k, tok in enumerate(rows_emitted(n, nxt, drafts)):
        assert tok.numel() >= MIN_ROW, f"row {k}: {tok.numel()} samples, too few for the stated power"
        counts = torch.bincount(tok, minlength=V)
        pv = pearson_pvalue(counts, p_rows[k] * tok.numel())
        assert pv > ALPHA, f"row {k}{' (bonus)' if k == W - 1 else ''}: p = {pv:.2e}"


def scenario(seed, target_params, draft_params, closeness=0.8, scale=1.5):
    """Target logits [W, V] and draft logits [W-1, V] near them (acceptance high enough to reach the bonus)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(W, V, generator=g) * scale
    draft = closeness * logits[:-1] + (1 - closeness) * torch.randn(W - 1, V, generator=g) * 1.5
    return logits, draft, probabilities(logits, target_params), probabilities(draft, draft_params)


def run_verifies(fn, drafts, seed):
    """One verify per row of `drafts`. (torch.func.vmap would be faster, but under vmap torch 2.13 loses the
    residual in `rejection`: the corrections come out distributed as p, not as max(p - q, 0), so it cannot be
    used to test that function.)"""
    torch.manual_seed(seed)
    out = [fn(d) for d in drafts]
    return torch.stack([v.n_accept for v in out]), torch.stack([v.next_token for v in out])


@pytest.mark.parametrize("name, tp, dp", [
    ("T=1", SamplingParams(1.0), SamplingParams(1.0)),
    ("Td != T", SamplingParams(0.8), SamplingParams(1.2)),
    ("top-k", SamplingParams(1.0, top_k=4), SamplingParams(1.0, top_k=4)),
])
def test_rejection_rows_follow_the_target(name, tp, dp):
    """Drafts drawn from q; rows 0..W-2 (residuals at every row, >= 2 included) and the bonus row W-1 each emit
    exactly p's row distribution."""
    logits, draft, p, q = scenario(3, tp, dp)
    drafts = torch.multinomial(q, N, replacement=True, generator=torch.Generator().manual_seed(4)).T
    n, nxt = run_verifies(lambda d: rejection(d, q, logits, tp, None), drafts, seed=5)
    check_rows(p, n, nxt, drafts)


def test_exact_match_rows_follow_a_sampled_target():
    """T > 0 with deterministic drafts (Td = 0): each row, bonus included, still emits p's distribution."""
    tp = SamplingParams(1.0)
    logits, draft, p, _ = scenario(6, tp, tp, closeness=1.0, scale=3.0)  # peaked: argmax drafts often accepted
    drafts = draft.argmax(-1).expand(2 * N, W - 1)
    n, nxt = run_verifies(lambda d: exact_match(d, logits, tp, None), drafts, seed=7)
    check_rows(p, n, nxt, drafts)


def test_the_row_test_catches_a_bonus_from_the_wrong_row(monkeypatch):
    """The bug the issue names: the bonus drawn from row W-2 instead of W-1. The bonus row's test fails."""
    tp = SamplingParams(1.0)
    logits, draft, p, q = scenario(3, tp, tp)

    def wrong_bonus(d):
        v = rejection(d, q, logits, tp, None)
        bonus = sample_from(p[W - 2], None)  # the wrong row
        return verify.Verdict(v.n_accept, torch.where(v.n_accept == W - 1, bonus, v.next_token))

    drafts = torch.multinomial(q, N, replacement=True, generator=torch.Generator().manual_seed(4)).T
    n, nxt = run_verifies(wrong_bonus, drafts, seed=5)
    with pytest.raises(AssertionError, match="bonus"):
        check_rows(p, n, nxt, drafts)
