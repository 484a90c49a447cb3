"""Every reported metric, defined once, each with the one-line convention that reports print beside it.

Inputs are plain per-sample values (no torch): for each sample the list of per-step acceptance lengths
(one entry per verify step = accepted drafts + 1 correction/bonus token, so 1..B), its new-token count and its
decode seconds. Undefined values (no samples, no steps, zero time) are float('nan') rather than an exception,
so a report can still print every other column.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

# metric name -> the one-line convention a report prints with it; filled by @_metric so each lives next to its code
CONVENTIONS: dict[str, str] = {}

_NAN = float("nan")


def _metric(convention: str) -> Callable:
    def register(fn: Callable) -> Callable:
        CONVENTIONS[fn.__name__] = convention
        fn.convention = convention
        return fn
    return register


def _steps(lengths: Sequence[Sequence[int]]) -> np.ndarray:
    return np.fromiter((int(x) for sample in lengths for x in sample), dtype=np.int64)


def _check_block(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def _check_paired(a: Sequence, b: Sequence, what: str) -> None:
    if len(a) != len(b):
        raise ValueError(f"{what}: {len(a)} vs {len(b)} values; they must be paired per sample")


# ---------------------------------------------------------------------------------------------------- acceptance

@_metric("tau/step = mean of every verify step's length (accepted drafts + 1) pooled over all samples "
         "(the published tau)")
def tau_per_step(lengths: Sequence[Sequence[int]]) -> float:
    """Pooled mean over every step of every sample: long generations weigh more, as in the reference."""
    steps = _steps(lengths)
    return float(steps.mean()) if steps.size else _NAN


@_metric("tau/sample = mean over samples of each sample's mean step length (accepted drafts + 1)")
def tau_per_sample(lengths: Sequence[Sequence[int]]) -> float:
    """Mean of per-sample means; samples with no step are left out (their mean is undefined)."""
    means = [float(np.mean(sample)) for sample in lengths if len(sample)]
    return float(np.mean(means)) if means else _NAN


@_metric("histogram[b] = fraction of steps whose length (accepted drafts + 1) is exactly b, b = 0..B")
def acceptance_histogram(lengths: Sequence[Sequence[int]], block_size: int) -> list[float]:
    """B+1 fractions summing to 1 (b = 0 is kept for the reference's layout, though lengths start at 1)."""
    _check_block(block_size)
    steps = _steps(lengths)
    if not steps.size:
        return [_NAN] * (block_size + 1)
    if steps.min() < 0 or steps.max() > block_size:
        # a length outside 0..B means the loop's bookkeeping is wrong; silently dropping it would hide that
        raise ValueError(f"acceptance length outside 0..{block_size}: min {steps.min()}, max {steps.max()}")
    counts = np.bincount(steps, minlength=block_size + 1)
    return (counts / steps.size).tolist()


@_metric("accept_rate@k = fraction of steps that accepted draft k+1, i.e. length >= k+2, k = 0..B-2")
def per_position_acceptance(lengths: Sequence[Sequence[int]], block_size: int) -> list[float]:
    """B-1 non-increasing rates: acceptance is a prefix, so draft k+1 counts only if drafts 1..k were accepted."""
    _check_block(block_size)
    steps = _steps(lengths)
    if not steps.size:
        return [_NAN] * (block_size - 1)
    return [float(np.mean(steps >= k + 2)) for k in range(block_size - 1)]


# ---------------------------------------------------------------------------------------------------- throughput

@_metric("POOLED tok/s = sum of new tokens / sum of decode seconds over samples with tokens (pairs with tau/step)")
def pooled_tok_per_s(tokens: Sequence[int], seconds: Sequence[float]) -> float:
    """A ratio of sums: long generations weigh more, matching the pooling of tau/step."""
    _check_paired(tokens, seconds, "pooled_tok_per_s")
    kept = [(n, s) for n, s in zip(tokens, seconds) if n > 0]
    total_s = sum(s for _, s in kept)
    return sum(n for n, _ in kept) / total_s if total_s > 0 else _NAN


@_metric("per-sample tok/s = 1/mean(s/token): inverse of the mean per-sample seconds per token, a harmonic mean "
         "of rates (pairs with tau/sample); samples with no decode token are left out")
def per_sample_tok_per_s(tokens: Sequence[int], seconds: Sequence[float]) -> float:
    """1 / mean_i(seconds_i / tokens_i) over samples with tokens_i > 0 (the reference divides by max(1, n), which
    turns a sample with no decode token into a bogus rate).

    The reference's comments call it a mean of rates; it is the harmonic mean, which weighs slow samples more.
    """
    _check_paired(tokens, seconds, "per_sample_tok_per_s")
    per_tok = [s / n for n, s in zip(tokens, seconds) if n > 0]  # no decode token: no rate (the reference's s/1)
    if not per_tok:
        return _NAN
    mean_s_per_tok = float(np.mean(per_tok))
    return 1.0 / mean_s_per_tok if mean_s_per_tok > 0 else _NAN


# ------------------------------------------------------------------------------------------------ paired ratios

@dataclass(frozen=True)
class RatioStats:
    n: int
    mean: float
    std: float  # sample std (n-1); 0 for a single ratio, so one round still prints
    median: float
    min: float
    max: float


@_metric("paired ratio = method / reference within the same round; mean +- sample std (n-1) over rounds, "
         "median, min, max")
def paired_ratio_stats(ratios: Sequence[float]) -> RatioStats:
    """Aggregate per-round paired ratios the way the reference's fair table does."""
    r = np.asarray(ratios, dtype=np.float64)
    if not r.size:
        return RatioStats(0, _NAN, _NAN, _NAN, _NAN, _NAN)
    std = float(r.std(ddof=1)) if r.size > 1 else 0.0
    # np.median averages the two middle values for an even count, as the reference's statistics.median does
    return RatioStats(int(r.size), float(r.mean()), std, float(np.median(r)), float(r.min()), float(r.max()))


# -------------------------------------------------------------------------------------------- confidence intervals

MIN_CI_UNITS = 2  # one paired unit (a prompt of one round) draws one value: a zero-width "CI"; NaN from fewer


def _percentile_bootstrap(n: int, stat_of_idx: Callable[[np.ndarray], float], n_boot: int, alpha: float,
                          seed: int) -> tuple[float, float]:
    """Resample item indices with replacement; one index set serves paired arrays, keeping pairs intact."""
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    if n < MIN_CI_UNITS:
        return _NAN, _NAN
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, n, size=(n_boot, n))
    stats = np.array([stat_of_idx(idx) for idx in draws], dtype=np.float64)
    lo, hi = np.quantile(stats, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


@_metric("CI = percentile bootstrap over items (resampled with replacement), seeded, two-sided 1-alpha")
def bootstrap_ci(values: Sequence[float], stat: Callable = np.mean, n_boot: int = 2000, alpha: float = 0.05,
                 seed: int = 0) -> tuple[float, float]:
    """(lo, hi) percentile-bootstrap interval of stat(values); deterministic for a given seed."""
    v = np.asarray(values, dtype=np.float64)
    return _percentile_bootstrap(v.size, lambda idx: stat(v[idx]), n_boot, alpha, seed)


_SPEEDUP = ("speedup = mean AR s/token / mean spec s/token over the same prompts (= ratio of per-sample tok/s); "
            "CI resamples prompts, pairs kept")


@_metric(_SPEEDUP)
def paired_speedup(spec_seconds_per_tok: Sequence[float], ar_seconds_per_tok: Sequence[float]) -> float:
    """Point estimate matching speedup_ci_over_prompts: the reference's t1/tb."""
    _check_paired(spec_seconds_per_tok, ar_seconds_per_tok, "paired_speedup")
    if not len(spec_seconds_per_tok):
        return _NAN
    spec = float(np.mean(spec_seconds_per_tok))
    return float(np.mean(ar_seconds_per_tok)) / spec if spec > 0 else _NAN


@_metric(_SPEEDUP)
def speedup_ci_over_prompts(spec_seconds_per_tok: Sequence[float], ar_seconds_per_tok: Sequence[float],
                            n_boot: int = 2000, alpha: float = 0.05, seed: int = 0) -> tuple[float, float]:
    """(lo, hi) bootstrap interval of paired_speedup, resampling prompts with spec and AR kept paired by index.

    Pooling over prompts before dividing (a ratio of means, not a mean of per-prompt ratios) keeps it the same
    statistic as the point estimate, and resampling prompts captures prompt-to-prompt variation in both arms.
    """
    _check_paired(spec_seconds_per_tok, ar_seconds_per_tok, "speedup_ci_over_prompts")
    spec = np.asarray(spec_seconds_per_tok, dtype=np.float64)
    ar = np.asarray(ar_seconds_per_tok, dtype=np.float64)
    return _percentile_bootstrap(spec.size, lambda idx: ar[idx].mean() / spec[idx].mean(), n_boot, alpha, seed)



# ------------------------------------------------------------------------------------- additions for the reports

@_metric("over rounds = mean +- sample std (n-1) of the per-round value over the measured rounds, median, min, max")
def round_stats(values: Sequence[float]) -> RatioStats:
    """Spread of a per-round quantity (e.g. POOLED tok/s); the same aggregation as the paired ratios."""
    return paired_ratio_stats(values)


def _pooled_rate(tokens: np.ndarray, seconds: np.ndarray) -> float:
    # a prompt without decode tokens adds no time either, as pooled_tok_per_s leaves such samples out
    total_s = float(np.where(tokens > 0, seconds, 0.0).sum())
    return float(tokens.sum()) / total_s if total_s > 0 else _NAN


_POOLED_SPEEDUP = ("pooled speedup = (sum tokens / sum s of the method) / (same of the reference), each prompt's "
                   "decode tokens and seconds summed over the measured rounds; CI resamples prompts, pairs kept")


@_metric(_POOLED_SPEEDUP)
def pooled_speedup(spec_tokens: Sequence[int], spec_seconds: Sequence[float], ref_tokens: Sequence[int],
                   ref_seconds: Sequence[float]) -> float:
    """Ratio of POOLED rates over the same prompts: the point estimate pooled_speedup_ci_over_prompts brackets."""
    for a, b in ((spec_tokens, spec_seconds), (ref_tokens, ref_seconds), (spec_tokens, ref_tokens)):
        _check_paired(a, b, "pooled_speedup")
    if not len(spec_tokens):
        return _NAN
    spec = _pooled_rate(np.asarray(spec_tokens, np.float64), np.asarray(spec_seconds, np.float64))
    ref = _pooled_rate(np.asarray(ref_tokens, np.float64), np.asarray(ref_seconds, np.float64))
    return spec / ref if ref > 0 else _NAN


@_metric(_POOLED_SPEEDUP)
def pooled_speedup_ci_over_prompts(spec_tokens: Sequence[int], spec_seconds: Sequence[float],
                                   ref_tokens: Sequence[int], ref_seconds: Sequence[float], n_boot: int = 2000,
                                   alpha: float = 0.05, seed: int = 0) -> tuple[float, float]:
    """(lo, hi) bootstrap interval of pooled_speedup; one index set per draw keeps each prompt's four values paired.

    The POOLED analogue of speedup_ci_over_prompts: a prompt with a long generation weighs more, as in POOLED tok/s.
    """
    for a, b in ((spec_tokens, spec_seconds), (ref_tokens, ref_seconds), (spec_tokens, ref_tokens)):
        _check_paired(a, b, "pooled_speedup_ci_over_prompts")
    st, ss, rt, rs = (np.asarray(x, dtype=np.float64) for x in (spec_tokens, spec_seconds, ref_tokens, ref_seconds))

    def stat(idx: np.ndarray) -> float:
        ref = _pooled_rate(rt[idx], rs[idx])
        return _pooled_rate(st[idx], ss[idx]) / ref if ref > 0 else _NAN

    return _percentile_bootstrap(st.size, stat, n_boot, alpha, seed)


_PRIMARY = ("Sp. = median over measured rounds of the per-round paired speedup (the arm's POOLED tok/s over the "
            "round's prompts / AR's over the same prompts in the same round); CI = paired bootstrap that resamples "
            "prompts and rounds together (timing noise between rounds is inside the interval)")


def _round_rates(tokens: np.ndarray, seconds: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """POOLED tok/s per (draw, round) over prompts weighted by counts [D, Q]; tokens, seconds [R, Q]."""
    secs = np.where(tokens > 0, seconds, 0.0)  # a prompt with no decode token adds no time either
    tok, sec = counts @ tokens.T, counts @ secs.T
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(sec > 0, tok / np.where(sec > 0, sec, 1.0), np.nan)


def _matrices(*arrays) -> list[np.ndarray]:
    out = [np.asarray(a, dtype=np.float64) for a in arrays]
    if any(a.ndim != 2 or a.shape != out[0].shape for a in out):
        raise ValueError(f"round x prompt matrices of one shape expected, got {[a.shape for a in out]}")
    return out


def round_speedups(spec_tokens, spec_seconds, ref_tokens, ref_seconds) -> np.ndarray:
    """Per-round paired speedups from [rounds, prompts] matrices of decode tokens and seconds."""
    st, ss, rt, rs = _matrices(spec_tokens, spec_seconds, ref_tokens, ref_seconds)
    ones = np.ones((1, st.shape[1]))
    return (_round_rates(st, ss, ones) / _round_rates(rt, rs, ones))[0]


@_metric(_PRIMARY)
def median_round_speedup(spec_tokens, spec_seconds, ref_tokens, ref_seconds) -> float:
    """The primary speedup: one slow round moves a median of three or more rounds by at most one rank."""
    r = round_speedups(spec_tokens, spec_seconds, ref_tokens, ref_seconds)
    return float(np.median(r)) if r.size and np.isfinite(r).all() else _NAN


@_metric(_PRIMARY)
def median_round_speedup_ci(spec_tokens, spec_seconds, ref_tokens, ref_seconds, n_boot: int = 2000,
                            alpha: float = 0.05, seed: int = 0) -> tuple[float, float]:
    """(lo, hi) percentile bootstrap of median_round_speedup. Each draw resamples prompts (one index set for every
    round and both arms, so pairs are kept) and, independently, rounds (the same rounds for both arms); the
    statistic is recomputed on the draw. Vectorised: a draw is a [prompts] count vector and a [rounds] index."""
    st, ss, rt, rs = _matrices(spec_tokens, spec_seconds, ref_tokens, ref_seconds)
    if n_boot < 1 or not 0.0 < alpha < 1.0:
        raise ValueError(f"n_boot must be >= 1 and alpha in (0, 1), got {n_boot}, {alpha}")
    n_rounds, n_prompts = st.shape
    if st.size < MIN_CI_UNITS:
        return _NAN, _NAN
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, n_prompts, size=(n_boot, n_prompts))
    counts = np.zeros((n_boot, n_prompts))
    np.add.at(counts, (np.arange(n_boot)[:, None], picks), 1.0)
    ratio = _round_rates(st, ss, counts) / _round_rates(rt, rs, counts)          # [D, R]
    rounds = rng.integers(0, n_rounds, size=(n_boot, n_rounds))
    stats = np.median(np.take_along_axis(ratio, rounds, axis=1), axis=1)
    stats = stats[np.isfinite(stats)]
    if not stats.size:
        return _NAN, _NAN
    lo, hi = np.quantile(stats, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


@_metric("flagged round = a measured round whose AR POOLED tok/s is more than 10% from the median over rounds")
def off_median_rounds(values: Sequence[float], tolerance: float = 0.10) -> list[tuple[int, float]]:
    """(index, relative distance from the median) of every value more than `tolerance` from the median."""
    v = np.asarray(values, dtype=np.float64)
    if not v.size:
        return []
    med = float(np.median(v))
    off = np.abs(v / med - 1.0) if med > 0 else np.zeros_like(v)
    return [(int(i), float(off[i])) for i in np.flatnonzero(off > tolerance)]


@_metric("first divergence = index of the first generated token where a method's output differs from the "
         "reference's (a length difference counts at the shorter length); none when identical")
def first_divergence(tokens: Sequence[int], ref_tokens: Sequence[int]) -> int | None:
    for i, (a, b) in enumerate(zip(tokens, ref_tokens)):
        if a != b:
            return i
    return None if len(tokens) == len(ref_tokens) else min(len(tokens), len(ref_tokens))


@_metric("token match = sum over paired outputs of the common-prefix length / sum of the longer output's length "
         "(tokens after the first divergence never count as matching)")
def token_match_rate(pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> float:
    """Prefix-based: once two greedy outputs diverge, later positions line up only by accident."""
    matched = total = 0
    for tokens, ref in pairs:
        d = first_divergence(tokens, ref)
        matched += len(tokens) if d is None else d
        total += max(len(tokens), len(ref))
    return matched / total if total else _NAN


@_metric("latency = arithmetic mean of the per-sample seconds (TTFT: prefill and first token; drafter prefill: the "
         "drafter's pass over the prompt), outside decode time")
def mean_latency_s(seconds: Sequence[float]) -> float:
    return float(np.mean(seconds)) if len(seconds) else _NAN


# ----------------------------------------------------------------------------------------- tau over sampling seeds

def _replicate_taus(lengths: np.ndarray, steps: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """tau/step of each replicate [D, R]: the replicate's accepted lengths summed over prompts weighted by counts
    [D, Q], over its steps; lengths and steps are [R, Q] (per replicate and prompt: sum of lengths, step count)."""
    return _round_rates(lengths, steps, counts)


@_metric("tau over seeds = mean over sampling replicates (every round with all prompts, warmup included; each "
         "round its own seeded stream) of each replicate's tau/step pooled over its prompts")
def tau_over_replicates(lengths, steps) -> float:
    """From [replicates, prompts] matrices of summed accept lengths and step counts."""
    la, sa = _matrices(lengths, steps)
    if not la.size:
        return _NAN
    taus = _replicate_taus(la, sa, np.ones((1, la.shape[1])))[0]
    return float(taus.mean()) if np.isfinite(taus).all() else _NAN


@_metric("tau difference / ratio between two arms = tau over seeds of the arm minus (over) the reference's; CI = "
         "paired bootstrap that resamples prompts and seeds together (one draw serves both arms, pairs kept)")
def paired_tau_ci(spec_lengths, spec_steps, ref_lengths, ref_steps, n_boot: int = 2000, alpha: float = 0.05,
                  seed: int = 0) -> dict:
    """{diff, diff_ci95, ratio, ratio_ci95} of tau_over_replicates(spec) against tau_over_replicates(ref). Both
    arms' [replicates, prompts] matrices must line up (the same seeds and prompts). Each draw resamples prompts
    (one count vector for every replicate and both arms) and, independently, replicates (the same ones for both
    arms), as median_round_speedup_ci does for timing."""
    la, sa, lb, sb = _matrices(spec_lengths, spec_steps, ref_lengths, ref_steps)
    if n_boot < 1 or not 0.0 < alpha < 1.0:
        raise ValueError(f"n_boot must be >= 1 and alpha in (0, 1), got {n_boot}, {alpha}")
    a, b = tau_over_replicates(la, sa), tau_over_replicates(lb, sb)
    out = {"diff": a - b, "ratio": a / b if b > 0 else _NAN, "diff_ci95": [_NAN, _NAN], "ratio_ci95": [_NAN, _NAN]}
    if la.size < MIN_CI_UNITS:
        return out
    n_rep, n_prompts = la.shape
    rng = np.random.default_rng(seed)
    counts = np.zeros((n_boot, n_prompts))
    np.add.at(counts, (np.arange(n_boot)[:, None], rng.integers(0, n_prompts, size=(n_boot, n_prompts))), 1.0)
    reps = rng.integers(0, n_rep, size=(n_boot, n_rep))
    ta = np.take_along_axis(_replicate_taus(la, sa, counts), reps, axis=1).mean(axis=1)
    tb = np.take_along_axis(_replicate_taus(lb, sb, counts), reps, axis=1).mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        for key, draws in (("diff", ta - tb), ("ratio", ta / tb)):
            draws = draws[np.isfinite(draws)]
            if draws.size:
                out[f"{key}_ci95"] = [float(x) for x in np.quantile(draws, [alpha / 2, 1 - alpha / 2])]
    return out
