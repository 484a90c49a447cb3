"""The tables of a results summary: the console table, its markdown and CSV forms, and the multi-dataset table
over several results folders (harness.protocol.report builds the summaries and writes the folders)."""
from __future__ import annotations

import csv
import io
import math

import numpy as np

from harness.protocol import ci_text, divergence, facts, metrics

def _num(x, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def run_labels(summary: dict) -> list[str]:
    """What a reader must know before reading any number of the run: random weights, scripted acceptance,
    tracing, the reference's accounting. Shown on every table's title line, in table.csv and in every plot title."""
    labels = list(summary.get("labels") or [])
    legacy = summary.get("label")  # summaries written before the labels list
    if legacy and legacy not in labels:
        labels.insert(0, legacy)
    return labels


def _spread(p: dict, fmt: str) -> str:
    """mean+-std over rounds, or the one value and "(1 round)" when one round was measured."""
    if p.get("n") == 1:
        return f"{_num(p['mean'], fmt)} (1 round)"
    return f"{_num(p['mean'], fmt)}+-{_num(p['std'], fmt)}"


def _ratio_cell(p: dict | None, name: str, ref: str | None, ci: bool) -> str:
    """The primary statistic (median over rounds of the paired per-round ratio) with ITS OWN CI."""
    if name == ref:
        return "1.000 (ref)"
    if not p or not p.get("n"):
        return "-"
    cell = _num(p.get("value"), ".3f") + (" (1 round)" if p["n"] == 1 else "")
    return cell + (ci_text.ci_bracket(p.get("ci95"), ci_units(p)) if ci else "")


def ci_units(p: dict) -> int | None:
    """The paired units a speedup's CI resampled (prompts x rounds); None where the summary does not say."""
    return p["n"] * p["ci_prompts"] if p.get("n") is not None and p.get("ci_prompts") is not None else None


_HEADER = ["method", "POOLED tok/s", "Sp. (median of rounds) [95% CI]", "E2E Sp. [95% CI]", "break-even tau",
           "tau/step", "per-sample tok/s", "tau/sample", "x gain over drafter-only (median) [95% CI]"]


def _table_rows(summary: dict) -> list[list[str]]:
    out = []
    for name, s in summary["arms"].items():
        p, q = s["pooled_tok_s"], s["per_sample_tok_s"]
        ref = summary.get("reference_arm")
        out.append([name, _spread(p, ".1f"), _ratio_cell(s.get("speedup"), name, ref, True),
                    _ratio_cell(s.get("speedup_e2e"), name, ref, True) if "speedup_e2e" in s else "-",
                    _num(s.get("break_even_tau"), ".2f"), _num(s["tau_per_step"], ".2f"), _spread(q, ".1f"),
                    _num(s["tau_per_sample"], ".2f"),
                    _ratio_cell(s.get("gain"), name, summary.get("drafter_only_arm"), True)])
    return out


def _notes(summary: dict) -> list[str]:
    lines = []
    for method, o in summary.get("optimal", {}).items():
        if method not in ("xpress", "markov"):  # one arm each: nothing was swept
            continue
        k = f" (K={o['K']})" if o.get("K") is not None and f"K={o['K']}" not in o['arm'] else ""  # once
        lines.append(f"throughput-optimal {method}: {o['arm']}{k} at {_num(o['pooled_tok_s'], '.1f')} POOLED tok/s "
                     f"over the measured rounds; " + _chosen(o.get("selected_on", "the measured rounds")))
    lines += _order(summary.get("tau_order"))
    for name, s in summary["arms"].items():
        lines.append(f"{name}: tau from {s.get('tau_source')}; TTFT {_num(_ms(s['ttft_s']), '.1f')} ms, drafter "
                     f"prefill {_num(_ms(s['drafter_prefill_s']), '.1f')} ms; stop reasons (measured rounds, first "
                     f"turns) {s['stop_reasons']}")
        tm = s.get("token_match")
        if tm:
            div = ", ".join(f"q{d['question_id']}:{'-' if d['position'] is None else d['position']}" + _gaps(d)
                            for d in tm["first_divergence"])
            by_design = ("sampled" if divergence.sampled(summary) else "scripted acceptance"
                         if divergence.scripted(summary) else None)
            lines.append(f"{name} vs {tm['ref']}" + (f" (differ by design, {by_design}: no identity check)"
                                                      if by_design else "") +
                         f": token match {_num(tm['token_match_rate'], '.4f')}, "
                         f"{tm['rows_identical']}/{tm['rows_compared']} outputs identical (every round both ran, "
                         f"warmup included, every turn); first divergence per "
                         f"prompt (turn 0, earliest over rounds; - = none): {div}")
    lines += _why(summary)
    for f in summary.get("ar_rounds_off_median", []):
        lines.append(f"FLAGGED: AR round {f['round']} ran at {_num(f['pooled_tok_s'], '.1f')} POOLED tok/s, "
                     f"{100 * f['off_median']:.0f}% from the median over rounds (timing noise; Sp. is a median)")
    for arm, rnd, n, total in summary.get("incomplete_rounds", []):
        lines.append(f"left out: {arm} round {rnd} has {n} of {total} prompts (incomplete)")
    if summary.get("duplicate_rows_dropped"):
        lines.append(f"{summary['duplicate_rows_dropped']} duplicate row(s) dropped (the last one written is kept)")
    if summary.get("reference_arm") is None:
        lines.append("no AR arm in this run: no speedup")
    return lines


def _diff(g: dict | None) -> str:
    if not g:
        return "-"
    units = g["prompts"] * g["seeds"] if isinstance(g.get("prompts"), int) and isinstance(g.get("seeds"), int) \
        else None
    return _num(g.get("diff"), '+.3f') + ci_text.ci_bracket(g.get("diff_ci95"), units, "+.3f")


def _order(o: dict | None) -> list[str]:
    """The tau order line: xPress > Markov > drafter-only, each step a paired tau difference with its 95% CI."""
    if not o:
        return []
    shown = [x["arm"] for x in o["xpress"] if x["shown"]]
    steps = "; ".join(f"{x['arm']} - {o['markov']} {_diff(x['vs_markov'])}" for x in o["xpress"])
    verdict = (f"shown for {', '.join(shown)}" if shown else "NOT shown (a CI includes zero or is below it)")
    return [f"tau order xPress > Markov > drafter-only (paired over prompts and seeds, 95% CI): {o['markov']} - "
            f"{o['drafter_only']} {_diff(o['markov_vs_drafter_only'])}; {steps}: {verdict}"]


def _why(summary: dict) -> list[str]:
    """Per speculative arm: its step cost over AR's (the break-even tau) against the tokens its steps return."""
    ar = summary["arms"].get(summary.get("reference_arm") or "") or {}
    out = []
    for name, s in summary["arms"].items():
        be, n = s.get("break_even_tau"), s.get("steps")
        if be is None or name == summary.get("reference_arm") or not n:
            continue
        per_step = s["decode_tokens"] / n
        ar_per_step = ar["decode_tokens"] / ar["steps"] if ar.get("steps") else 1.0  # 1 on real AR rows
        out.append(f"why: {name} steps cost {be:.2f}x AR's ({_num(_ms(s.get('step_s')), '.2f')} vs "
                   f"{_num(_ms(ar.get('step_s')), '.2f')} ms): break-even tau {be:.2f}, its steps return "
                   f"{per_step:.2f} decode tokens (tau/step {_num(s['tau_per_step'], '.2f')}), so it "
                   f"{'WINS' if per_step > be * ar_per_step else 'LOSES'} on decode "
                   f"(pooled Sp. = {per_step / ar_per_step / be:.3f})")
    return out


def _gaps(d: dict) -> str:
    """' (gap 0.031/0.012)': the target's top-2 logit gap at the divergence in the arm's and the reference's run."""
    if d.get("gap_arm") is None and d.get("gap_ref") is None:
        return ""
    return f" (gap {_num(d.get('gap_arm'), '.3g')}/{_num(d.get('gap_ref'), '.3g')})"


def _chosen(on: str) -> str:
    return on if on.startswith("no choice") else f"chosen on {on}"


def _ms(x):
    return None if x is None else 1000 * x


def _title(summary: dict, dataset: str) -> str:
    r = summary["rounds"]
    labels = run_labels(summary)
    tag = f"[{'; '.join(labels)}]  " if labels else ""
    warm = f"warmup {r['warmup']} excluded, measured {r['measured']}" if r["warmup"] else "no warmup, all measured"
    tokens = (summary.get("run") or {}).get("max_new_tokens")
    return (f"RESULT  {tag}{facts.describe(summary.get('run') or {})}  dataset={dataset}  "
            f"T={summary['temperature']:g}  block={summary['block_size']}  "
            f"rounds={len(r['all'])} ({warm})  prompts={summary['prompts']}"
            + (f"  max_new_tokens={tokens}" if tokens is not None else ""))


def format_console_table(summary: dict, dataset: str, explain: bool = False) -> str:
    """The table and its notes; the conventions block follows only with `explain` (--explain). It is always
    in the results folder's README.md (format_conventions)."""
    rows = [_HEADER] + _table_rows(summary)
    widths = [max(len(r[i]) for r in rows) + 2 for i in range(len(_HEADER))]
    body = ["".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    rule = "=" * max(96, max(len(b) for b in body))
    lines = [rule, _title(summary, dataset), rule, *body, rule, *_notes(summary)]
    if explain:
        lines += ["conventions:", *[f"  {k}: {v}" for k, v in summary["conventions"].items()]]
    else:
        lines.append("(conventions: README.md of the results folder, or --explain)")
    return "\n".join(lines)


def format_markdown_table(summary: dict, dataset: str) -> str:
    lines = [f"**{_title(summary, dataset)}**", "", "| " + " | ".join(_HEADER) + " |",
             "|" + "---|" * len(_HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in _table_rows(summary)]
    lines += ["", *[f"- {n}" for n in _notes(summary)]]
    lines += divergence.markdown(summary)  # harness.protocol.divergence: gaps at the first divergences, bug reports
    lines += ["", "Conventions: README.md in this folder."]
    return "\n".join(lines) + "\n"


def format_conventions(summary: dict, dataset: str) -> str:
    """The results folder's README.md: what the run is and what every number in its tables means."""
    labels = run_labels(summary)
    run = summary.get("run") if isinstance(summary.get("run"), dict) else {}
    lines = [f"# {dataset} at T={summary['temperature']:g}" + (f" ({'; '.join(labels)})" if labels else ""), "",
             f"Run: {facts.describe(run)}; the drafter's and refiners' weights: config.json `resolved.weights`.", "",
             "Files: table.md / table.csv (the tables), summary.json (every statistic), samples.jsonl.gz (gzip'd JSON "
             "lines, one row per arm, round, prompt and turn: everything above recomputes from it), config.json, "
             "env.json.", "",
             "## Conventions", ""]
    lines += [f"- **{k}**: {v}" for k, v in summary["conventions"].items()]
    return "\n".join(lines) + "\n"


_CSV = ["arm", "method", "K", "block_size", "samples", "rounds", "pooled_tok_s_mean", "pooled_tok_s_std",
        "speedup", "speedup_ci_lo", "speedup_ci_hi", "speedup_mean", "speedup_std", "speedup_median", "speedup_n",
        "speedup_pooled", "speedup_pooled_ci_lo", "speedup_pooled_ci_hi", "tau_per_step", "per_sample_tok_s_mean",
        "per_sample_tok_s_std", "tau_per_sample", "gain", "gain_mean", "gain_std", "gain_n", "ttft_s",
        "drafter_prefill_s", "token_match_rate", "speedup_e2e", "speedup_e2e_ci_lo", "speedup_e2e_ci_hi", "step_s",
        "break_even_tau", "model", "quantization", "device", "dtype", "kernels", "seed", "labels"]


def format_csv(summary: dict) -> str:
    """One row per arm. speedup / speedup_ci_* are the primary statistic and its own CI; labels (random weights,
    scripted acceptance, traced, compat) are in every row, "; "-separated."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(_CSV)
    labels = "; ".join(run_labels(summary))
    run = {k: (summary.get("run") or {}).get(k, facts.UNKNOWN) for k in ("model", "quantization", "device", "dtype",
                                                                       "kernels", "seed")}
    for name, s in summary["arms"].items():
        sp, g, tm = s.get("speedup") or {}, s.get("gain") or {}, s.get("token_match") or {}
        ci = sp.get("ci95") or [None, None]
        pooled = sp.get("pooled") or {}
        pci = pooled.get("ci95") or [None, None]
        w.writerow(["" if v is None else v for v in (
            name, s["method"], s["K"], s["block_size"], s["samples"], len(s.get("rounds") or []),
            s["pooled_tok_s"]["mean"], s["pooled_tok_s"]["std"], sp.get("value"), ci[0], ci[1], sp.get("mean"),
            sp.get("std"), sp.get("median"), sp.get("n"), pooled.get("value"), pci[0], pci[1],
            s["tau_per_step"], s["per_sample_tok_s"]["mean"], s["per_sample_tok_s"]["std"], s["tau_per_sample"],
            g.get("value"), g.get("mean"), g.get("std"), g.get("n"), s["ttft_s"], s["drafter_prefill_s"],
            tm.get("token_match_rate"), *_e2e(s), s.get("step_s"), s.get("break_even_tau"), *run.values(), labels)])
    return buf.getvalue()


def _e2e(s: dict) -> tuple:
    e = s.get("speedup_e2e") or {}
    return e.get("value"), *(e.get("ci95") or [None, None])


def _cell_values(entry: dict, method: str) -> tuple[dict, float | None, str | None]:
    s = entry["summary"]
    arm = (s["optimal"].get(method) or {}).get("arm")
    if arm is None:
        return {}, None, None
    a = s["arms"][arm]
    return a.get("speedup") or {}, a.get("tau_per_step"), arm


FLAG = "⚑"


def _sp_cell(sp: dict, tau, arm: dict, flagged: bool) -> str:
    """'2.03× [1.95, 2.12] (E2E 1.74×) / 2.15 (b-e 1.06)', ⚑ first when the run's AR rounds were flagged."""
    ci = sp.get("ci95") or [None, None]
    units = ci_units(sp)
    bracket = ci_text.ci_bracket(ci, units) if ci[0] is not None or units is not None else ""
    e2e = f" (E2E {_num((arm.get('speedup_e2e') or {}).get('value'), '.2f')}×)" if "speedup_e2e" in arm else ""
    be = f" (b-e {_num(arm.get('break_even_tau'), '.2f')})" if "break_even_tau" in arm else ""
    return f"{FLAG + ' ' if flagged else ''}{_num(sp.get('value'), '.2f')}×{bracket}{e2e} / {_num(tau, '.2f')}{be}"


def flagged_rounds(summary: dict) -> list[str]:
    """The run's FLAGGED noisy AR rounds, short: the merged table's flags column and every plot title."""
    return [f"AR round {f['round']} {100 * f['off_median']:.0f}% off the median"
            for f in summary.get("ar_rounds_off_median") or []]


_COLS = (("drafter-only", "drafter-only"), ("markov", "Markov"), ("xpress", "xPress"))


def format_multi_dataset_table(entries: list[dict]) -> str:
    """Rows = datasets; per method 'Sp. [95% CI] / tau' at its throughput-optimal K, x Gain, prompts, measured
    rounds and labels; Avg. recomputed (of the point values: the CIs of different datasets do not average), one Avg.
    row per temperature when the folders hold more than one (a mean over temperatures would mean nothing)."""
    head = (["benchmark", "T"] + [f"{label} Sp. [95% CI] (E2E) / τ (b-e)" for _, label in _COLS]
            + ["xPress K", "× Gain", "prompts", "rounds", "model", "device", "dtype", "flags", "labels"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    values: list[dict] = []  # per entry: the point values the Avg. rows average
    all_labels = []
    for e in entries:
        s = e["summary"]
        cells = [e["dataset"], _num(e["temperature"], "g")]
        v = {"T": e["temperature"]}
        flags = flagged_rounds(e["summary"])
        for method, _ in _COLS:
            sp, tau, _arm = _cell_values(e, method)
            v[f"{method}.sp"], v[f"{method}.tau"] = sp.get("value"), tau
            cells.append(_sp_cell(sp, tau, s["arms"][_arm], bool(flags)) if _arm else "-")
        xs = s["optimal"].get("xpress") or {}
        v["gain"] = ((s["arms"][xs["arm"]].get("gain") or {}).get("value")) if xs else None
        values.append(v)
        cells.append(str(xs["K"]) if xs.get("K") is not None else "-")
        cells.append("-" if v["gain"] is None else f"{v['gain']:.2f}×")
        labels = run_labels(s)
        all_labels += [x for x in labels if x not in all_labels]
        measured = (s.get("rounds") or {}).get("measured")
        run = facts.of(s, e.get("config"))
        cells += [str(s.get("prompts", "-")), "-" if measured is None else str(len(measured)),
                  *(str(run[k]) for k in ("model", "device", "dtype")),
                  "FLAGGED: " + "; ".join(flags) if flags else "-", "; ".join(labels) or "-"]
        lines.append("| " + " | ".join(cells) + " |")

    temps = sorted({e["temperature"] for e in entries}, key=str)
    partial = []
    for t in temps:
        group = [v for v in values if v["T"] == t]
        title = "**Avg.**" if len(temps) == 1 else f"**Avg. T={_num(t, 'g')}**"

        def avg(key: str) -> float | None:
            vals = [v[key] for v in group if v[key] is not None]
            if vals and len(vals) < len(group):
                at = "" if len(temps) == 1 else " at T=" + _num(t, "g")
                partial.append(f"{key}{at} ({len(vals)} of {len(group)})")
            return float(np.mean(vals)) if vals else None

        cells = [title, "" if len(temps) == 1 else _num(t, "g")]
        for method, _ in _COLS:
            sp, tau = avg(f"{method}.sp"), avg(f"{method}.tau")
            cells.append("-" if sp is None and tau is None else f"{_num(sp, '.2f')}× / {_num(tau, '.2f')}")
        gain = avg("gain")
        cells += ["", "-" if gain is None else f"{gain:.2f}×"] + [""] * 7
        lines.append("| " + " | ".join(cells) + " |")
    c = metrics.CONVENTIONS
    notes = [""]
    if all_labels:
        notes.append(f"**Labelled: {'; '.join(all_labels)}** (see the labels column: not a measurement of a "
                     "real model's decoding where it says random weights / scripted acceptance).")
    notes += [c["median_round_speedup"] + ".",
              "τ = " + c["tau_per_step"] + "; deterministic runs (T=0, greedy drafts) from the first measured "
              "round, sampled ones the mean over sampling replicates (each folder's tau_source names its rounds).",
              "Each method at its throughput-optimal K, chosen on held-out (warmup) rounds where the run has them "
              "and reported from the measured rounds; τ at that same arm.",
              "× Gain = the same statistic of xPress (at its K) over the drafter-only arm of the same run.",
              "Avg. = arithmetic mean of the rows above, recomputed here from the per-dataset numbers"
              + ("." if len(temps) == 1 else ", one row per temperature (each over the rows at that T).")]
    if any(flagged_rounds(e["summary"]) for e in entries):
        notes.append(f"{FLAG} = a cell of a run whose AR rounds were FLAGGED (a round far from the AR median: timing "
                     "noise; Sp. is a median over rounds, see the flags column and that folder's table.md).")
    notes.append("E2E = the same statistic over TTFT + drafter prefill + decode; b-e = break-even τ (the arm's step "
                 "cost over AR's: the arm wins iff τ exceeds it).")
    if partial:
        notes.append("Avg. over the datasets that have the value only: " + ", ".join(partial) + ".")
    notes.append("Sources: " + ", ".join(f"{e['folder']} ({e['dataset']})" for e in entries) + ".")
    return "\n".join(lines + notes) + "\n"
