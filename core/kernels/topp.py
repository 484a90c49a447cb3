"""The top-p (nucleus) cut of a batch of distributions without sorting them: one program per row finds the row's
probability threshold by bisection, re-reading its row each pass (from L2 while the rows in flight fit in it; at
1,024 rows of 49,152 they may not, and 31 passes from HBM would be about 6 GB a step: unmeasured, and what
`gpu_check.sh quick` measures against the sort).

The reference (harness.decode.sampling.filtered_logits) sorts each row, a full segmented sort of [rows, vocab]
every decode step. At the responses engine's batch (1,024 rows of SmolLM2's 49,152) a sampled run took 12.9 ms a
decode step on an H100 against 5.4 ms for a greedy one on the H200 (run seconds over decode steps, prefills
included; results/perf/gpu_check_h100_quick/: two cards, so the sort's share is not measured apart;
`gpu_check.sh quick` measures both cuts on one).

Here a token is kept iff the probability mass strictly above its own is below top_p, f(p_i) = sum of p_j over
p_j > p_i, f(p_i) < top_p: the reference's rule with ties resolved together (the sort keeps an arbitrary part of
a tie that straddles the cut; this keeps all of it). f is non-increasing, so the kept set is {p_i >= t} for t =
the least float with f(t) < top_p, and t is found exactly by bisection over the bit patterns of non-negative
floats, which order as the floats do: 31 halvings of [0, 1.0]'s bits, each a pass over the row summing the mass
above the midpoint.

Contract: p [rows, V] fp32 probabilities (each row sums to about 1), rows contiguous; 0 < top_p < 1 -> t [rows]
fp32; keep = p >= t[:, None]. A row whose mass is under top_p (fp32 rounding, top_p within an ulp of 1) gets
t = 0: every token kept. The sums run in fp32 in another order than the reference's cumsum: a token whose
f(p_i) is within rounding of top_p may fall on the other side (never the top token: f(max) = 0 < top_p).
"""
from __future__ import annotations

import torch

from core.kernels.common import triton, tl

HALVINGS = 31  # [0, bits(1.0)] is under 2**30 patterns wide: 31 halvings leave adjacent patterns
BLOCK = 4096   # tokens a program sums at a time (a row of 49,152 is 12 tiles)


if triton is not None:
    @triton.jit
    def _threshold_kernel(p_ptr, t_ptr, V, s_p, top_p, HALVE: tl.constexpr, BLK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = p_ptr + row * s_p
        offs = tl.arange(0, BLK)
        # invariant: f(lo) >= top_p (lo = -1: below every float, where f is the whole mass) and f(hi) < top_p
        # (hi: 1.0's pattern; no probability exceeds it, so f(1.0) = 0)
        lo = tl.full((), -1, tl.int32)
        hi = tl.full((), 0x3F800000, tl.int32)
        for _ in range(HALVE):
            mid = lo + (hi - lo) // 2
            x = mid.to(tl.float32, bitcast=True)
            acc = tl.zeros((BLK,), dtype=tl.float32)
            for k0 in range(0, V, BLK):
                v = tl.load(base + k0 + offs, mask=k0 + offs < V, other=0.0)
                acc += tl.where(v > x, v, 0.0)
            # mid = -1 (only once hi = 0, lo = -1: a row whose whole mass is under top_p) is NaN's pattern: it never
            # moves hi, so such a row keeps every token, as the reference does
            below = (tl.sum(acc, axis=0) < top_p) & (mid >= 0)
            # once hi = lo + 1 >= 1, mid = lo, whose f >= top_p: lo stays, so the extra halvings change nothing
            hi = tl.where(below, mid, hi)
            lo = tl.where(below, lo, mid)
        tl.store(t_ptr + row, hi.to(tl.float32, bitcast=True))


def threshold(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """t [rows] with keep = p >= t[:, None] (the module's contract)."""
    if p.dim() != 2 or p.dtype != torch.float32 or p.stride(-1) != 1:
        raise ValueError(f"kernels.topp.threshold: p must be [rows, V] fp32 with contiguous rows, got "
                         f"{tuple(p.shape)} {p.dtype}")
    if not 0.0 < top_p < 1.0:
        raise ValueError(f"kernels.topp.threshold: top_p must be in (0, 1), got {top_p}")
    t = torch.empty(p.shape[0], dtype=torch.float32, device=p.device)
    if p.shape[0]:
        _threshold_kernel[(p.shape[0],)](p, t, p.shape[1], p.stride(0), float(top_p), HALVE=HALVINGS, BLK=BLOCK,
                                         num_warps=8)
    return t
