"""How a report prints a confidence interval (harness.protocol.metrics computes them): with the count of units it
resampled where that count is small, and as n/a where there is none."""
from __future__ import annotations

import math

from harness.protocol.metrics import MIN_CI_UNITS

# Below this many units a percentile bootstrap's 95% interval is too narrow, and a table says how many it had:
# over 2,000 normal samples of each size (1,000 resamples each), the interval held the mean 73% of the time from 3
# units, 79% from 4, 84% from 5, 89% from 8 and 10, 93% from 16 (tests/test_metrics.py recomputes it)
FEW_CI_UNITS = 16
FEW_CI_NOTE = (f"a CI printed as [lo, hi; n units] came from n < {FEW_CI_UNITS} resampled units (prompts x rounds, or "
               "a sweep's batches x rounds): a percentile bootstrap that small runs narrow, covering the true value "
               "less often than its nominal level (harness/protocol/ci_text.py gives the coverage measured)")


def ci_bracket(ci, units: int | None, fmt: str = ".2f") -> str:
    """' [lo, hi]' as every table prints a CI; ' [lo, hi; 4 units]' from fewer than FEW_CI_UNITS (a narrow one);
    ' [CI n/a: 1 unit]' from fewer than MIN_CI_UNITS resampled units (prompts x rounds, or a sweep's batches x
    rounds; None: not known, older summaries), ' [CI n/a]' without one."""
    if units is not None and units < MIN_CI_UNITS:
        return f" [CI n/a: {units} unit{'' if units == 1 else 's'}]"
    lo, hi = ci or (None, None)
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in (lo, hi)):
        return " [CI n/a]"
    few = f"; {units} units" if units is not None and units < FEW_CI_UNITS else ""
    return f" [{format(lo, fmt)}, {format(hi, fmt)}{few}]"


def verdict(ci) -> str:
    """What a paired ratio's 95% CI shows: "higher" (above 1), "lower" (below 1), "no difference shown", or "no CI"
    where there is none (too few units: NaN or None ends)."""
    lo, hi = ci or (None, None)
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in (lo, hi)):
        return "no CI"
    return "higher" if lo > 1 else "lower" if hi < 1 else "no difference shown"
