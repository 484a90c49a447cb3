"""The quantities that README markers name (`harness.lab.readme_numbers`): each a small function of committed files.

A marker `<!--n:FAMILY:ARG:ARG-->TEXT<!--/n-->` calls `REGISTRY[FAMILY](root, ARG, ARG)` and expects TEXT back,
character for character. Every function reads files under `root` (the repository) and formats its value exactly
as the README prints it; units and signs that sit outside the marker stay prose.

Conventions of the arguments:
- FOLDER: a run folder; a bare name is under `results/smollm2-135m/` (`gsm8k_t0`), a name with a `/` is relative
  to the repository (`results/perf/cli_qwen3-8b_bf16_graph_scripted6`).
- ARM: `ar`, `drafter`, `markov`, `x1` ... `x8` (xPress at K), or an arm name as summary.json spells it; the
  families that read a run's summary.json (`arm()`) also take `xopt`, the xPress arm the run chose as
  throughput-optimal (summary.json's optimal.xpress).
- ARMS: `,`-separated ARMs; `spec` = every arm but AR; `xpress` = every xPress arm.
- D: decimals (each family has a default: the README's usual precision).
- BENCH: a bench_step JSON under `results/perf/gpu_check/` without `.json` (`after`).
- END: `min` or `max`, for the two ends of a range a README prints as "lo-hi" (two markers, one per end).

To add a quantity: write a function `def name(root, *args) -> str` below, decorate it with `@quantity("name")`,
and wrap the README's text in `<!--n:name:args-->...<!--/n-->`; `python -m harness.lab.readme_numbers --write`
then fills it and `--check` keeps it honest. A regenerated results folder needs no code: its markers recompute.
"""
from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

from core.errors import UsageError
from harness.protocol.labels import arm_name

REGISTRY: dict = {}
RUNS = "results/smollm2-135m"
# the first trained weights' tables of the previous protocol (opt_k, opt_gain_end)
H200 = [f"results/smollm2-135m-v1/h200_96tok/{d}_t{t}" for t in (0, 1) for d in ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")]


def quantity(name: str):
    def deco(f):
        REGISTRY[name] = f
        return f
    return deco


@lru_cache(maxsize=256)
def _json(path: Path):
    if not path.is_file():
        raise UsageError(f"readme_numbers: {path} is not a committed file; fix the marker's key or commit the file")
    return json.loads(path.read_text(encoding="utf-8"))


def run_dir(root: Path, folder: str) -> Path:
    """A run folder: a bare name is under RUNS, a name with a `/` is relative to the repository."""
    return root / (folder if "/" in folder else f"{RUNS}/{folder}")


def summary(root: Path, folder: str) -> dict:
    return _json(run_dir(root, folder) / "summary.json")


def arm(root: Path, folder: str, a: str) -> dict:
    s = summary(root, folder)
    arms = s["arms"]
    if a == "xopt":
        opt = (s.get("optimal") or {}).get("xpress") or {}
        if not opt.get("arm"):
            raise UsageError(f"readme_numbers: {folder} chose no throughput-optimal xPress arm (summary.json's "
                             "optimal.xpress); name the arm's K instead (x1, x2, ...)")
        return arms[opt["arm"]]
    name = arm_name(a)
    if name not in arms:
        raise UsageError(f"readme_numbers: {folder} has no arm {name!r} (arms: {', '.join(arms)})")
    return arms[name]


def arms(root: Path, folder: str, spec: str) -> list[dict]:
    """The arms ARMS names: `,`-separated ARMs, each may be `spec` (every arm but AR) or `xpress` (every K)."""
    every, out = summary(root, folder)["arms"], []
    for a in spec.split(","):
        if a == "spec":
            out += [v for k, v in every.items() if k != "AR"]
        elif a == "xpress":
            out += [v for v in every.values() if v["method"] == "xpress"]
        else:
            out.append(arm(root, folder, a))
    return out


def fmt(v: float, d) -> str:
    return f"{v:.{int(d)}f}"


def end(values: list[float], which: str, d, floor: bool = False) -> str:
    if which not in ("min", "max"):
        raise UsageError(f"readme_numbers: a range's END is min or max, not {which!r}")
    v = min(values) if which == "min" else max(values)
    return str(math.floor(v)) if floor else fmt(v, d)


def tau(a: dict) -> float:
    return a["tau_per_step"]


def tok_s(a: dict) -> float:
    return a["pooled_tok_s"]["mean"]


def sp(a: dict) -> float:
    return a["speedup"]["value"]


# --- one run folder's summary.json -----------------------------------------------------------------------------
def arm_stat(name: str, get, d_one: int, d_end: int) -> None:
    """Two families per statistic: NAME:FOLDER:ARM[:D] (one arm) and NAME_end:FOLDERS:ARMS:END[:D] (a range's end
    over the arms of one folder, or of several, comma-separated)."""
    REGISTRY[name] = lambda root, folder, a, d=d_one: fmt(get(arm(root, folder, a)), d)
    REGISTRY[name + "_end"] = lambda root, folders, spec, which, d=d_end: end(
        [get(x) for f in folders.split(",") for x in arms(root, f, spec)], which, d)


# tau: τ/step; tps: POOLED decode tok/s (mean over measured rounds); sp: Sp., the median over measured rounds of
# the per-round paired speedup over AR.
for _name, _get, _d_one, _d_end in (("tau", tau, 2, 3), ("tps", tok_s, 0, 0), ("sp", sp, 2, 2)):
    arm_stat(_name, _get, _d_one, _d_end)


# sp_e2e: the end-to-end Sp. (TTFT + drafter prefill + decode); be: the break-even τ (the arm's step over AR's)
arm_stat("sp_e2e", lambda a: a["speedup_e2e"]["value"], 2, 2)
arm_stat("be", lambda a: a["break_even_tau"], 2, 2)


@quantity("sp_ci")
def q_sp_ci(root, folder, a, which, d=2):
    """One end (lo or hi) of Sp.'s 95% CI."""
    return fmt(arm(root, folder, a)["speedup"]["ci95"][("lo", "hi").index(which)], d)


def value_or_end(g: dict, value: str, ci: str, which: str, d) -> str:
    """A paired statistic's g[value], or one end (lo, hi) of its CI g[ci]."""
    return fmt(g[value] if which == "value" else g[ci][("lo", "hi").index(which)], d)


@quantity("tau_ratio")
def q_tau_ratio(root, folder, a, which="value", d=3):
    """τ over drafter-only's, paired over prompts (x seeds at T>0): the ratio, or one end (lo, hi) of its CI."""
    return value_or_end(arm(root, folder, a)["tau_gain"], "ratio", "ratio_ci95", which, d)


@quantity("tau_ratio_mean")
def q_tau_ratio_mean(root, folders, a, d=3):
    """The arithmetic mean over FOLDERS (`,`-separated) of an arm's paired τ ratio over drafter-only (issue 26's
    "averaged over the five datasets")."""
    vals = [arm(root, f, a)["tau_gain"]["ratio"] for f in folders.split(",")]
    return fmt(sum(vals) / len(vals), d)


@quantity("xgain")
def q_xgain(root, folder, a, which="value", d=3):
    """An arm's throughput over drafter-only's (the median over rounds of the per-round paired ratio, the tables'
    "x gain"): the value, or one end (lo, hi) of its paired 95% CI over prompts and rounds."""
    return value_or_end(arm(root, folder, a)["gain"], "value", "ci95", which, d)


@quantity("tau_vs_markov")
def q_tau_vs_markov(root, folder, a="x1", which="value", d=3):
    """An xPress arm's τ over Markov's, paired over prompts (x seeds at T>0; summary.json's tau_order): the ratio,
    or one end (lo, hi) of its 95% CI."""
    name = arm(root, folder, a)["arm"]
    order = summary(root, folder)["tau_order"]
    return value_or_end(next(x for x in order["xpress"] if x["arm"] == name)["vs_markov"], "ratio", "ratio_ci95",
                        which, d)


@quantity("ref_identical_of")
def q_ref_identical_of(root, folder, sep="/"):
    """AR's rows equal to the reference-dtype AR's (fp32), over rows compared: "10/35"."""
    m = arm(root, folder, "ar")["reference_match"]
    return f"{m['rows_identical']}{' of ' if sep == 'of' else sep}{m['rows_compared']}"


def _ref_gaps(root, folders: str) -> list[float]:
    return [d["gap"] for f in folders.split(",") for d in arm(root, f, "ar")["reference_match"]["first_divergence"]
            if d.get("gap") is not None]


@quantity("ref_gap_end")
def q_ref_gap_end(root, folders, which, d=2):
    """One end of the top-2 logit gaps at AR's first divergences from the fp32 AR, over FOLDERS."""
    return end(_ref_gaps(root, folders), which, d)


@quantity("ref_divergences")
def q_ref_divergences(root, folders):
    """How many of AR's first divergences from the fp32 AR FOLDERS record, all with a measured gap."""
    return str(len(_ref_gaps(root, folders)))


@quantity("beyond_bound")
def q_beyond_bound(root, folders):
    """First divergences (AR against fp32, every arm against AR) whose gap exceeds the dtype's near-tie bound."""
    n = 0
    for f in folders.split(","):
        for a in summary(root, f)["arms"].values():
            for m in (a.get("reference_match"), a.get("token_match")):
                n += sum(1 for x in (m or {}).get("first_divergence", []) if x.get("near_tie") is False)
    return str(n)


@quantity("gain")
def q_gain(root, folder, a, d=1):
    """τ/step over drafter-only's, as a signed percentage ("+6.6%" prints "+6.6", the % is prose)."""
    return f"{100 * (tau(arm(root, folder, a)) / tau(arm(root, folder, 'drafter')) - 1):+.{int(d)}f}"


@quantity("best_gain")
def q_best_gain(root, folder, d=1):
    """The best xPress τ/step (over K) over drafter-only's, signed percentage."""
    best = max(tau(a) for a in arms(root, folder, "xpress"))
    return f"{100 * (best / tau(arm(root, folder, 'drafter')) - 1):+.{int(d)}f}"


@quantity("best_gain_end")
def q_best_gain_end(root, folders, which, d=1):
    """One end of the best xPress τ gain over drafter-only (unsigned percent) over FOLDERS (`,`-separated)."""
    vals = [100 * (max(tau(a) for a in arms(root, f, "xpress")) / tau(arm(root, f, "drafter")) - 1)
            for f in folders.split(",")]
    return end(vals, which, d)


@quantity("tau_diff_max")
def q_tau_diff_max(root, one, other, d=2):
    """The largest |τ/step difference| between two folders over the arms both have."""
    a, b = summary(root, one)["arms"], summary(root, other)["arms"]
    return fmt(max(abs(tau(a[k]) - tau(b[k])) for k in a if k in b), d)


@quantity("opt_gain_end")
def q_opt_gain_end(root, which, d=2):
    """One end of × Gain (throughput-optimal xPress over drafter-only, Sp.'s statistic) over the ten H200 folders."""
    vals = []
    for f in H200:
        s = summary(root, f)
        vals.append(s["arms"][s["optimal"]["xpress"]["arm"]]["gain"]["value"])
    return end(vals, which, d)


@quantity("opt_k")
def q_opt_k(root, folders="h200"):
    """The throughput-optimal xPress K, when every folder chose the same one."""
    ks = {summary(root, f)["optimal"]["xpress"]["K"] for f in (H200 if folders == "h200" else folders.split(","))}
    return str(ks.pop()) if len(ks) == 1 else "/".join(map(str, sorted(ks)))


@quantity("per_step_tps")
def q_per_step_tps(root, folder, a, d=0):
    """tok/s ÷ τ: the arm's steps per second."""
    x = arm(root, folder, a)
    return fmt(tok_s(x) / tau(x), d)


@quantity("per_step_drop")
def q_per_step_drop(root, before, after, a, d=0):
    """How far tok/s ÷ τ falls from one folder to another, in percent."""
    b, c = arm(root, before, a), arm(root, after, a)
    return fmt(100 * (1 - (tok_s(c) / tau(c)) / (tok_s(b) / tau(b))), d)


@quantity("tps_cost")
def q_tps_cost(root, before, after, a, d=1):
    """How much lower an arm's tok/s is in one folder than in another, in percent."""
    return fmt(100 * (1 - tok_s(arm(root, after, a)) / tok_s(arm(root, before, a))), d)


@quantity("pos")
def q_pos(root, folder, a, k, d=1):
    """per_position[k] (the share of steps that accepted at least k+1 drafts), in percent."""
    return fmt(100 * arm(root, folder, a)["per_position"][int(k)], d)


@quantity("pos_end")
def q_pos_end(root, folder, spec, k, which, d=0):
    return end([100 * a["per_position"][int(k)] for a in arms(root, folder, spec)], which, d)


# --- token match against AR --------------------------------------------------------------------------------------
def match(root, folder, a) -> dict:
    m = arm(root, folder, a)["token_match"]
    if not m:
        raise UsageError(f"readme_numbers: {folder} {a} has no token match against AR")
    return m


@quantity("identical")
def q_identical(root, folder, a):
    """Rows whose output equals AR's, token for token."""
    return str(match(root, folder, a)["rows_identical"])


@quantity("compared")
def q_compared(root, folder, a):
    return str(match(root, folder, a)["rows_compared"])


@quantity("identical_of")
def q_identical_of(root, folder, a, sep="/"):
    """"30/96": rows identical to AR over rows compared (SEP `of` prints "30 of 96")."""
    m = match(root, folder, a)
    return f"{m['rows_identical']}{' of ' if sep == 'of' else sep}{m['rows_compared']}"


@quantity("identical_all")
def q_identical_all(root, folders, sep="of"):
    """Identical rows of every speculative arm of every FOLDER (`,`-separated): one count when all agree."""
    got = {(match(root, f, n)["rows_identical"], match(root, f, n)["rows_compared"])
           for f in folders.split(",") for n in summary(root, f)["arms"] if n != "AR"}
    return " / ".join(f"{i}{' of ' if sep == 'of' else sep}{c}" for i, c in sorted(got))


@quantity("match_rate")
def q_match_rate(root, folder, a, d=2):
    return fmt(match(root, folder, a)["token_match_rate"], d)


def first_divergence(root, folder, a) -> dict:
    """{question id: first differing token or None} (summary.json lists one entry per prompt)."""
    return {int(e["question_id"]): e["position"] for e in match(root, folder, a)["first_divergence"]}


@quantity("diverged")
def q_diverged(root, folder, a):
    """The prompts (question ids) on which the arm left AR's output, in order, `, `-joined."""
    fd = first_divergence(root, folder, a)
    return ", ".join(str(q) for q in sorted(k for k, v in fd.items() if v is not None))


@quantity("diverged_count")
def q_diverged_count(root, folder, a):
    return str(sum(v is not None for v in first_divergence(root, folder, a).values()))


@quantity("divergence_at")
def q_divergence_at(root, folder, a, q):
    """The token index of the arm's first divergence from AR on prompt Q."""
    return str(first_divergence(root, folder, a)[int(q)])
