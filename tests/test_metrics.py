"""Metric arithmetic on hand-made step logs with answers worked out by hand (REFERENCE.md appendix B.5)."""
import math

import numpy as np
import pytest

from harness.protocol import ci_text
from harness.protocol import metrics as m

# Sample A: 4 short steps; sample B: 1 long step. Pooling weighs A four times, per-sample weighs them equally.
LOG = [[1, 2, 1, 4], [8]]


def test_tau_pooled_and_per_sample_differ():
    assert m.tau_per_step(LOG) == pytest.approx(16 / 5)  # (1+2+1+4+8) / 5 steps
    assert m.tau_per_sample(LOG) == pytest.approx((2 + 8) / 2)  # A's mean is 8/4 = 2


def test_tau_skips_stepless_samples_and_is_nan_when_empty():
    assert m.tau_per_sample([[3, 5], []]) == pytest.approx(4)
    assert m.tau_per_step([[3, 5], []]) == pytest.approx(4)
    assert math.isnan(m.tau_per_step([])) and math.isnan(m.tau_per_step([[]]))
    assert math.isnan(m.tau_per_sample([[], []]))


def test_histogram():
    hist = m.acceptance_histogram(LOG, 8)
    assert len(hist) == 9
    assert hist == pytest.approx([0, 2 / 5, 1 / 5, 0, 1 / 5, 0, 0, 0, 1 / 5])
    assert sum(hist) == pytest.approx(1)
    assert m.acceptance_histogram([[1, 1]], 1) == [0.0, 1.0]  # AR: every step adds exactly one token
    with pytest.raises(ValueError, match="outside 0..4"):
        m.acceptance_histogram(LOG, 4)
    assert all(math.isnan(x) for x in m.acceptance_histogram([], 3))


def test_per_position_acceptance():
    rates = m.per_position_acceptance(LOG, 8)
    # k=0: lengths >= 2 are 2, 4, 8 -> 3/5; k=1,2: 4, 8 -> 2/5; k=3..6: only 8 -> 1/5
    assert rates == pytest.approx([3 / 5, 2 / 5, 2 / 5, 1 / 5, 1 / 5, 1 / 5, 1 / 5])
    assert m.per_position_acceptance(LOG, 1) == []


def test_tau_equals_one_plus_summed_per_position_rates():
    # An identity that ties the three acceptance metrics together: E[len] = 1 + sum_k P(len >= k+2).
    rng = np.random.default_rng(1)
    log = [rng.integers(1, 17, size=n).tolist() for n in (5, 9, 1)]
    assert m.tau_per_step(log) == pytest.approx(1 + sum(m.per_position_acceptance(log, 16)))


def test_pooled_tok_per_s_is_a_ratio_of_sums_over_samples_with_tokens():
    # the zero-token sample's 9 s are left out, as the reference's non-empty filter does
    assert m.pooled_tok_per_s([100, 10, 0], [1.0, 1.0, 9.0]) == pytest.approx(110 / 2)
    assert math.isnan(m.pooled_tok_per_s([], []))
    with pytest.raises(ValueError, match="paired"):
        m.pooled_tok_per_s([1, 2], [1.0])


def test_per_sample_tok_per_s_is_the_harmonic_convention():
    # s/token: 1/100 and 1/10 -> mean 0.055 -> 18.18 tok/s; the arithmetic mean of rates would be 55
    assert m.per_sample_tok_per_s([100, 10], [1.0, 1.0]) == pytest.approx(1 / 0.055)
    # a sample with no decode token has no rate: it is left out (the reference's max(1, n) would count 2 s/token)
    assert m.per_sample_tok_per_s([100, 0], [1.0, 2.0]) == pytest.approx(100.0)
    assert math.isnan(m.per_sample_tok_per_s([0], [2.0]))
    assert "1/mean(s/token)" in m.CONVENTIONS["per_sample_tok_per_s"]


def test_paired_ratio_stats():
    s = m.paired_ratio_stats([1.0, 1.2, 1.1, 1.5])
    assert (s.n, s.min, s.max) == (4, 1.0, 1.5)
    assert s.mean == pytest.approx(1.2)
    assert s.std == pytest.approx(math.sqrt((0.04 + 0 + 0.01 + 0.09) / 3))  # n-1 in the denominator
    assert s.median == pytest.approx(1.15)  # even count: mean of the middle two (1.1, 1.2)
    one = m.paired_ratio_stats([1.3])
    assert (one.mean, one.std, one.median) == (1.3, 0.0, 1.3)
    assert m.paired_ratio_stats([]).n == 0 and math.isnan(m.paired_ratio_stats([]).mean)


def test_bootstrap_ci_contains_the_mean_and_is_seeded():
    values = np.random.default_rng(7).normal(5.0, 1.0, size=40)
    lo, hi = m.bootstrap_ci(values)
    assert lo < values.mean() < hi
    assert (lo, hi) == m.bootstrap_ci(values)  # same seed, same interval
    assert m.bootstrap_ci(values, seed=1) != (lo, hi)
    narrow = m.bootstrap_ci(values, alpha=0.5)
    assert lo < narrow[0] < narrow[1] < hi
    assert m.bootstrap_ci([2.0, 2.0, 2.0]) == (2.0, 2.0)
    med_lo, med_hi = m.bootstrap_ci(values, stat=np.median)
    assert med_lo <= np.median(values) <= med_hi
    assert all(math.isnan(x) for x in m.bootstrap_ci([]))
    with pytest.raises(ValueError, match="alpha"):
        m.bootstrap_ci(values, alpha=1.5)


def test_speedup_ci_over_prompts_is_paired():
    rng = np.random.default_rng(3)
    ar = rng.uniform(0.01, 0.05, size=30)  # prompts differ a lot in s/token ...
    spec = ar / 2.5  # ... but spec is exactly 2.5x faster on each one
    assert m.paired_speedup(spec, ar) == pytest.approx(2.5)
    lo, hi = m.speedup_ci_over_prompts(spec, ar)
    # pairing cancels the prompt-to-prompt spread entirely; unpaired resampling could not give this
    assert lo == pytest.approx(2.5) and hi == pytest.approx(2.5)
    noisy = spec * rng.uniform(0.9, 1.1, size=30)
    lo, hi = m.speedup_ci_over_prompts(noisy, ar)
    assert lo < m.paired_speedup(noisy, ar) < hi
    assert (lo, hi) == m.speedup_ci_over_prompts(noisy, ar)
    with pytest.raises(ValueError, match="paired"):
        m.speedup_ci_over_prompts(spec[:3], ar)


def test_every_public_metric_states_a_one_line_convention():
    for name in ("tau_per_step", "tau_per_sample", "acceptance_histogram", "per_position_acceptance",
                 "pooled_tok_per_s", "per_sample_tok_per_s", "paired_ratio_stats", "bootstrap_ci",
                 "paired_speedup", "speedup_ci_over_prompts"):
        line = m.CONVENTIONS[name]
        assert line and "\n" not in line and getattr(m, name).convention == line


def test_round_stats_aggregates_like_paired_ratios():
    s = m.round_stats([100.0, 80.0])
    assert (s.n, s.mean, s.median) == (2, 90.0, 90.0) and s.std == pytest.approx(math.sqrt(200))
    assert "over the measured rounds" in m.CONVENTIONS["round_stats"]


def test_pooled_speedup_is_a_ratio_of_pooled_rates():
    # per prompt: (tokens, seconds) summed over rounds; spec 300 tok / 1.5 s = 200 tok/s, ref 300 tok / 6 s = 50
    spec_t, spec_s, ref_t, ref_s = [200, 100], [1.0, 0.5], [200, 100], [2.0, 4.0]
    assert m.pooled_speedup(spec_t, spec_s, ref_t, ref_s) == pytest.approx(4.0)
    # not the per-sample statistic: mean ref s/token (0.01, 0.04) / mean spec s/token (0.005, 0.005) = 5
    assert m.paired_speedup([0.005, 0.005], [0.01, 0.04]) == pytest.approx(5.0)
    # a prompt without decode tokens adds no seconds, as in pooled_tok_per_s
    assert m.pooled_speedup([200, 0], [1.0, 9.0], [200, 0], [2.0, 9.0]) == pytest.approx(2.0)
    assert math.isnan(m.pooled_speedup([], [], [], []))
    with pytest.raises(ValueError, match="paired"):
        m.pooled_speedup([1], [1.0], [1, 2], [1.0, 2.0])


def test_pooled_speedup_ci_over_prompts_is_paired():
    rng = np.random.default_rng(5)
    tokens = rng.integers(50, 2000, size=30)
    ref_s = tokens * rng.uniform(0.01, 0.05, size=30)  # prompts differ a lot in s/token ...
    lo, hi = m.pooled_speedup_ci_over_prompts(tokens, ref_s / 3.0, tokens, ref_s)  # ... spec 3x faster on each
    assert lo == pytest.approx(3.0) and hi == pytest.approx(3.0)
    noisy = ref_s / 3.0 * rng.uniform(0.8, 1.2, size=30)
    lo, hi = m.pooled_speedup_ci_over_prompts(tokens, noisy, tokens, ref_s)
    assert lo < m.pooled_speedup(tokens, noisy, tokens, ref_s) < hi
    assert (lo, hi) == m.pooled_speedup_ci_over_prompts(tokens, noisy, tokens, ref_s)
    assert all(math.isnan(x) for x in m.pooled_speedup_ci_over_prompts([], [], [], []))


def test_first_divergence_and_token_match_rate():
    assert m.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert m.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert m.first_divergence([1, 2], [1, 2, 3]) == 2  # a prefix that stops early diverges where it stops
    assert m.first_divergence([], []) is None
    # prefix-based: [1,9,3,4] matches 1 of 4, even though positions 2 and 3 agree again
    assert m.token_match_rate([([1, 2, 3, 4], [1, 2, 3, 4]), ([1, 9, 3, 4], [1, 2, 3, 4])]) == pytest.approx(5 / 8)
    assert m.token_match_rate([([1, 2], [1, 2, 3])]) == pytest.approx(2 / 3)
    assert math.isnan(m.token_match_rate([]))


def test_mean_latency_s():
    assert m.mean_latency_s([0.1, 0.3]) == pytest.approx(0.2)
    assert math.isnan(m.mean_latency_s([]))


def test_added_metrics_state_a_one_line_convention():
    for name in ("round_stats", "pooled_speedup", "pooled_speedup_ci_over_prompts", "first_divergence",
                 "token_match_rate", "mean_latency_s"):
        line = m.CONVENTIONS[name]
        assert line and "\n" not in line and getattr(m, name).convention == line


def test_tau_over_replicates_is_the_mean_of_each_replicates_pooled_tau():
    """Guards (issue 27): tau at T>0 averages per-seed taus, each pooled over its prompts, not one pool of all."""
    lengths = [[6, 2], [3, 3]]  # [replicate, prompt]: summed accept lengths
    steps = [[2, 2], [3, 1]]
    assert m.tau_over_replicates(lengths, steps) == pytest.approx((8 / 4 + 6 / 4) / 2)
    assert math.isnan(m.tau_over_replicates(np.zeros((0, 2)), np.zeros((0, 2))))


def test_paired_tau_ci_on_constructed_cases():
    """Guards (issue 27): tau differences get a paired bootstrap over prompts x seeds. An arm that accepts exactly
    one more token every step (ratio: twice the lengths) has diff 1 (ratio 2) in every draw, so a paired CI is that
    point; an unpaired one, resampling the arms apart, would spread over the prompt-to-prompt variation."""
    rng = np.random.default_rng(1)
    steps = rng.integers(5, 30, size=(5, 12)).astype(float)        # 5 seeds x 12 prompts
    ref = steps * rng.uniform(1.0, 3.0, size=steps.shape)          # very different prompts
    out = m.paired_tau_ci(ref + steps, steps, ref, steps, n_boot=300)
    assert out["diff"] == pytest.approx(1.0) and out["diff_ci95"] == pytest.approx([1.0, 1.0])
    out = m.paired_tau_ci(2 * ref, steps, ref, steps, n_boot=300)
    assert out["ratio"] == pytest.approx(2.0) and out["ratio_ci95"] == pytest.approx([2.0, 2.0])
    # a noisy gain: the CI brackets the point and has width; deterministic for a seed
    noisy = ref * rng.uniform(0.9, 1.3, size=ref.shape)
    out = m.paired_tau_ci(noisy, steps, ref, steps, n_boot=500, seed=3)
    lo, hi = out["ratio_ci95"]
    assert lo < out["ratio"] < hi and hi - lo > 0.01
    assert out == m.paired_tau_ci(noisy, steps, ref, steps, n_boot=500, seed=3)
    with pytest.raises(ValueError, match="one shape"):
        m.paired_tau_ci(ref[:2], steps, ref, steps)


def test_a_ci_from_one_paired_unit_is_not_a_zero_width_interval():
    """One prompt of one round: every bootstrap draw is the same value; the CI is NaN (null in summary.json) and
    prints as n/a with the reason, not as [x, x]."""
    one = [[10.0]], [[1.0]], [[10.0]], [[2.0]]
    assert all(math.isnan(x) for x in m.median_round_speedup_ci(*one))
    assert all(math.isnan(x) for x in m.pooled_speedup_ci_over_prompts([10], [1.0], [10], [2.0]))
    assert all(math.isnan(x) for x in m.speedup_ci_over_prompts([0.1], [0.2]))
    assert all(math.isnan(x) for x in m.paired_tau_ci([[4]], [[1]], [[2]], [[1]])["diff_ci95"])
    two = [[10.0, 10.0]], [[1.0, 1.5]], [[10.0, 10.0]], [[2.0, 2.5]]  # one round, two prompts: a real CI
    lo, hi = m.median_round_speedup_ci(*two)
    assert lo < hi
    assert ci_text.ci_bracket([lo, hi], 2) == f" [{lo:.2f}, {hi:.2f}; 2 units]"
    assert ci_text.ci_bracket([lo, hi], ci_text.FEW_CI_UNITS) == ci_text.ci_bracket([lo, hi], None) == f" [{lo:.2f}, {hi:.2f}]"
    assert ci_text.ci_bracket([10.08, 10.08], 1) == " [CI n/a: 1 unit]"  # an older summary's zero-width CI too
    assert ci_text.ci_bracket([float("nan")] * 2, None) == " [CI n/a]"


def test_a_ci_from_few_units_says_how_many_as_the_bootstrap_runs_narrow_there():
    """ci_text.FEW_CI_UNITS: a percentile bootstrap's 95% interval for a mean covers well under 95% from a few
    units, so ci_bracket names the count below FEW_CI_UNITS. A smaller rerun of its comment's check (500 normal
    samples a size, 500 resamples each, seeded, so the same numbers on every machine): coverage under 0.82 from 4
    units and over 0.88 from 16. Power: the binomial sd of a coverage over 500 samples is 0.018 at 0.79 and 0.011
    at 0.93, so 0.79 clears 0.82 by 1.7 sd and 0.93 clears 0.88 by 4.5 sd; a bootstrap that covered 95% at 4 units
    would fail the first by 13 sd of its own (0.0097)."""
    rng = np.random.default_rng(0)

    def coverage(n, trials=500):
        hit = 0
        for _ in range(trials):
            x = rng.normal(size=n)
            lo, hi = m.bootstrap_ci(x, n_boot=500, seed=int(rng.integers(1 << 30)))
            hit += lo <= 0 <= hi
        return hit / trials
    assert coverage(4) < 0.82 and coverage(ci_text.FEW_CI_UNITS) > 0.88
    assert ci_text.ci_bracket([0.9, 1.1], 4) == " [0.90, 1.10; 4 units]"
