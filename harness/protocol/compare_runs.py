"""Two finished runs compared arm by arm in τ, paired over their prompts: another drafter or other heads (or the
same weights on another machine) measured with the same target, protocol and prompts.

    python -m harness.protocol.compare_runs BASE NEW [--arm drafter-only --arm Markov ...] [--json OUT]

BASE and NEW are results folders (benchmark_compile_all.py --run-id ...) with their summary.json. For each arm
both ran (default: every shared arm but AR, whose τ is 1 by definition), τ per verify step of NEW over BASE with a
paired bootstrap 95% CI (harness.protocol.metrics.paired_tau_ci, the statistic of each table's τ gain): prompts are
resampled together, and at T>0 the sampling replicates (rounds) both runs have, too. A greedy run's rounds decode
the same text, so each run gives its one τ round (summary.json's tau_rounds), as its table does.

Refused before anything is compared: a run with scripted acceptance (its τ was set, not measured), and runs
that differ in what changes τ other than the weights: the temperature, the facts the merged report groups by
(model, quantization, device, dtype, kernels, max_new_tokens, the reference's accounting, the draft temperature,
CUDA graphs, compiling, top-C), the block size, the settings in SETTINGS and the context limit, or the prompts (the
dataset file's sha256 where both recorded it, and each first turn's dataset row and token count). Only τ is
compared: the two runs' rounds were not interleaved, so their times do not pair; each run's speedup over its own AR
is the speed comparison (its table).
"""
from __future__ import annotations

import sys
from pathlib import Path

from core.errors import Parser, UsageError, cli_exit
from core.json_out import write_json_arg
from harness.protocol import facts
from harness.protocol.ci_text import ci_bracket, verdict
from harness.protocol.labels import arm_name
from harness.protocol.merge import GROUP_KEYS, digests
from harness.protocol.metrics import paired_tau_ci, tau_over_replicates
from harness.protocol.replicates import replicate_rounds, tau_matrices


def load(folder: str) -> dict:
    """The folder as the report reads it (summary.json and config.json checked), with its rows."""
    from harness.protocol.report import load_folder
    from harness.protocol.results_io import read_folder_rows
    entry = load_folder(folder)
    return {**entry, "rows": read_folder_rows(Path(folder))}


def _prompts(run: dict) -> dict[int, tuple]:
    """question id -> (dataset row, prompt tokens) of every first turn the run decoded."""
    return {r["question_id"]: (r.get("dataset_row"), r.get("prompt_tokens")) for r in run["rows"] if r["turn"] == 0}


# settings in config.json that change τ and that the facts above do not name: the target's sampling, its
# architecture overrides, the refiners' passes and numerics, the logits' and attention's numerics, the drafts' noise,
# the context limit
SETTINGS = ("top_k", "top_p", "hf_overrides", "xpress_refine_passes", "xpress_prev_anchor", "refine_numerics",
            "fp32_logits", "attn_implementation", "draft_noise")


def check_same(base: dict, new: dict) -> list[int]:
    """UsageError naming the first fact, setting or prompt the two runs differ in; else the shared question ids."""
    fb, fn = (facts.of(r["summary"], r["config"]) for r in (base, new))
    scripted = [r["folder"] for r, f in ((base, fb), (new, fn)) if f.get("scripted_accept") not in (None, "unknown")]
    if scripted:
        raise UsageError(f"compare_runs: {scripted[0]} scripted its acceptance (--scripted-accept): its τ was set, "
                         "not measured, so there is nothing to compare")
    cb, cn = base["config"], new["config"]
    differ = [("temperature", base["summary"].get("temperature"), new["summary"].get("temperature")),
              *((k, fb[k], fn[k]) for k in GROUP_KEYS),
              ("block size", base["summary"].get("block_size"), new["summary"].get("block_size")),
              *((k, cb.get(k), cn.get(k)) for k in SETTINGS),
              ("max_model_len", (cb.get("resolved") or {}).get("max_model_len"),
               (cn.get("resolved") or {}).get("max_model_len"))]
    for what, vb, vn in differ:
        if vb != vn:
            raise UsageError(f"compare_runs: the runs differ in {what} ({vb} and {vn}), which changes τ; compare "
                             "runs made with the same settings but the weights")
    if base["dataset"] != new["dataset"]:
        raise UsageError(f"compare_runs: the runs decoded different datasets ({base['dataset']} and "
                         f"{new['dataset']}); compare runs of one --dataset")
    hb, hn = (((r["config"].get("resolved") or {}).get("dataset") or {}).get("sha256") for r in (base, new))
    if hb and hn and hb != hn:  # same rows and token counts can still be other text (an edited file)
        raise UsageError(f"compare_runs: the runs read different {base['dataset']} data (sha256 {hb[:12]} and "
                         f"{hn[:12]} in config.json resolved.dataset), so their prompts differ; compare runs of one "
                         "dataset file")
    pb, pn = _prompts(base), _prompts(new)
    if pb != pn:
        q = next((q for q in sorted(set(pb) | set(pn)) if pb.get(q) != pn.get(q)))
        raise UsageError(f"compare_runs: prompt {q} differs (dataset row and tokens {pb.get(q)} and {pn.get(q)}): "
                         "the runs decoded different prompts; give both the same --dataset and --max-samples")
    return sorted(pb)


def arm_names(base: dict, new: dict, wanted: list[str] | None) -> list[str]:
    shared = [a for a in base["summary"]["arms"] if a in new["summary"]["arms"]]
    if not wanted:
        names = [a for a in shared if a != "AR"]
        if not names:
            raise UsageError("compare_runs: the runs share no speculative arm")
        return names
    out = []
    for a in wanted:
        name = arm_name(a)
        if name == "AR":
            raise UsageError("compare_runs: --arm AR: AR's τ is 1 by definition; name a speculative arm")
        if name not in shared:
            raise UsageError(f"compare_runs: --arm {a}: not an arm of both runs (shared: {', '.join(shared)})")
        out.append(name)
    return out


def paired_rounds(base: dict, new: dict, arm: str, prompts: list[int]) -> tuple[list[int], list[int]]:
    """The rounds each run's τ of `arm` pairs over: where each run's table took τ from one round (a greedy run's
    rounds decode the same text), those two; else the sampling replicates both have (the same round numbers: each
    round its own seeded streams; drafts sampled at Td > 0 vary by round even when the target is greedy). Each
    round must hold the arm's first turn of every prompt, as the table's τ did."""
    taken = []
    for run in (base, new):
        rounds = run["summary"]["arms"][arm].get("tau_rounds") or []
        if not rounds:
            raise UsageError(f"compare_runs: {run['folder']}: {arm} records no τ rounds (a summary.json from before "
                             "they were kept); rewrite it: python -m harness.protocol.report --rebuild FOLDER")
        if not set(rounds) <= set(replicate_rounds(run["rows"], arm, prompts)):
            raise UsageError(f"compare_runs: {run['folder']}: {arm}'s τ rounds {rounds} lack rows of some prompt "
                             "(a summary.json older than its rows); rewrite it: python -m harness.protocol.report "
                             "--rebuild FOLDER")
        taken.append(rounds)
    rb, rn = taken
    if len(rb) == 1 and len(rn) == 1:
        return rb, rn
    common = [r for r in rb if r in set(rn)]
    if not common:
        raise UsageError(f"compare_runs: {arm}: the runs share no sampling replicate (rounds {rb} and {rn}); "
                         "run both with the same --fair-interleave rounds")
    return common, common


def compare(base_dir: str, new_dir: str, wanted: list[str] | None = None) -> dict:
    base, new = load(base_dir), load(new_dir)
    prompts = check_same(base, new)
    out = []
    for arm in arm_names(base, new, wanted):
        rounds_b, rounds_n = paired_rounds(base, new, arm, prompts)
        mb = tau_matrices(base["rows"], arm, rounds_b, prompts)
        mn = tau_matrices(new["rows"], arm, rounds_n, prompts)
        ci = paired_tau_ci(*mn, *mb)
        tables = [r["summary"]["arms"][arm]["tau_rounds"] for r in (base, new)]
        out.append({"arm": arm, "prompts": len(prompts), "replicates": len(rounds_b),
                    "rounds": [rounds_b, rounds_n], "table_rounds": tables, "base": tau_over_replicates(*mb),
                    "new": tau_over_replicates(*mn), **ci})
    return {"base": base_dir, "new": new_dir, "dataset": base["dataset"],
            "temperature": base["summary"].get("temperature"),
            "greedy": bool(base["summary"].get("greedy") and new["summary"].get("greedy")),
            "weights": [digests((r["config"].get("resolved") or {}).get("weights")) for r in (base, new)],
            "arms": out}


def lines(result: dict) -> list[str]:
    wb, wn = result["weights"]
    out = [f"BASE {result['base']} ({wb})", f"NEW  {result['new']} ({wn})"]
    for a in result["arms"]:
        n = a["replicates"]
        reps = "one τ round each" if n == 1 and result["greedy"] else f"{n} sampling replicate{'s' * (n > 1)}"
        units, over = a["prompts"] * n, "prompts" if n == 1 else "prompts and rounds"
        part = [f"{side}'s τ over {len(used)} of its table's {len(table)} rounds" for side, used, table in
                zip(("BASE", "NEW"), a["rounds"], a["table_rounds"]) if n > 1 and used != table]
        out.append(f"{a['arm']} ({a['prompts']} prompts, {reps}{''.join('; ' + p for p in part)}): τ {a['base']:.3f} "
                   f"-> {a['new']:.3f}, ratio {a['ratio']:.3f}{ci_bracket(a['ratio_ci95'], units, '.3f')} (paired "
                   f"bootstrap over {over}, 95%): {verdict(a['ratio_ci95'])}")
    out.append("speed is not compared: the two runs' rounds were not interleaved (each table's speedup over its own "
               "AR is)")
    return out


def main(argv=None) -> int:
    p = Parser(prog="python -m harness.protocol.compare_runs", description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="the reference run's results folder")
    p.add_argument("new", help="the run compared against it")
    p.add_argument("--arm", action="append", default=None,
                   help="an arm of both runs (drafter-only, Markov, xPress(K=4), ... or drafter, markov, x4; "
                        "repeatable); default: every shared speculative arm")
    p.add_argument("--json", default=None, help="also write the comparison to this file")
    args = p.parse_args(argv)

    def work():
        result = compare(args.base, args.new, args.arm)
        if args.json:
            write_json_arg(args.json, result, "compare_runs")
        print("\n".join(lines(result)))
    return cli_exit(work)


if __name__ == "__main__":
    sys.exit(main())
