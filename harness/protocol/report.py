"""Results of a paired run: the summary of the sample rows, plots, the results folder, and the multi-dataset table
over several results folders (the tables themselves are harness.protocol.tables, re-exported here).

    python -m harness.protocol.report results/gsm8k_T0 results/math500_T0 [--out table.md]

Every metric comes from harness.protocol.metrics and is printed with its convention line. Throughput uses turn 0 of the
measured (non-warmup) rounds only; ratios are paired within a round (harness.protocol.rounds).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from harness.protocol import comparisons, metrics
from core.errors import UsageError, cli_exit
from harness.protocol.plots import write_plots
from harness.protocol.rank_report import format_ranks
from harness.protocol.results_io import atomic_write
from harness.protocol.rounds import paired_ratios
from harness.protocol.tables import (format_console_table, format_conventions, format_csv, format_markdown_table,
                                     format_multi_dataset_table, run_labels)

__all__ = ["summarize", "conventions", "write_results", "format_console_table", "format_markdown_table",
           "format_csv", "format_multi_dataset_table", "main"]

GREEDY_T = 1e-5
UNTIMED_LABEL = "timing NOT a measurement (a per-step callback ran inside the timer)"  # below this temperature decoding is greedy, as the reference
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


_stats = comparisons.stats_dict


def summarize(rows: list[dict], n_boot: int = 2000, seed: int = 0, tau_from_warmup: bool = False,
              labels: list[str] | None = None) -> dict:
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
    # drafting at Td > 0 samples even when the target is greedy: then tau varies between rounds
    td = {r.get("draft_temperature") for r in rows}
    deterministic = greedy and all(t is None or t < GREEDY_T for t in td)
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
        if deterministic:  # REFERENCE 11.2 item 8: the reference takes the warmup round; we take the first measured one
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
            why = f"T={temperature:g}" if not greedy else f"T=0 but drafts sampled at Td={sorted(td, key=str)}"
            s["tau_source"] = f"mean over {len(pr)} measured rounds (sampling, {why})"
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
        ratios = paired_ratios(per_sample, ref) if ref and any(ref in v for v in per_sample.values()) else {}
        for a in arms:
            out_arms[a][key] = comparisons.paired(a, ref, by, used, n_boot, seed) if ref and a != ref else None
            if key == "speedup":
                out_arms[a]["speedup_per_sample"] = (_stats(metrics.paired_ratio_stats(ratios[a]), ratios[a])
                                                     if a in ratios and a != ref else None)
    for a in arms:
        out_arms[a]["token_match"] = comparisons.token_match(rows, a, ar) if ar and a != ar else None

    optimal = comparisons.optimal(arms, out_arms, rows, prompts)
    ar_flags = []
    if ar and ar in out_arms:
        vals = out_arms[ar]["pooled_tok_s"]["values"]
        ar_flags = [{"round": used[ar][i], "pooled_tok_s": vals[i], "off_median": off}
                    for i, off in metrics.off_median_rounds(vals)]
    return _clean({
        "schema": SCHEMA, "dataset": dataset, "temperature": temperature, "greedy": greedy,
        "block_size": max(i["block_size"] for i in arms.values()),
        "rounds": {"all": all_rounds, "warmup": warm_rounds,
                   "measured": [x for x in all_rounds if x not in warm_rounds]},
        "prompts": len(prompts), "reference_arm": ar, "drafter_only_arm": base,
        "incomplete_rounds": incomplete, "duplicate_rows_dropped": duplicates,
        "arms": out_arms, "optimal": optimal, "ar_rounds_off_median": ar_flags,
        "labels": list(labels or []) + ([UNTIMED_LABEL] if any(r.get("timed") is False for r in measured) else []),
        "conventions": conventions(),
    })


def conventions() -> dict[str, str]:
    c = {k: metrics.CONVENTIONS[k] for k in (
        "tau_per_step", "tau_per_sample", "acceptance_histogram", "per_position_acceptance", "pooled_tok_per_s",
        "per_sample_tok_per_s", "round_stats", "median_round_speedup", "off_median_rounds", "paired_ratio_stats",
        "pooled_speedup_ci_over_prompts", "token_match_rate", "first_divergence", "mean_latency_s")}
    c["scope"] = ("throughput and tau use turn 0 of the measured rounds (warmup rounds excluded); tok/s counts decode "
                  "tokens (new tokens minus the prefill's first token) over decode seconds")
    c["tau_source"] = ("tau of a deterministic run (T=0 and greedy drafts): from the first MEASURED round (identical "
                       "every round, checked); when anything is sampled (T>0, or a draft temperature > 0): the mean "
                       "of the per-round values over the measured rounds. A speculative arm's plain target steps "
                       "near the context limit are counted apart (tail_steps), not as tau entries")
    c["speedup"] = ("Sp. = the primary statistic: median over measured rounds of the per-round paired speedup, with "
                    "its own 95% CI (paired bootstrap over prompts and rounds); summary.json keeps the mean +- std "
                    "of the same per-round ratios and the pooled speedup with its bootstrap over prompts (pooled)")
    c["gain"] = "x gain = the same statistic against the drafter-only arm"
    c["optimal"] = ("throughput-optimal K = the arm of a method with the highest POOLED tok/s on the warmup rounds "
                    "(held out: never reported), reported from the measured rounds; a run without a complete warmup "
                    "round selects on the measured rounds and says so (selected_on: biased upward)")
    c["labels"] = ("random weights / scripted acceptance (timing only), traced (steps replayed untimed), compat "
                   "(the reference's accounting) are on every table title, in table.csv and in every plot title")
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
             "table.csv": format_csv(summary), "README.md": format_conventions(summary, dataset)}
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
    return {"folder": folder, "dataset": dataset, "temperature": s.get("temperature"), "summary": s, "config": config}


RANDOM_MARK = "RANDOM_WEIGHTS.txt"  # written by scripts/make_random_drafter.py and make_random_refiners.py


def weights_label(config: dict) -> str | None:
    """Numbers from random weights or scripted acceptance say so wherever they appear; so do runs of a real target
    with a drafter or heads that the random-weights scripts made. `config`: config.json or the RunConfig as a dict."""
    from harness.protocol.presets import RANDOM_LABEL
    if config.get("random_weights") or config.get("scripted_accept") is not None:
        return RANDOM_LABEL
    paths = (config.get("draft_name_or_path"), config.get("xpress_refiner_path"), config.get("markov_refiner_path"))
    if any(p and os.path.isfile(os.path.join(p, RANDOM_MARK)) for p in paths):
        return "random drafter/heads (scripts/make_random_*)"
    return None


def config_labels(config: dict) -> list[str]:
    """The labels of a run from its config (config.json or the RunConfig as a dict)."""
    from harness.protocol.trace import TRACED_LABEL
    labels = []
    if weights_label(config):
        labels.append(weights_label(config))
    if config.get("trace"):
        labels.append(TRACED_LABEL)
    if config.get("compat_reference"):
        labels.append("compat (the reference's accounting)")
    if config.get("record_logit_gaps"):
        labels.append("logit gaps recorded (a top-2 per step inside the timer)")
    return labels


def rebuild(folder: str) -> dict:
    """Recompute summary.json, table.md, table.csv and README.md of a results folder from its samples.jsonl and
    config.json (e.g. after the report's conventions changed); the rows themselves are not touched."""
    from harness.protocol.results_io import read_rows
    path = Path(folder)
    config = _load_folder(folder)["config"]
    old = json.loads((path / "summary.json").read_text(encoding="utf-8"))
    summary = summarize(read_rows(str(path / "samples.jsonl")), tau_from_warmup=bool(config.get("compat_reference")),
                        labels=config_labels(config))
    for key in ("compile", "kernel_fallbacks"):  # what the runner adds beside the rows' statistics
        if key in old:
            summary[key] = old[key]
    dataset = summary["dataset"]
    for name, text in (("summary.json", _json(summary)), ("table.md", format_markdown_table(summary, dataset)),
                       ("table.csv", format_csv(summary)), ("README.md", format_conventions(summary, dataset))):
        atomic_write(path / name, text)
    return summary


def _distinct(entries: list[dict]) -> list[dict]:
    """Rows of the merged table are datasets: two runs of one dataset at one temperature would be averaged as two
    datasets, so they are refused."""
    seen: dict = {}
    for e in entries:
        key = (e["dataset"], e["temperature"])
        if key in seen:
            raise UsageError(f"{seen[key]} and {e['folder']} are both {e['dataset']} at T={e['temperature']:g}; the "
                             "Avg. row would count that dataset twice: pass one folder per dataset (or one run "
                             "with more rounds)")
        seen[key] = e["folder"]
    return entries


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.protocol.report",
                                description="One table over several results folders (rows = datasets).")
    p.add_argument("folders", nargs="+", help="results folders, each with summary.json and config.json")
    p.add_argument("--out", help="also write the table to this markdown file")
    p.add_argument("--rebuild", action="store_true",
                   help="first recompute each folder's summary.json, table.md, table.csv and README.md from its "
                        "samples.jsonl and config.json")
    ns = p.parse_args(argv)

    def work():
        if ns.rebuild:
            for f in ns.folders:
                rebuild(f)
        text = format_multi_dataset_table(_distinct([_load_folder(f) for f in ns.folders]))
        if ns.out:
            atomic_write(ns.out, text)
        sys.stdout.write(text)
    return cli_exit(work)


if __name__ == "__main__":
    sys.exit(main())
