"""Why an arm wins or loses: its end-to-end speedup beside the decode-only one, and its measured step cost over AR's
step (the break-even tau). Used by harness.protocol.report.summarize; every number recomputes from the rows.

* decode-only speedup (`speedup`, the reference's number and the primary one): decode tokens over decode seconds;
* end-to-end speedup (`speedup_e2e`): the same paired statistic (median over measured rounds of the per-round
  ratio of pooled throughputs, with its bootstrap CI) of new tokens over TTFT + drafter prefill + decode seconds,
  from the same rows: what a user waiting for the whole answer sees;
* step cost (`step_s`): an arm's decode seconds over its decode steps (target forwards: one per entry of
  accept_lengths, plus tail_steps), summed over the rows of its measured rounds;
* break-even tau (`break_even_tau`): the arm's step_s over AR's. Since AR emits one token a step, the pooled
  decode speedup is exactly (decode tokens per step) / break-even: an arm wins iff its tau exceeds its break-even.
"""
from __future__ import annotations

import math

from harness.protocol import comparisons

E2E_NOTE = ("E2E Sp. = the Sp. statistic of new tokens over TTFT + drafter prefill + decode seconds (the whole "
            "answer), from the same rows")
BREAK_EVEN_NOTE = ("break-even tau = the arm's step cost (decode seconds / decode steps over its measured rows; "
                   "steps = accept_lengths entries + tail_steps) over AR's; the pooled decode speedup is exactly "
                   "(decode tokens per step) / break-even, so an arm wins iff its tau exceeds its break-even")


def steps(row: dict) -> int:
    """Target forwards of a row's decode phase: one per accept_lengths entry, plus the plain tail steps."""
    return len(row["accept_lengths"]) + int(row.get("tail_steps") or 0)


def step_cost(rows: list[dict]) -> dict:
    """{steps, step_s}: decode steps of the rows and their pooled seconds per step (None without a step)."""
    n = sum(steps(r) for r in rows)
    return {"steps": n, "step_s": sum(r["decode_s"] for r in rows) / n if n else None}


def _end_to_end(row: dict) -> dict:
    return {"decode_tokens": row["new_tokens"],
            "decode_s": row["ttft_s"] + float(row.get("drafter_prefill_s") or 0.0) + row["decode_s"]}


def add(out_arms: dict, by: dict, used: dict, ar: str | None, n_boot: int, seed: int) -> None:
    """Adds speedup_e2e, steps, step_s and break_even_tau to every arm of `out_arms` (None where undefined)."""
    e2e = {a: {rnd: {q: _end_to_end(r) for q, r in qs.items()} for rnd, qs in rounds.items()}
           for a, rounds in by.items()}
    cost = {a: step_cost([r for rnd in used[a] for r in by[a][rnd].values()]) for a in out_arms}
    ref_s = cost[ar]["step_s"] if ar in cost else None
    for a, s in out_arms.items():
        s["speedup_e2e"] = comparisons.paired(a, ar, e2e, used, n_boot, seed) if ar and a != ar else None
        s.update(cost[a])
        ok = ref_s and s["step_s"] is not None and math.isfinite(ref_s)
        s["break_even_tau"] = s["step_s"] / ref_s if ok else None
