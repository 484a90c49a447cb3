"""Comparisons between the arms of one run: the paired speedup (the primary statistic with its own CI), the choice
of each method's throughput-optimal arm on held-out rounds, and token agreement with AR. Used by
harness.protocol.report.summarize."""
from __future__ import annotations

import dataclasses
import math

from harness.protocol import divergence, metrics


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


BASE_DRAFTER_ARM = "drafter-only"  # --cotrained-drafter-only adds "drafter-only (<refiner>'s drafter)" beside it


def method_arms(arms: dict, method: str) -> list[str]:
    """The arms that may stand for a method (the gains' reference in report, the throughput-optimal choice here):
    all of its arms, but for drafter-only the base drafter's arm alone when it ran: a refiner checkpoint's
    co-trained drafter alone (--cotrained-drafter-only) is reported, never the reference or the choice."""
    names = [a for a, i in arms.items() if i["method"] == method]
    return [BASE_DRAFTER_ARM] if method == "drafter-only" and BASE_DRAFTER_ARM in names else names


def optimal(arms: dict, out_arms: dict, rows: list[dict], prompts: list[int]) -> dict:
    """Per method, the arm with the highest POOLED tok/s, SELECTED on rounds that are not reported (the warmup
    rounds, turn 0, complete ones only) and REPORTED from the measured rounds. Without a complete warmup round
    for every candidate the selection falls back to the measured rounds and says that it is biased upward."""
    warm = [r for r in rows if r["warmup"] and r["turn"] == 0]
    optimal = {}
    for method in dict.fromkeys(i["method"] for i in arms.values()):
        names = method_arms(arms, method)
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


def _gap(row: dict, position: int | None):
    gaps = row.get("top2_gaps")
    return gaps[position] if gaps is not None and position is not None and position < len(gaps) else None


def token_match(rows: list[dict], arm: str, ar: str) -> dict | None:
    """Every (prompt, turn, round) both arms ran, warmup included: a correctness check, not a throughput number.
    Each prompt's first divergence (turn 0, earliest over rounds) comes with the target's top-2 logit gap at that
    position in both runs of that round, where the rows recorded gaps (--record-logit-gaps)."""
    ref = {(r["question_id"], r["turn"], r["round"]): r for r in rows if r["arm"] == ar and r.get("tokens") is not None}
    mine = {(r["question_id"], r["turn"], r["round"]): r for r in rows if r["arm"] == arm and r.get("tokens") is not None}
    keys = sorted(mine.keys() & ref.keys())
    if not keys:
        return None
    div = {k: metrics.first_divergence(mine[k]["tokens"], ref[k]["tokens"]) for k in keys}
    first: dict = {}
    for q, turn, rnd in keys:
        d = div[q, turn, rnd]
        if turn == 0 and (q not in first or (d is not None and (first[q][0] is None or d < first[q][0]))):
            first[q] = (d, rnd)
    out = []
    for q in sorted(first):
        d, rnd = first[q]
        entry = {"question_id": q, "position": d}
        if d is not None:
            entry["round"] = rnd
            gaps = {"gap_arm": _gap(mine[q, 0, rnd], d), "gap_ref": _gap(ref[q, 0, rnd], d)}
            if any(v is not None for v in gaps.values()):
                entry.update(gaps)
            replayed = mine[q, 0, rnd].get("divergence")  # the untimed replay's record (harness.protocol.replays)
            if replayed and replayed.get("position") == d:
                entry.update({k: v for k, v in replayed.items() if k != "position"})
        out.append(entry)
    return {"ref": ar, "rows_compared": len(keys), "rows_identical": sum(div[k] is None for k in keys),
            "token_match_rate": metrics.token_match_rate([(mine[k]["tokens"], ref[k]["tokens"]) for k in keys]),
            "first_divergence": out, "divergence": divergence.stats([e for e in out if e["position"] is not None])}


def reference_match(rows: list[dict], arm: str) -> dict | None:
    """The arm (AR) against its decode in --reference-dtype (each turn-0 row's "reference" record, written by the
    untimed reference pass): rows compared and identical, and the first divergence of each prompt (earliest
    round) with its gaps. None when no row of the arm has a reference record."""
    recs = sorted(((r["question_id"], r["round"]), r["reference"]) for r in rows
                  if r["arm"] == arm and r["turn"] == 0 and r.get("reference"))
    if not recs:
        return None
    first: dict = {}
    for (q, rnd), rec in recs:
        d = rec.get("position")
        if q not in first or (d is not None and (first[q].get("position") is None or d < first[q]["position"])):
            first[q] = {"question_id": q, "round": rnd, **rec}
    entries = [first[q] for q in sorted(first)]
    return {"dtype": recs[0][1].get("dtype_ref"), "same_run": all(r.get("same_run") for _, r in recs),
            "rows_compared": len(recs), "rows_identical": sum(r.get("position") is None for _, r in recs),
            "first_divergence": entries,
            "divergence": divergence.stats([e for e in entries if e.get("position") is not None])}
