"""The top-p (nucleus) cut of a batch of distributions without sorting them: one program per row finds the row's
probability threshold by a search over float bit patterns, re-reading its row once a pass.

The reference (harness.decode.sampling.filtered_logits) sorts each row, a full segmented sort of [rows, vocab]
every decode step. At the responses engine's batch (1,024 rows of SmolLM2's 49,152) on one H200 a sampled run
took 11.7 ms a decode step with the sort, 7.6 ms with this cut as a bisection (31 passes), and greedy 5.2 ms (run
seconds over decode steps; results/perf/gpu_check_h200_quick/). A bisection pass re-reads every row (about 200 MB
at that batch), so the passes, not the sums, are the cost: each pass now probes PROBES thresholds at once (the
mass above each of them, from one read of the row), which narrows the interval (PROBES + 1)-fold a pass: 8 passes
at 16 probes against 30 halvings. The arithmetic grows PROBES-fold (a compare, a select and an add a probe and
token), so past some count the sums, not the reads, cost most: by arithmetic at the H200's datasheet rates, 8
probes (10 passes) is the cheapest, unmeasured. The default stays PROBES = 1, the measured algorithm (a bisection,
here 30 halvings where the measured kernel ran a 31st that changed nothing), until `harness/lab/gpu_check.sh quick`
times 1 to 32 probes on a GPU (built on the CPU, 2026-12-05).

Here a token is kept iff the probability mass strictly above its own is below top_p, f(p_i) = sum of p_j over
p_j > p_i, f(p_i) < top_p: the reference's rule with ties resolved together (the sort keeps an arbitrary part of
a tie that straddles the cut; this keeps all of it). f is non-increasing, so the kept set is {p_i >= t} for t =
the least float with f(t) < top_p, and t is found exactly by narrowing [lo, hi] over the bit patterns of
non-negative floats, which order as the floats do, from [-1, bits(1.0)] until hi = lo + 1. Every probe's mass
is summed in the same order, the terms of a higher probe a subset of a lower one's, so the computed f is
non-increasing across a pass's probes too, and the probes below top_p are a suffix of them.

Contract: p [rows, V] fp32 probabilities (each row sums to about 1), rows contiguous; 0 < top_p < 1 -> t [rows]
fp32; keep = p >= t[:, None]. A row whose mass is under top_p (fp32 rounding, top_p within an ulp of 1) gets
t = 0: every token kept. The sums run in fp32 in another order than the reference's cumsum: a token whose
f(p_i) is within rounding of top_p may fall on the other side (never the top token: f(max) = 0 < top_p).
"""
from __future__ import annotations

import torch

from core.kernels.common import triton, tl

PROBES = 1     # thresholds a pass tests (a power of two: one tl.arange); 1: the bisection, the measured default
START = 0x3F800000  # bits(1.0): no probability exceeds it, so f(1.0) = 0 < top_p


def passes(probes: int) -> int:
    """Passes that narrow [-1, bits(1.0)] to adjacent patterns: a pass leaves at most ceil(w / (probes + 1))."""
    w, n = START + 1, 0
    while w > 1:
        w, n = -(-w // (probes + 1)), n + 1
    return n


def block(probes: int) -> int:
    """Tokens a program reads at a time (4,096 for the bisection, as measured): [probes, block] partial sums stay
    within 16K values, 64 a thread at 8 warps."""
    return min(4096, 16384 // probes)


if triton is not None:
    @triton.jit
    def _threshold_kernel(p_ptr, t_ptr, V, s_p, top_p, PASSES: tl.constexpr, PROBES: tl.constexpr,
                          BLK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = p_ptr + row * s_p
        offs = tl.arange(0, BLK)
        steps = tl.arange(0, PROBES).to(tl.int64) + 1
        # invariant: f(lo) >= top_p (lo = -1: below every float, where f is the whole mass) and f(hi) < top_p
        lo = tl.full((), -1, tl.int64)
        hi = tl.full((), 0x3F800000, tl.int64)
        for _ in range(PASSES):
            probe = lo + (hi - lo) * steps // (PROBES + 1)  # increasing, in [lo, hi)
            x = probe.to(tl.int32).to(tl.float32, bitcast=True)
            acc = tl.zeros((PROBES, BLK), dtype=tl.float32)
            for k0 in range(0, V, BLK):
                v = tl.load(base + k0 + offs, mask=k0 + offs < V, other=0.0)
                acc += tl.where(v[None, :] > x[:, None], v[None, :], 0.0)
            # probe = -1 (only while lo = -1 and hi is small: a row whose whole mass is under top_p) is NaN's
            # pattern, whose sum is 0: it never counts as below, so such a row ends at hi = 0 and keeps every token,
            # as the reference does
            below = (tl.sum(acc, axis=1) < top_p) & (probe >= 0)
            hi = tl.min(tl.where(below, probe, hi), axis=0)   # the least probe below top_p, else hi
            lo = tl.max(tl.where(below, lo, probe), axis=0)   # the greatest probe at or over it, else lo
        tl.store(t_ptr + row, hi.to(tl.int32).to(tl.float32, bitcast=True))


def threshold(p: torch.Tensor, top_p: float, probes: int = PROBES) -> torch.Tensor:
    """t [rows] with keep = p >= t[:, None] (the module's contract); probes: thresholds a pass tests (1: bisection)."""
    if p.dim() != 2 or p.dtype != torch.float32 or p.stride(-1) != 1:
        raise ValueError(f"kernels.topp.threshold: p must be [rows, V] fp32 with contiguous rows, got "
                         f"{tuple(p.shape)} {p.dtype}")
    if not 0.0 < top_p < 1.0:
        raise ValueError(f"kernels.topp.threshold: top_p must be in (0, 1), got {top_p}")
    if probes < 1 or probes & (probes - 1) or probes > 32:
        raise ValueError(f"kernels.topp.threshold: probes must be a power of two from 1 to 32, got {probes}")
    t = torch.empty(p.shape[0], dtype=torch.float32, device=p.device)
    if p.shape[0]:
        _threshold_kernel[(p.shape[0],)](p, t, p.shape[1], p.stride(0), float(top_p), PASSES=passes(probes),
                                         PROBES=probes, BLK=block(probes), num_warps=8)
    return t
