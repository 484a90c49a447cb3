"""Results of a paired run: the summary of the sample rows, plots, the results folder, and the multi-dataset table
over several results folders (the tables themselves are harness.protocol.tables, re-exported here).

    python -m harness.protocol.report results/gsm8k_T0 results/math500_T0 [--out table.md]

Every metric comes from harness.protocol.metrics and is printed with its convention line. Throughput uses turn 0 of the
measured (non-warmup) rounds only; ratios are paired within a round (harness.protocol.rounds).
"""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.protocol import comparisons, costs, facts, metrics, replicates
from core.errors import Parser, UsageError, cli_exit
from core.json_out import json_safe
from harness.protocol.plots import write_plots
from harness.protocol.rank_report import format_ranks
from harness.protocol.labels import RANDOM_MARK, config_labels, weights_label  # noqa: F401 (re-exported)
from harness.protocol.config import check_writable
from harness.protocol.plan import check_run_folder, resume_count
from harness.protocol.results_io import (ROWS, atomic_write, rank_rows_files, read_folder_rows, rows_file,
                                        write_rows)
from harness.protocol.summary_schema import SCHEMA, SCHEMA_VERSION, conventions, version
from harness.protocol.rounds import complete_rounds, paired_ratios, run_prompts
from harness.protocol.tables import (format_console_table, format_conventions, format_csv, format_markdown_table,
                                     format_multi_dataset_table, run_labels)

__all__ = ["summarize", "conventions", "write_results", "format_console_table", "format_markdown_table",
           "format_csv", "format_multi_dataset_table", "main"]

GREEDY_T = 1e-5
UNTIMED_LABEL = "timing NOT a measurement (a per-step callback ran inside the timer)"  # below this temperature decoding is greedy, as the reference
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
    names = comparisons.method_arms(arms, method)
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
_TAU_KEYS = ("tau_per_step", "tau_per_sample", "histogram", "per_position")


@dataclass
class _Rows:
    """The sample rows of one run, grouped for the statistics (turn 0 of the measured rounds)."""
    rows: list[dict]
    dataset: str
    temperature: float
    greedy: bool
    draft_temperatures: set
    deterministic: bool                   # greedy target and greedy drafts: tau is the same every round
    arms: dict[str, dict]                 # name -> {method, K, block_size}, in method order
    all_rounds: list[int]
    warm_rounds: list[int]
    measured: list[dict]
    prompts: list[int]
    by: dict[str, dict[int, dict]]        # arm -> round -> question_id -> row
    used: dict[str, list[int]]            # arm -> its complete measured rounds
    per_round: dict[str, dict[int, dict]]  # arm -> round -> _round_metrics


def _checked(rows: list[dict]) -> tuple[list[dict], int]:
    for i, r in enumerate(rows):
        missing = [k for k in _REQUIRED if k not in r]
        if missing:
            raise UsageError(f"sample row {i} lacks {missing}; rows must follow the samples.jsonl.gz schema "
                             "(results/README.md)")
    rows, duplicates = _dedupe(rows)
    if not rows:
        raise UsageError("no sample rows to summarize; are the rows (samples.jsonl.gz) empty?")
    return rows, duplicates


def _group(rows: list[dict]) -> _Rows:
    temperature = float(_one(rows, "temperature", "temperatures"))
    greedy = temperature < GREEDY_T
    # drafting at Td > 0 samples even when the target is greedy: then tau varies between rounds
    td = {r.get("draft_temperature") for r in rows}
    arms = _arms(rows)
    all_rounds = sorted({r["round"] for r in rows})
    measured = [r for r in rows if not r["warmup"] and r["turn"] == 0]
    if not measured:
        raise UsageError("no measured rows (turn 0 of a non-warmup round): the run stopped during warmup; "
                         "rerun with --resume or more rounds")
    prompts = sorted({r["question_id"] for r in measured})
    by: dict[str, dict[int, dict]] = {a: {} for a in arms}
    for r in measured:
        by[r["arm"]].setdefault(r["round"], {})[r["question_id"]] = r
    used = {a: [rnd for rnd, qs in sorted(by[a].items()) if len(qs) == len(prompts)] for a in arms}
    per_round = {a: {rnd: _round_metrics(list(by[a][rnd].values()), arms[a]["block_size"]) for rnd in used[a]}
                 for a in arms}
    return _Rows(rows, _one(rows, "dataset", "datasets"), temperature, greedy, td,
                 greedy and all(t is None or t < GREEDY_T for t in td), arms, all_rounds,
                 sorted({r["round"] for r in rows if r["warmup"]}), measured, prompts, by, used, per_round)


def _incomplete(g: _Rows) -> list[list]:
    """A round that misses prompts (a crash, a resume in progress) would bias tok/s; it is left out and listed."""
    return [[a, rnd, len(qs), len(g.prompts)] for a in g.arms for rnd, qs in sorted(g.by[a].items())
            if len(qs) < len(g.prompts)]


def _tau(g: _Rows, a: str, tau_from_warmup: bool) -> dict:
    """tau_source, tau_rounds_agree, tau_seeds, tau_rounds and the tau statistics of one arm."""
    pr = [g.per_round[a][rnd] for rnd in g.used[a]]
    if not g.deterministic:  # sampled: the mean over every replicate round, warmup's too (harness.protocol.replicates)
        why = f"T={g.temperature:g}" if not g.greedy else f"T=0 but drafts sampled at Td={sorted(g.draft_temperatures, key=str)}"
        return replicates.sampled_tau(g.rows, a, g.prompts, lambda rs: _round_metrics(rs, g.arms[a]["block_size"]),
                                      _TAU_KEYS, why)
    # the reference harness reads greedy tau off its warmup round; we take the first measured one
    agree = len({m["tau_per_step"] for m in pr}) <= 1
    s = {"tau_source": (f"first measured round (round {g.used[a][0]}); greedy, so assumed identical across "
                        f"rounds: {'it is' if agree else 'IT IS NOT, see tau_per_step_by_round'}"
                        if pr else "no complete measured round"),
         "tau_rounds_agree": agree if pr else None, "tau_seeds": 1 if pr else 0, "tau_rounds": g.used[a][:1],
         **{k: pr[0][k] if pr else math.nan for k in _TAU_KEYS}}
    first_warm = g.warm_rounds[0] if g.warm_rounds else None
    warm = [r for r in g.rows if r["arm"] == a and r["turn"] == 0 and r["round"] == first_warm]
    if tau_from_warmup and warm:  # --compat-reference: the reference keeps the first run's tau (its warmup)
        first = _round_metrics(warm, g.arms[a]["block_size"])
        s.update({k: first[k] for k in _TAU_KEYS})
        s["tau_source"] = f"warmup round {first_warm} (--compat-reference, as the reference)"
        s["tau_rounds"] = [first_warm]
    return s


def _throughput(g: _Rows, a: str) -> dict:
    """tok/s over the used rounds, latencies, token counts and stop reasons of one arm."""
    pr = [g.per_round[a][rnd] for rnd in g.used[a]]
    s = {}
    for k, name in (("pooled", "pooled_tok_s"), ("per_sample", "per_sample_tok_s")):
        vals = [m[k] for m in pr]
        s[name] = _stats(metrics.round_stats(vals), vals)
    used_rows = [row for rnd in g.used[a] for row in g.by[a][rnd].values()]
    s["ttft_s"] = metrics.mean_latency_s([r["ttft_s"] for r in used_rows])
    s["drafter_prefill_s"] = metrics.mean_latency_s([r.get("drafter_prefill_s", 0.0) for r in used_rows])
    s["new_tokens"] = sum(r["new_tokens"] for r in used_rows)
    s["decode_tokens"] = sum(r["decode_tokens"] for r in used_rows)
    reasons = [r.get("stop_reason") for r in used_rows]
    s["stop_reasons"] = {str(x): reasons.count(x) for x in sorted(set(reasons), key=str)}
    return s


def _arm(g: _Rows, a: str, tau_from_warmup: bool) -> dict:
    tau = _tau(g, a, tau_from_warmup)
    return {"arm": a, **g.arms[a], "rounds": g.used[a], "samples": sum(len(g.by[a][rnd]) for rnd in g.used[a]),
            "prompts": len(g.prompts), **tau,
            "tau_per_step_by_round": [g.per_round[a][rnd]["tau_per_step"] for rnd in g.used[a]],
            **_throughput(g, a)}


def _compare(g: _Rows, out_arms: dict, ar: str | None, base: str | None, n_boot: int, seed: int) -> None:
    """speedup (+ speedup_per_sample) against AR, gain against drafter-only, token_match against AR."""
    per_sample = {rnd: {a: g.per_round[a][rnd]["per_sample"] for a in g.arms if rnd in g.per_round[a]}
                  for rnd in sorted({x for a in g.arms for x in g.used[a]})}
    for ref, key in ((ar, "speedup"), (base, "gain")):
        ratios = paired_ratios(per_sample, ref) if ref and any(ref in v for v in per_sample.values()) else {}
        for a in g.arms:
            out_arms[a][key] = comparisons.paired(a, ref, g.by, g.used, n_boot, seed) if ref and a != ref else None
            if key == "speedup":
                out_arms[a]["speedup_per_sample"] = (_stats(metrics.paired_ratio_stats(ratios[a]), ratios[a])
                                                     if a in ratios and a != ref else None)
    for a in g.arms:
        out_arms[a]["token_match"] = comparisons.token_match(g.rows, a, ar) if ar and a != ar else None
        out_arms[a]["reference_match"] = comparisons.reference_match(g.rows, a)  # AR vs --reference-dtype


def _ar_off_median(g: _Rows, out_arms: dict, ar: str | None) -> list[dict]:
    if not (ar and ar in out_arms):
        return []
    vals = out_arms[ar]["pooled_tok_s"]["values"]
    return [{"round": g.used[ar][i], "pooled_tok_s": vals[i], "off_median": off}
            for i, off in metrics.off_median_rounds(vals)]


def summarize(rows: list[dict], n_boot: int = 2000, seed: int = 0, tau_from_warmup: bool = False,
              labels: list[str] | None = None, run: dict | None = None) -> dict:
    """The run's summary, JSON-ready (undefined numbers are None): every key and its meaning are listed in
    harness.protocol.summary_schema (TOP, ARM), which a test checks a written summary against. `run`: the run's
    facts (harness.protocol.facts.run_facts of config.json; "unknown" everywhere without it)."""
    rows, duplicates = _checked(rows)
    g = _group(rows)
    ar = _pick(g.arms, "ar", "AR")
    base = _pick(g.arms, "drafter-only", comparisons.BASE_DRAFTER_ARM)
    out_arms = {a: _arm(g, a, tau_from_warmup) for a in g.arms}
    _compare(g, out_arms, ar, base, n_boot, seed)
    replicates.add_tau_gains(g.rows, out_arms, base, g.prompts, n_boot, seed)
    design = replicates.design(g.rows, g.warm_rounds)
    costs.add(out_arms, g.by, g.used, ar, n_boot, seed)
    optimal = comparisons.optimal(g.arms, out_arms, rows, g.prompts)
    untimed = [UNTIMED_LABEL] if any(r.get("timed") is False for r in g.measured) else []
    return json_safe({
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "run": run or facts.run_facts(None), "dataset": g.dataset, "temperature": g.temperature,
        "greedy": g.greedy, "block_size": max(i["block_size"] for i in g.arms.values()),
        "rounds": {"all": g.all_rounds, "warmup": g.warm_rounds,
                   "measured": [x for x in g.all_rounds if x not in g.warm_rounds]},
        "prompts": len(g.prompts), "reference_arm": ar, "drafter_only_arm": base,
        "incomplete_rounds": _incomplete(g), "duplicate_rows_dropped": duplicates,
        "arms": out_arms, "optimal": optimal,
        "tau_order": replicates.tau_order(g.rows, g.arms, out_arms, optimal, base, g.prompts, n_boot, seed),
        "ar_rounds_off_median": _ar_off_median(g, out_arms, ar),
        "design": design, "labels": list(labels or []) + untimed + replicates.labels(out_arms, design, g.deterministic)
        + replicates.capped_label(g.measured) + replicates.context_label(g.measured),
        "conventions": conventions(),
    })


def _json(obj) -> str:  # the results folder's JSON files
    return json.dumps(json_safe(obj), indent=2, ensure_ascii=False, allow_nan=False, default=str) + "\n"


def write_results(folder: str | os.PathLike, config: dict, env: dict, rows: list[dict], summary: dict,
                  out=None) -> list[str]:
    """Write the results folder; returns the paths written. The rows are written whole from `rows`, gzip'd, as
    samples.jsonl.gz, and the plain samples.jsonl the run appended to goes (results_io.write_rows).
    summary.json goes last, after the plots: it marks the run finished (plan.check_unfinished), so a run stopped
    before it resumes and writes the rest."""
    out = out or sys.stdout
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dataset = summary.get("dataset") or config.get("dataset") or "?"
    files = {"config.json": _json(config), "env.json": _json(env),
             "table.md": format_markdown_table(summary, dataset) + format_ranks(summary, markdown=True),
             "table.csv": format_csv(summary), "README.md": format_conventions(summary, dataset)}
    for name, text in files.items():
        atomic_write(folder / name, text)
    packed = write_rows(folder, rows)
    plots = write_plots(folder, summary, dataset, out)
    atomic_write(folder / "summary.json", _json(summary))
    return [str(folder / n) for n in files] + [str(packed)] + plots + [str(folder / "summary.json")]


def _read_json(folder: str, name: str, missing: str = "is the run finished? (summary.json is written at the "
               "end; --rebuild writes it from samples.jsonl.gz and config.json)"):
    try:
        return json.loads((Path(folder) / name).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{folder}: no {name}; {missing}") from None
    except ValueError as e:
        raise UsageError(f"{folder}/{name}: not valid JSON ({e})") from None


def load_folder(folder: str) -> dict:
    check_run_folder(folder)
    loaded = {name: _read_json(folder, name) for name in ("summary.json", "config.json")}
    s = loaded["summary.json"]
    if not isinstance(s, dict) or not isinstance(s.get("arms"), dict) or "optimal" not in s:
        raise UsageError(f"{folder}/summary.json: not an xpress-bench summary (no 'arms' / 'optimal')")
    version(s, f"{folder}/summary.json")  # 1 (written before schema_version) .. SCHEMA_VERSION: read alike
    for method, o in s["optimal"].items():
        if not isinstance(o, dict) or o.get("arm") not in s["arms"]:
            raise UsageError(f"{folder}/summary.json: optimal[{method!r}] names no arm of the summary")
    config = loaded["config.json"]
    dataset = s.get("dataset") or (config.get("dataset") if isinstance(config, dict) else None) or Path(folder).name
    return {"folder": folder, "dataset": dataset, "temperature": s.get("temperature"), "summary": s, "config": config}


def rebuildable(folder: str) -> tuple[dict, list[dict], list[int], list[int]]:
    """config.json, the rows, the rounds and the complete ones (every arm's decode of every prompt), checked."""
    check_run_folder(folder)
    need = (f"--rebuild recomputes a run's tables from its {ROWS} (or plain samples.jsonl, or a torchrun run's "
            "samples.rank{r}.jsonl) and config.json")
    config = _read_json(folder, "config.json", need)
    merged = rows_file(Path(folder))
    ranks = [] if merged else rank_rows_files(folder)  # a torchrun run's rows, where rank 0 never merged them
    if merged is None and not ranks:
        raise UsageError(f"{folder}: no {ROWS}; {need}")
    rows, saved = read_folder_rows(Path(folder)), config.get("resolved") or {}
    world = int((saved.get("distributed") or {}).get("world_size") or 0)
    lost = [r for r in range(world) if Path(folder, f"samples.rank{r}.jsonl") not in ranks] if ranks else []
    if lost:  # the rows of a torchrun run rank 0 never merged, one file short: its prompts would go missing
        raise UsageError(f"{folder}: no samples.rank{lost[0]}.jsonl of its {world} ranks' rows, so its prompts' "
                         "decodes are lost; put that file back, or continue the run: "
                         f"torchrun --nproc-per-node {world} benchmark_compile_all.py --resume {folder}")
    _checked(rows)  # a malformed row's one line before the rounds are read from the rows
    rounds = list(range(1, saved["rounds"] + 1)) if saved.get("rounds") else sorted({r["round"] for r in rows})
    done = {(r["round"], r["arm"], r["question_id"]) for r in rows}
    qids = run_prompts(folder, saved.get("prompt_rows"), rows)  # the planned prompts where config.json names them
    kept = complete_rounds(done, rounds, saved.get("arms") or {a for _, a, _ in done}, qids)
    if not kept:
        launch = f"torchrun --nproc-per-node {world}" if world else "python3"
        raise UsageError(f"{folder}: no complete round in its rows (every arm's decode of every prompt), so nothing "
                         f"to summarize; continue the run: {launch} benchmark_compile_all.py --resume {folder}")
    return config, rows, rounds, kept


def rebuild(folder: str, read: tuple | None = None) -> dict:
    """A folder's tables, README.md, plots and summary.json (this schema version) recomputed from its rows (plain
    samples.jsonl too) and config.json, over its complete rounds (rebuildable: what the live report had; `read` if
    done); the rows are not touched."""
    path = Path(folder)
    config, rows, rounds, kept = read or rebuildable(folder)
    old = _read_json(folder, "summary.json") if (path / "summary.json").is_file() else {}  # none: an interrupted run
    cut = [] if kept == rounds else [f"interrupted: {len(kept)} of {len(rounds)} rounds complete, the rest left out"]
    summary = summarize([r for r in rows if r["round"] in kept], tau_from_warmup=bool(config.get("compat_reference")),
                        labels=config_labels({**config, "resumes": resume_count(folder)}) + cut,
                        run=facts.run_facts(config))
    for key in ("compile", "kernel_fallbacks"):  # what the runner adds beside the rows' statistics
        if key in old:
            summary[key] = old[key]
    dataset = summary["dataset"]
    for name, text in (("table.md", format_markdown_table(summary, dataset)), ("table.csv", format_csv(summary)),
                       ("README.md", format_conventions(summary, dataset))):
        atomic_write(path / name, text)
    write_plots(path, summary, dataset)  # then summary.json, last, as a run writes it (write_results)
    atomic_write(path / "summary.json", _json(summary))
    return summary


def _entry(folder: str) -> dict:
    """A folder as the merge sees it, from its config.json and (an interrupted run has none) its summary.json."""
    config = _read_json(folder, "config.json")
    summary = _read_json(folder, "summary.json") if (Path(folder) / "summary.json").is_file() else {}
    t = summary.get("temperature", config.get("temperature"))
    return {"folder": folder, "dataset": summary.get("dataset") or config.get("dataset"),
            "temperature": float("nan") if t is None else t, "summary": summary, "config": config}


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m harness.protocol.report", description="One table over several results folders "
               "(rows = datasets), one per target and protocol (harness.protocol.merge).")
    p.add_argument("folders", nargs="+", help="results folders, each with summary.json and config.json "
                                              "(with --rebuild: the rows and config.json)")
    p.add_argument("--out", help="also write the table to this markdown file")
    p.add_argument("--rebuild", action="store_true", help="first recompute each folder's tables, plots and "
                   "summary.json from its samples.jsonl.gz (or plain samples.jsonl, or a torchrun run's "
                   "samples.rank{r}.jsonl) and config.json (an interrupted run's: its complete rounds)")
    ns = p.parse_args(argv)

    def work():
        if ns.out:
            check_writable(ns.out, "--out", "table.md")
        from harness.protocol.merge import distinct, format_merged
        for f in ns.folders:  # every folder checked before any is rewritten, the datasets' clash too
            check_run_folder(f)
        if ns.rebuild:  # the merge's own check, per group, on what the folders hold before they are rebuilt
            from harness.protocol.merge import groups
            for members in groups([_entry(f) for f in ns.folders]).values():
                distinct(members)
        read = {f: rebuildable(f) for f in ns.folders} if ns.rebuild else {}  # every folder's refusal first
        for f, got in read.items():
            rebuild(f, got)
        text = format_merged([load_folder(f) for f in ns.folders], distinct)
        if ns.out:
            atomic_write(ns.out, text)
        sys.stdout.write(text)
    return cli_exit(work)


if __name__ == "__main__":
    sys.exit(main())
