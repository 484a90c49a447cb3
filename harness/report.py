"""Results of a paired run: the summary of the sample rows, console / markdown / CSV tables, plots, the results
folder, and a multi-dataset table over several results folders.

    python -m harness.report results/gsm8k_T0 results/math500_T0 [--out table.md]

Every metric comes from harness.metrics and is printed with its convention line. Throughput uses turn 0 of the
measured (non-warmup) rounds only; ratios are paired within a round (harness.rounds).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from harness import metrics
from harness.errors import UsageError, cli_exit
from harness.plots import write_plots
from harness.results_io import atomic_write
from harness.rounds import paired_ratios

GREEDY_T = 1e-5  # below this temperature decoding is greedy, as the reference
SCHEMA = "xpress-bench/summary/1"
_METHOD_ORDER = {"ar": 0, "drafter-only": 1, "markov": 2, "xpress": 3}
_REPO = Path(__file__).resolve().parents[1]
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


# ------------------------------------------------------------------------------------------------------- tables

def _num(x, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _ratio_cell(p: dict | None, name: str, ref: str | None, ci: bool) -> str:
    if name == ref:
        return "1.000 (ref)"
    if not p or not p.get("n"):
        return "-"
    cell = f"{_num(p['mean'], '.3f')}+-{_num(p['std'], '.3f')}"
    return cell + (f" [{_num(p['ci95'][0], '.2f')}, {_num(p['ci95'][1], '.2f')}]" if ci else "")


_HEADER = ["method", "POOLED tok/s", "Sp. (paired) [95% CI]", "tau/step", "per-sample tok/s", "tau/sample",
           "x gain"]


def _table_rows(summary: dict) -> list[list[str]]:
    out = []
    for name, s in summary["arms"].items():
        p, q = s["pooled_tok_s"], s["per_sample_tok_s"]
        out.append([name, f"{_num(p['mean'], '.1f')}+-{_num(p['std'], '.1f')}",
                    _ratio_cell(s.get("speedup"), name, summary.get("reference_arm"), True),
                    _num(s["tau_per_step"], ".2f"), f"{_num(q['mean'], '.1f')}+-{_num(q['std'], '.1f')}",
                    _num(s["tau_per_sample"], ".2f"),
                    _ratio_cell(s.get("gain"), name, summary.get("drafter_only_arm"), False)])
    return out


def _notes(summary: dict) -> list[str]:
    lines = []
    for method, o in summary.get("optimal", {}).items():
        if method not in ("xpress", "markov"):  # one arm each: nothing was swept
            continue
        k = f" (K={o['K']})" if o.get("K") is not None else ""
        lines.append(f"throughput-optimal {method}: {o['arm']}{k} at {_num(o['pooled_tok_s'], '.1f')} POOLED tok/s")
    for name, s in summary["arms"].items():
        lines.append(f"{name}: tau from {s.get('tau_source')}; TTFT {_num(_ms(s['ttft_s']), '.1f')} ms, drafter "
                     f"prefill {_num(_ms(s['drafter_prefill_s']), '.1f')} ms; stop reasons {s['stop_reasons']}")
        tm = s.get("token_match")
        if tm:
            div = ", ".join(f"q{d['question_id']}:{'-' if d['position'] is None else d['position']}"
                            for d in tm["first_divergence"])
            lines.append(f"{name} vs {tm['ref']}: token match {_num(tm['token_match_rate'], '.4f')}, "
                         f"{tm['rows_identical']}/{tm['rows_compared']} outputs identical; first divergence per "
                         f"prompt (turn 0, earliest over rounds; - = none): {div}")
    for arm, rnd, n, total in summary.get("incomplete_rounds", []):
        lines.append(f"left out: {arm} round {rnd} has {n} of {total} prompts (incomplete)")
    if summary.get("duplicate_rows_dropped"):
        lines.append(f"{summary['duplicate_rows_dropped']} duplicate row(s) dropped (the last one written is kept)")
    if summary.get("reference_arm") is None:
        lines.append("no AR arm in this run: no speedup")
    return lines


def _ms(x):
    return None if x is None else 1000 * x


def _title(summary: dict, dataset: str) -> str:
    r = summary["rounds"]
    return (f"RESULT  dataset={dataset}  T={summary['temperature']:g}  block={summary['block_size']}  "
            f"rounds={len(r['all'])} (warmup {r['warmup']} excluded -> measured {r['measured']})  "
            f"prompts={summary['prompts']}")


def format_console_table(summary: dict, dataset: str) -> str:
    rows = [_HEADER] + _table_rows(summary)
    widths = [max(len(r[i]) for r in rows) + 2 for i in range(len(_HEADER))]
    body = ["".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    rule = "=" * max(96, max(len(b) for b in body))
    lines = [rule, _title(summary, dataset), rule, *body, rule, *_notes(summary), "conventions:"]
    lines += [f"  {k}: {v}" for k, v in summary["conventions"].items()]
    return "\n".join(lines)


def format_markdown_table(summary: dict, dataset: str) -> str:
    lines = [f"**{_title(summary, dataset)}**", "", "| " + " | ".join(_HEADER) + " |",
             "|" + "---|" * len(_HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in _table_rows(summary)]
    lines += ["", *[f"- {n}" for n in _notes(summary)], "", "Conventions:", ""]
    lines += [f"- {k}: {v}" for k, v in summary["conventions"].items()]
    return "\n".join(lines) + "\n"


_CSV = ["arm", "method", "K", "block_size", "samples", "pooled_tok_s_mean", "pooled_tok_s_std", "speedup_mean",
        "speedup_std", "speedup_median", "speedup_n", "speedup_ci_lo", "speedup_ci_hi", "tau_per_step",
        "per_sample_tok_s_mean", "per_sample_tok_s_std", "tau_per_sample", "gain_mean", "gain_std", "gain_n",
        "ttft_s", "drafter_prefill_s", "token_match_rate"]


def format_csv(summary: dict) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(_CSV)
    for name, s in summary["arms"].items():
        sp, g, tm = s.get("speedup") or {}, s.get("gain") or {}, s.get("token_match") or {}
        ci = sp.get("ci95") or [None, None]
        w.writerow(["" if v is None else v for v in (
            name, s["method"], s["K"], s["block_size"], s["samples"], s["pooled_tok_s"]["mean"],
            s["pooled_tok_s"]["std"], sp.get("mean"), sp.get("std"), sp.get("median"), sp.get("n"), ci[0], ci[1],
            s["tau_per_step"], s["per_sample_tok_s"]["mean"], s["per_sample_tok_s"]["std"], s["tau_per_sample"],
            g.get("mean"), g.get("std"), g.get("n"), s["ttft_s"], s["drafter_prefill_s"],
            tm.get("token_match_rate"))])
    return buf.getvalue()


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
             "summary.json": _json(summary), "table.md": format_markdown_table(summary, dataset),
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


def _cell_values(entry: dict, method: str) -> tuple[float | None, float | None, str | None]:
    s = entry["summary"]
    arm = (s["optimal"].get(method) or {}).get("arm")
    if arm is None:
        return None, None, None
    a = s["arms"][arm]
    return (a.get("speedup") or {}).get("mean"), a.get("tau_per_step"), arm


_COLS = (("drafter-only", "drafter-only"), ("markov", "Markov"), ("xpress", "xPress"))


def format_multi_dataset_table(entries: list[dict]) -> str:
    """Rows = datasets; per method 'Sp. / tau', xPress at its throughput-optimal K, x Gain; Avg. recomputed."""
    head = ["benchmark", "T"] + [f"{label} Sp. / τ" for _, label in _COLS] + ["xPress K", "× Gain"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cols: dict[str, list] = {f"{m}.{k}": [] for m, _ in _COLS for k in ("sp", "tau")}
    cols["gain"] = []
    for e in entries:
        cells = [e["dataset"], _num(e["temperature"], "g")]
        for method, _ in _COLS:
            sp, tau, _arm = _cell_values(e, method)
            cols[f"{method}.sp"].append(sp)
            cols[f"{method}.tau"].append(tau)
            cells.append(f"{_num(sp, '.2f')}× / {_num(tau, '.2f')}" if _arm else "-")
        xs = e["summary"]["optimal"].get("xpress") or {}
        gain = ((e["summary"]["arms"][xs["arm"]].get("gain") or {}).get("mean")) if xs else None
        cols["gain"].append(gain)
        cells.append(str(xs["K"]) if xs.get("K") is not None else "-")
        cells.append("-" if gain is None else f"{gain:.2f}×")
        lines.append("| " + " | ".join(cells) + " |")

    partial = []

    def avg(key: str) -> float | None:
        vals = [v for v in cols[key] if v is not None]
        if vals and len(vals) < len(cols[key]):
            partial.append(f"{key} ({len(vals)} of {len(cols[key])})")
        return float(np.mean(vals)) if vals else None

    cells = ["**Avg.**", ""]
    for method, _ in _COLS:
        sp, tau = avg(f"{method}.sp"), avg(f"{method}.tau")
        cells.append("-" if sp is None and tau is None else f"{_num(sp, '.2f')}× / {_num(tau, '.2f')}")
    gain = avg("gain")
    cells += ["", "-" if gain is None else f"{gain:.2f}×"]
    lines.append("| " + " | ".join(cells) + " |")
    temps = sorted({e["temperature"] for e in entries}, key=str)
    c = metrics.CONVENTIONS
    notes = ["", "Sp. = mean over measured rounds of the per-round paired POOLED tok/s ratio against the AR arm of the "
             "same run (a mean of ratios). " + c["paired_ratio_stats"],
             "τ = " + c["tau_per_step"] + "; at T=0 from the first measured round, at T>0 the mean over measured "
             "rounds.",
             "Each method at its throughput-optimal K (highest mean POOLED tok/s in that run); τ at that same arm.",
             "× Gain = the same paired POOLED ratio of xPress (at its K) over the drafter-only arm of the same run.",
             "Avg. = arithmetic mean of the rows above, recomputed here from the per-dataset numbers."]
    if partial:
        notes.append("Avg. over the datasets that have the value only: " + ", ".join(partial) + ".")
    if len(temps) > 1:
        notes.append(f"Note: the folders mix temperatures {temps}; the Avg. row mixes them too.")
    notes.append("Sources: " + ", ".join(f"{e['folder']} ({e['dataset']})" for e in entries) + ".")
    return "\n".join(lines + notes) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.report",
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
