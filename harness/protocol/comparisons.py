"""Comparisons between the arms of one run: the paired speedup (the primary statistic with its own CI), the choice
of each method's throughput-optimal arm on held-out rounds, and token agreement with AR. Used by
harness.protocol.report.summarize."""
from __future__ import annotations

import dataclasses
import math

from harness.protocol import metrics


def stats_dict(s: metrics.RatioStats, values: list[float]) -> dict:
    return {**dataclasses.asdict(s), "values": list(values)}


def paired(arm: str, ref: str, by: dict[str, dict[int, dict]], rounds_used: dict[str, list[int]], n_boot: int,
            seed: int) -> dict | None:
    """The primary statistic (metrics.median_round_speedup) with its own paired bootstrap CI over prompts and
    rounds; the other statistics of the same per-round ratios, and the speedup pooled over rounds with its
    bootstrap over prompts, are kept beside it."""
    common = sorted(set(rounds_used[arm]) & set(rounds_used[ref]))
    if not common:
        return None
    prompts = sorted(set(by[arm][common[0]]) & set(by[ref][common[0]]))
    cols = [[[by[a][r][q][k] for q in prompts] for r in common] for a in (arm, ref)
            for k in ("decode_tokens", "decode_s")]
    ratios = metrics.round_speedups(*cols).tolist()
    pooled = [[sum(row) for row in zip(*c)] for c in cols]  # each prompt summed over the rounds
    return {"statistic": "median over rounds of the per-round paired speedup",
            "value": metrics.median_round_speedup(*cols),
            "ci95": list(metrics.median_round_speedup_ci(*cols, n_boot=n_boot, seed=seed)),
            **stats_dict(metrics.paired_ratio_stats(ratios), ratios), "ref": ref, "rounds_used": common,
            "ci_prompts": len(prompts),
            "pooled": {"value": metrics.pooled_speedup(*pooled),
                       "ci95": list(metrics.pooled_speedup_ci_over_prompts(*pooled, n_boot=n_boot, seed=seed))}}


def optimal(arms: dict, out_arms: dict, rows: list[dict], prompts: list[int]) -> dict:
    """Per method, the arm with the highest POOLED tok/s, SELECTED on rounds that are not reported (the warmup
    rounds, turn 0, complete ones only) and REPORTED from the measured rounds. Without a complete warmup round
    for every candidate the selection falls back to the measured rounds and says that it is biased upward."""
    warm = [r for r in rows if r["warmup"] and r["turn"] == 0]
    optimal = {}
    for method in dict.fromkeys(i["method"] for i in arms.values()):
        names = [a for a, i in arms.items() if i["method"] == method]
        held_out = {}
        for a in names:
            by_round: dict[int, list[dict]] = {}
            for r in warm:
                if r["arm"] == a and r["question_id"] in prompts:
                    by_round.setdefault(r["round"], []).append(r)
            full = [x for rs in by_round.values() if len(rs) == len(prompts) for x in rs]
            if full:
                held_out[a] = metrics.pooled_tok_per_s([x["decode_tokens"] for x in full],
                                                       [x["decode_s"] for x in full])
        measured = {a: out_arms[a]["pooled_tok_s"]["mean"] for a in names}
        usable = lambda d: {a: v for a, v in d.items() if v is not None and math.isfinite(v)}
        if len(names) > 1 and len(usable(held_out)) == len(names):
            pick, on = usable(held_out), "warmup rounds (held out: not reported)"
        else:
            pick = usable(measured)
            on = ("measured rounds (the reported ones: no held-out round, so the chosen arm's number is biased "
                  "upward)" if len(names) > 1 else "no choice: the only arm of its method")
        if pick:
            best = max(pick, key=pick.get)
            optimal[method] = {"arm": best, "K": arms[best]["K"], "pooled_tok_s": measured[best],
                               "selected_on": on, "selection_tok_s": pick[best]}
    return optimal


def token_match(rows: list[dict], arm: str, ar: str) -> dict | None:
    """Every (prompt, turn, round) both arms ran, warmup included: a correctness check, not a throughput number."""
    ref = {(r["question_id"], r["turn"], r["round"]): r.get("tokens") for r in rows if r["arm"] == ar}
    mine = {(r["question_id"], r["turn"], r["round"]): r.get("tokens") for r in rows if r["arm"] == arm}
    keys = sorted(k for k in mine.keys() & ref.keys() if mine[k] is not None and ref[k] is not None)
    if not keys:
        return None
    first: dict = {}
    for q, turn, rnd in keys:
        d = metrics.first_divergence(mine[q, turn, rnd], ref[q, turn, rnd])
        if turn == 0:
            old = first.get(q)
            first[q] = d if old is None else (old if d is None else min(old, d))
    identical = sum(metrics.first_divergence(mine[k], ref[k]) is None for k in keys)
    return {"ref": ar, "rows_compared": len(keys), "rows_identical": identical,
            "token_match_rate": metrics.token_match_rate([(mine[k], ref[k]) for k in keys]),
            "first_divergence": [{"question_id": q, "position": first[q]} for q in sorted(first)]}
