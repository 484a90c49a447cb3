"""Results of a paired run: the summary of the sample rows, plots, the results folder, and the multi-dataset table
over several results folders (the tables themselves are harness.protocol.tables, re-exported here).

    python -m harness.protocol.report results/gsm8k_T0 results/math500_T0 [--out table.md]

Every metric comes from harness.protocol.metrics and is printed with its convention line. Throughput uses turn 0 of the
measured (non-warmup) rounds only; ratios are paired within a round (harness.protocol.rounds).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from harness.protocol import metrics
from harness.errors import UsageError, cli_exit
from harness.protocol.plots import write_plots
from harness.protocol.rank_report import format_ranks
from harness.protocol.results_io import atomic_write
from harness.protocol.rounds import paired_ratios
from harness.protocol.tables import format_console_table, format_csv, format_markdown_table, format_multi_dataset_table

__all__ = ["summarize", "conventions", "write_results", "format_console_table", "format_markdown_table",
           "format_csv", "format_multi_dataset_table", "main"]

GREEDY_T = 1e-5  # below this temperature decoding is greedy, as the reference
SCHEMA = "xpress-bench/summary/1"
_METHOD_ORDER = {"ar": 0, "drafter-only": 1, "markov": 2, "xpress": 3}
_REPO = Path(__file__).resolve().parents[2]
_REQUIRED = ("dataset", "question_id", "turn", "round", "warmup", "arm", "method", "block_size", "temperature",
             "new_tokens", "decode_tokens", "ttft_s", "decode_s", "accept_lengths")


# ------------------------------------------------------------------------------------------------- sample rows

def _dedupe(rows: list[dict]) -> tuple[list[dict], int]:
    """A resumed run may repeat a (arm, prompt, turn, round); the last row written wins."""
    last = {(r["arm"], r["question_id"], r["turn"], r["round"]): r for r in rows}
    return list(last.values()), len(rows) - len(last)


def _one(rows: list[dict], key: str, what: str):
    values = {r.get(key) for r in rows}
    if len(values) > 1:
        raise UsageError(f"rows mix {what} {sorted(values, key=str)}; summarize one run (one {what}) at a time")
    return values.pop()


def _arms(rows: list[dict]) -> dict[str, dict]:
    info: dict[str, dict] = {}
    for r in rows:
        cur = {"method": r["method"], "K": r.get("K"), "block_size": int(r["block_size"])}
        if info.setdefault(r["arm"], cur) != cur:
            raise UsageError(f"arm {r['arm']!r} has rows with different method/K/block_size: {info[r['arm']]} vs "
                             f"{cur}; give each configuration its own display name")
    order = sorted(info, key=lambda a: (_METHOD_ORDER.get(info[a]["method"], 9), info[a]["K"] or 0, a))
    return {a: info[a] for a in order}


def _pick(arms: dict[str, dict], method: str, prefer: str) -> str | None:
    names = [a for a, i in arms.items() if i["method"] == method]
    return prefer if prefer in names else (names[0] if names else None)


def _round_metrics(rows: list[dict], block: int) -> dict:
    lengths = [r["accept_lengths"] for r in rows]
    tokens = [r["decode_tokens"] for r in rows]
    seconds = [r["decode_s"] for r in rows]
    return {"tau_per_step": metrics.tau_per_step(lengths), "tau_per_sample": metrics.tau_per_sample(lengths),
            "histogram": metrics.acceptance_histogram(lengths, block),
            "per_position": metrics.per_position_acceptance(lengths, block),
            "pooled": metrics.pooled_tok_per_s(tokens, seconds),
            "per_sample": metrics.per_sample_tok_per_s(tokens, seconds)}


def _stats(s: metrics.RatioStats, values: list[float]) -> dict:
    return {**dataclasses.asdict(s), "values": list(values)}


def _paired(arm: str, ref: str, ratios: dict[str, list[float]], by: dict[str, dict[int, dict]],
            rounds_used: dict[str, list[int]], n_boot: int, seed: int) -> dict:
    """Mean of per-round paired ratios, plus a bootstrap CI over prompts of the speedup pooled over rounds."""
    common = sorted(set(rounds_used[arm]) & set(rounds_used[ref]))
    prompts = sorted({q for r in common for q in by[arm][r]} & {q for r in common for q in by[ref][r]})
    sums = {a: {q: [0.0, 0.0] for q in prompts} for a in (arm, ref)}
    for a in (arm, ref):
        for r in common:
            for q, row in by[a][r].items():
                if q in sums[a]:
                    sums[a][q][0] += row["decode_tokens"]
                    sums[a][q][1] += row["decode_s"]
    cols = [[sums[a][q][i] for q in prompts] for a in (arm, ref) for i in (0, 1)]
    ci = metrics.pooled_speedup_ci_over_prompts(*cols, n_boot=n_boot, seed=seed)
    return {**_stats(metrics.paired_ratio_stats(ratios[arm]), ratios[arm]), "ref": ref,
            "ci95": list(ci), "ci_point": metrics.pooled_speedup(*cols), "ci_prompts": len(prompts)}


def summarize(rows: list[dict], n_boot: int = 2000, seed: int = 0, tau_from_warmup: bool = False) -> dict:
    """The run's summary, JSON-ready (undefined numbers are None).

    Top level: schema, dataset, temperature, greedy, block_size, rounds {all, warmup, measured}, prompts,
    reference_arm (AR), drafter_only_arm, incomplete_rounds [[arm, round, rows, prompts]], duplicate_rows_dropped,
    optimal {method: {arm, K, pooled_tok_s}}, conventions {name: line}, and arms {name: per-arm dict}: arm, method,
    K, block_size, rounds (complete measured rounds used), samples, prompts, tau_per_step, tau_per_sample,
    tau_source, tau_rounds_agree, tau_per_step_by_round, histogram, per_position, pooled_tok_s and
    per_sample_tok_s {n, mean, std, median, min, max, values (per round)}, ttft_s, drafter_prefill_s, new_tokens,
    decode_tokens, stop_reasons, speedup and gain {n, mean, std, median, min, max, values (per-round ratios), ref,
    ci95 [lo, hi], ci_point, ci_prompts} or None, speedup_per_sample {n, mean, ...} or None, token_match
    {ref, rows_compared, rows_identical, token_match_rate, first_divergence [{question_id, position}]} or None.
    """
    for i, r in enumerate(rows):
        missing = [k for k in _REQUIRED if k not in r]
        if missing:
            raise UsageError(f"sample row {i} lacks {missing}; rows must follow the samples.jsonl schema")
    rows, duplicates = _dedupe(rows)
    if not rows:
        raise UsageError("no sample rows to summarize; is samples.jsonl empty?")
    temperature = float(_one(rows, "temperature", "temperatures"))
    dataset = _one(rows, "dataset", "datasets")
    greedy = temperature < GREEDY_T
    arms = _arms(rows)
    all_rounds = sorted({r["round"] for r in rows})
    warm_rounds = sorted({r["round"] for r in rows if r["warmup"]})
    measured = [r for r in rows if not r["warmup"] and r["turn"] == 0]
    if not measured:
        raise UsageError("no measured rows (turn 0 of a non-warmup round): the run stopped during warmup; "
                         "rerun with --resume or more rounds")
    prompts = sorted({r["question_id"] for r in measured})
    by: dict[str, dict[int, dict]] = {a: {} for a in arms}  # arm -> round -> question_id -> row
    for r in measured:
        by[r["arm"]].setdefault(r["round"], {})[r["question_id"]] = r
    # a round that misses prompts (a crash, a resume in progress) would bias tok/s; it is left out and listed
    incomplete = [[a, rnd, len(qs), len(prompts)] for a in arms for rnd, qs in sorted(by[a].items())
                  if len(qs) < len(prompts)]
    used = {a: [rnd for rnd, qs in sorted(by[a].items()) if len(qs) == len(prompts)] for a in arms}
    per_round = {a: {rnd: _round_metrics(list(by[a][rnd].values()), arms[a]["block_size"]) for rnd in used[a]}
                 for a in arms}

    ar = _pick(arms, "ar", "AR")
    base = _pick(arms, "drafter-only", "drafter-only")
    pooled = {rnd: {a: per_round[a][rnd]["pooled"] for a in arms if rnd in per_round[a]}
              for rnd in sorted({x for a in arms for x in used[a]})}
    per_sample = {rnd: {a: per_round[a][rnd]["per_sample"] for a in arms if rnd in per_round[a]} for rnd in pooled}
    out_arms = {}
    for a, info in arms.items():
        pr = [per_round[a][rnd] for rnd in used[a]]
        s = {"arm": a, **info, "rounds": used[a], "samples": sum(len(by[a][rnd]) for rnd in used[a]),
             "prompts": len(prompts)}
        taus = [m["tau_per_step"] for m in pr]
        keys = ("tau_per_step", "tau_per_sample", "histogram", "per_position")
        if greedy:  # REFERENCE 11.2 item 8: the reference takes the warmup round; we take the first measured one
            agree = len(set(taus)) <= 1
            s["tau_source"] = (f"first measured round (round {used[a][0]}); greedy, so assumed identical across "
                               f"rounds: {'it is' if agree else 'IT IS NOT, see tau_per_step_by_round'}"
                               if pr else "no complete measured round")
            s["tau_rounds_agree"] = agree if pr else None
            s.update({k: pr[0][k] if pr else math.nan for k in keys})
            warm = [r for r in rows if r["arm"] == a and r["turn"] == 0 and warm_rounds and r["round"] == warm_rounds[0]]
            if tau_from_warmup and warm:  # --compat-reference: the reference keeps the first run's tau (its warmup)
                first = _round_metrics(warm, info["block_size"])
                s.update({k: first[k] for k in keys})
                s["tau_source"] = f"warmup round {warm_rounds[0]} (--compat-reference, as the reference)"
        else:
            s["tau_source"] = f"mean over {len(pr)} measured rounds (sampling, T={temperature:g})"
            s["tau_rounds_agree"] = None
            s.update({k: np.mean([m[k] for m in pr], axis=0).tolist() if pr else math.nan for k in keys})
        s["tau_per_step_by_round"] = taus
        for k, name in (("pooled", "pooled_tok_s"), ("per_sample", "per_sample_tok_s")):
            vals = [m[k] for m in pr]
            s[name] = _stats(metrics.round_stats(vals), vals)
        used_rows = [row for rnd in used[a] for row in by[a][rnd].values()]
        s["ttft_s"] = metrics.mean_latency_s([r["ttft_s"] for r in used_rows])
        s["drafter_prefill_s"] = metrics.mean_latency_s([r.get("drafter_prefill_s", 0.0) for r in used_rows])
        s["new_tokens"] = sum(r["new_tokens"] for r in used_rows)
        s["decode_tokens"] = sum(r["decode_tokens"] for r in used_rows)
        reasons = [r.get("stop_reason") for r in used_rows]
        s["stop_reasons"] = {str(x): reasons.count(x) for x in sorted(set(reasons), key=str)}
        out_arms[a] = s

    for ref, key in ((ar, "speedup"), (base, "gain")):
        ratios = paired_ratios(pooled, ref) if ref and any(ref in v for v in pooled.values()) else {}
        ps_ratios = paired_ratios(per_sample, ref) if key == "speedup" and ratios else {}
        for a in arms:
            out_arms[a][key] = _paired(a, ref, ratios, by, used, n_boot, seed) if a in ratios else None
            if key == "speedup":
                out_arms[a]["speedup_per_sample"] = (_stats(metrics.paired_ratio_stats(ps_ratios[a]), ps_ratios[a])
                                                     if a in ps_ratios else None)
    for a in arms:
        out_arms[a]["token_match"] = _token_match(rows, a, ar) if ar and a != ar else None

    optimal = {}
    for method in dict.fromkeys(i["method"] for i in arms.values()):
        cands = [(out_arms[a]["pooled_tok_s"]["mean"], a) for a, i in arms.items()
                 if i["method"] == method and math.isfinite(out_arms[a]["pooled_tok_s"]["mean"])]
        if cands:
            best = max(cands)[1]
            optimal[method] = {"arm": best, "K": arms[best]["K"], "pooled_tok_s": max(cands)[0]}
    return _clean({
        "schema": SCHEMA, "dataset": dataset, "temperature": temperature, "greedy": greedy,
        "block_size": max(i["block_size"] for i in arms.values()),
        "rounds": {"all": all_rounds, "warmup": warm_rounds,
                   "measured": [x for x in all_rounds if x not in warm_rounds]},
        "prompts": len(prompts), "reference_arm": ar, "drafter_only_arm": base,
        "incomplete_rounds": incomplete, "duplicate_rows_dropped": duplicates,
        "arms": out_arms, "optimal": optimal, "conventions": conventions(),
    })


def _token_match(rows: list[dict], arm: str, ar: str) -> dict | None:
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


def conventions() -> dict[str, str]:
    c = {k: metrics.CONVENTIONS[k] for k in (
        "tau_per_step", "tau_per_sample", "acceptance_histogram", "per_position_acceptance", "pooled_tok_per_s",
        "per_sample_tok_per_s", "round_stats", "paired_ratio_stats", "pooled_speedup_ci_over_prompts",
        "token_match_rate", "first_divergence", "mean_latency_s")}
    c["scope"] = ("throughput and tau use turn 0 of the measured rounds (warmup rounds excluded); tok/s counts decode "
                  "tokens (new tokens minus the prefill's first token) over decode seconds")
    c["tau_source"] = ("tau at T=0: from the first MEASURED round (greedy: identical every round, checked); at T>0: "
                       "mean of the per-round values over the measured rounds")
    c["speedup"] = ("Sp. = mean over measured rounds of the per-round paired ratio POOLED tok/s (arm) / POOLED tok/s "
                    "(AR) in the same round: a mean of ratios, not a ratio of means; +- sample std (n-1)")
    c["gain"] = "x gain = the same paired ratio against the drafter-only arm"
    c["ci95"] = ("[lo, hi] = 95% percentile bootstrap over prompts of the pooled speedup (each prompt's tokens and "
                 "seconds summed over the measured rounds; its point value is ci_point)")
    c["optimal"] = "throughput-optimal K = the arm of a method with the highest mean POOLED tok/s; tau at that arm"
    return c


def _clean(x):
    """JSON-safe: NaN and inf become None, numpy scalars become Python numbers."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    return x


# ------------------------------------------------------------------------------------------------ results folder

def _json(obj) -> str:
    return json.dumps(_clean(obj), indent=2, ensure_ascii=False, allow_nan=False, default=str) + "\n"


def write_results(folder: str | os.PathLike, config: dict, env: dict, rows: list[dict], summary: dict,
                  out=None) -> list[str]:
    """Write the results folder; returns the paths written. samples.jsonl is rewritten whole from `rows`."""
    out = out or sys.stdout
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dataset = summary.get("dataset") or config.get("dataset") or "?"
    files = {"config.json": _json(config), "env.json": _json(env),
             "samples.jsonl": "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
             "summary.json": _json(summary),
             "table.md": format_markdown_table(summary, dataset) + format_ranks(summary, markdown=True),
             "table.csv": format_csv(summary)}
    for name, text in files.items():
        atomic_write(folder / name, text)
    return [str(folder / n) for n in files] + write_plots(folder, summary, dataset, out)


def _load_folder(folder: str) -> dict:
    path = Path(folder)
    if not path.is_dir():
        raise UsageError(f"{folder}: not a results folder (no such directory)")
    loaded = {}
    for name in ("summary.json", "config.json"):
        try:
            loaded[name] = json.loads((path / name).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UsageError(f"{folder}: no {name}; is the run finished? (summary.json is written at the end)") \
                from None
        except ValueError as e:
            raise UsageError(f"{folder}/{name}: not valid JSON ({e})") from None
    s = loaded["summary.json"]
    if not isinstance(s, dict) or not isinstance(s.get("arms"), dict) or "optimal" not in s:
        raise UsageError(f"{folder}/summary.json: not an xpress-bench summary (no 'arms' / 'optimal')")
    for method, o in s["optimal"].items():
        if not isinstance(o, dict) or o.get("arm") not in s["arms"]:
            raise UsageError(f"{folder}/summary.json: optimal[{method!r}] names no arm of the summary")
    config = loaded["config.json"]
    dataset = s.get("dataset") or (config.get("dataset") if isinstance(config, dict) else None) or path.name
    return {"folder": folder, "dataset": dataset, "temperature": s.get("temperature"), "summary": s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.protocol.report",
                                description="One table over several results folders (rows = datasets).")
    p.add_argument("folders", nargs="+", help="results folders, each with summary.json and config.json")
    p.add_argument("--out", help="also write the table to this markdown file")
    ns = p.parse_args(argv)

    def work():
        text = format_multi_dataset_table([_load_folder(f) for f in ns.folders])
        if ns.out:
            atomic_write(ns.out, text)
        sys.stdout.write(text)
    return cli_exit(work)


if __name__ == "__main__":
    sys.exit(main())
