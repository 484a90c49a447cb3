"""Where two greedy decodes of the same prompt part: is the first divergence a near-tie of the logits, or a bug?

Two greedy runs (an arm and AR, or AR in the run's dtype and AR in float32) that agree up to position d and pick
different tokens there, a in run A and b in run B, computed the same logits twice with different rounding. Each
record of a divergence holds both runs' top-2 logit gaps at d and their largest logit (the untimed replay,
harness.protocol.replays, measures them; none of it runs inside a timer).

The bound (a heuristic; see NEAR_TIE_ULPS). Write L for the exact logits of the shared prefix and e_A, e_B for
each run's largest error on a logit. Run A chose a, so gap_A <= L_A(a) - L_A(b) <= L(a) - L(b) + 2 e_A; run B chose
b, so gap_B <= L(b) - L(a) + 2 e_B. Adding them: gap_A + gap_B <= 2 (e_A + e_B), whatever L is. The recorded gap of
a divergence is therefore gap_A + gap_B, and a divergence is a near-tie when it is at most
2 (e_A + e_B). The error e of a run is taken as NEAR_TIE_ULPS units in the last place of the run's dtype at its
largest logit's magnitude: the logits are an fp32 accumulation rounded once to the dtype (half an ulp) from a
final-norm output that was itself rounded to the dtype (relative error half an ulp per element; its effect on a
logit is taken as another half ulp, i.e. assuming the per-element errors do not add up coherently over the hidden
size). That covers the final norm and matmul only: the layers' accumulated rounding, which differs between a
verify block and a single-token step, has no simple bound. So the bound is a heuristic: a divergence above it is
not proven to be a bug, but the rounding of the last layer cannot explain it, and it is reported as a bug report
to investigate, never as a footnote.

For AR against a reference dtype (float32) the layers' rounding is the larger part, so the reference records
beside the bound what that rounding does to a gap on the same text: at every position before the first divergence
the two runs chose the same token from the same context, and |gap_A - gap_B| there is the dtype's error on a top-2
gap (gap_error: its maximum and the positions it was taken over). stats pools it over a comparison's prompts, and a
divergence beyond the bound that is also beyond the largest such error measured in the same run says so in its bug
report (the flag itself stays the bound's).
"""
from __future__ import annotations

import math
import statistics

import torch

NEAR_TIE_ULPS = 1.0  # e per run, in ulps of its dtype at its largest logit (half for the matmul, half for the norm)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def ulp(magnitude: float, dtype: str) -> float:
    """The spacing of `dtype` at |magnitude| (its machine epsilon times the power of two at or below it)."""
    eps = torch.finfo(DTYPES[dtype]).eps
    m = abs(magnitude)
    return eps * (2.0 ** math.floor(math.log2(m)) if m > 0 else 1.0)


def bound(top: float, dtype: str, top_ref: float, dtype_ref: str) -> float:
    """The largest gap_A + gap_B the final rounding of the two runs explains: 2 (e_A + e_B) (module docstring)."""
    return 2 * NEAR_TIE_ULPS * (ulp(top, dtype) + ulp(top_ref, dtype_ref))


def record(position: int, one: tuple[float, float] | None, ref: tuple[float, float] | None, dtype: str,
           dtype_ref: str, replay_ok: bool = True) -> dict:
    """A divergence at `position`: each run's (top-2 gap, largest logit) there (None: not measured), the summed gap,
    the bound and whether the gap is within it (near_tie; None when unmeasured)."""
    out = {"position": position, "dtype": dtype, "dtype_ref": dtype_ref, "replay_ok": replay_ok,
           "gap_arm": None, "gap_ref": None, "top_arm": None, "top_ref": None, "gap": None, "bound": None,
           "near_tie": None}
    if one is not None and ref is not None and replay_ok:
        gap = one[0] + ref[0]
        b = bound(one[1], dtype, ref[1], dtype_ref)
        out.update(gap_arm=one[0], gap_ref=ref[0], top_arm=one[1], top_ref=ref[1], gap=gap, bound=b,
                   near_tie=gap <= b)
    return out


def gap_error(gaps: list[float], gaps_ref: list[float]) -> dict:
    """Two runs' top-2 gaps at the positions where both chose the same token from the same context (before their
    first divergence): the largest |difference| (gap_err_max; None without a position) over gap_err_n positions."""
    errs = [abs(a - b) for a, b in zip(gaps, gaps_ref)]
    return {"gap_err_max": float(f"{max(errs):.6g}") if errs else None, "gap_err_n": len(errs)}


def stats(entries: list[dict]) -> dict:
    """Over one arm's first divergences (one per prompt): how many were measured, the median and maximum summed
    gap, every divergence that is no near-tie (a bug report) or could not be measured, and where the entries carry
    it, the largest gap error measured before them (gap_err_max over gap_err_n positions, pooled) with the bug
    reports beyond it too (beyond_measured)."""
    measured = [e for e in entries if e.get("gap") is not None]
    gaps = [e["gap"] for e in measured]
    errs = [e["gap_err_max"] for e in entries if e.get("gap_err_max") is not None]
    err = max(errs) if errs else None
    flagged = [e for e in measured if not e["near_tie"]]
    return {"divergences": len(entries), "measured": len(measured),
            "gap_median": statistics.median(gaps) if gaps else None, "gap_max": max(gaps) if gaps else None,
            "not_near_tie": flagged,
            "unmeasured": [e.get("question_id") for e in entries if e.get("gap") is None],
            "gap_err_max": err, "gap_err_n": sum(e.get("gap_err_n") or 0 for e in entries),
            "beyond_measured": None if err is None else sum(e["gap"] > err for e in flagged)}


def convention() -> str:
    return ("divergence: at T=0 the untimed replay after the measured rounds re-decodes, up to its first divergence "
            "from AR, every turn-0 row whose text differs from AR's of the same round (and AR with it), recording the "
            "target's top-2 logit gap and largest logit there in both runs; gap = the two runs' top-2 gaps added; a "
            f"divergence is a near-tie when gap <= 2 (e_A + e_B), e = {NEAR_TIE_ULPS:g} ulp of the run's dtype at "
            "its largest logit (half an ulp for rounding lm_head's fp32 accumulation, half for the final norm's "
            "rounded output). A heuristic: the layers' accumulated rounding is not covered; a divergence above the "
            "bound is printed as a BUG REPORT. reference_match: AR against a greedy reference of the same prompts in "
            "--reference-dtype (float32; AR's text scored teacher-forced, the same as a decode through the first "
            "divergence) after the measured rounds, untimed, with the same gaps, and gap_err_max: the largest "
            "|difference| of the two runs' top-2 gaps at the positions before the first divergence (both chose the "
            "same token there), the dtype's measured error on a gap, which a bug report beyond the bound is "
            "compared with")


def _g(x) -> str:
    return "-" if x is None else f"{x:.3g}"


SCRIPTED_NOTE = ("scripted acceptance (--scripted-accept) forces the drafts through, so the arms' text differs from "
                 "AR's by design: identity to AR is not checked (AR against its reference still is)")


SAMPLED_NOTE = ("sampled (T > 0): lossless speculative sampling gives AR's distribution, not its text, so identity to "
                "AR is not checked (the goodness-of-fit tests check the distribution; an arm against its own "
                "reference still is)")


def scripted(summary: dict) -> bool:
    """The run forced its acceptance (--scripted-accept): an arm that leaves AR's text is expected, not a bug."""
    return (summary.get("run") or {}).get("scripted_accept") is not None


def sampled(summary: dict) -> bool:
    """A run at T > 0: its arms' texts differ from AR's by design (SAMPLED_NOTE)."""
    return bool(summary.get("temperature"))


def unchecked(summary: dict) -> str | None:
    """Why identity to AR is not checked in this run (None: it is)."""
    return SCRIPTED_NOTE if scripted(summary) else SAMPLED_NOTE if sampled(summary) else None


def _comparisons(summary: dict):
    """(arm, against, the comparison dict) for every token_match and reference_match of the summary; no
    token_match under scripted acceptance or at T > 0 (`unchecked`)."""
    for name, s in summary["arms"].items():
        if s.get("token_match") and unchecked(summary) is None:
            yield name, s["token_match"]["ref"], s["token_match"]
        if s.get("reference_match"):
            rm = s["reference_match"]
            yield name, f"{name} in {rm['dtype']}" + (" (the same run)" if rm.get("same_run") else ""), rm


def bug_reports(summary: dict) -> list[str]:
    """The console's lines: one per divergence whose gap exceeds the near-tie bound (the rounding of the logits
    cannot explain it); under scripted acceptance one SCRIPTED_NOTE line first instead of the arms' comparisons
    with AR."""
    note = [f"[divergence] {SCRIPTED_NOTE}"] if scripted(summary) and any(
        s.get("token_match") for s in summary["arms"].values()) else []
    return note + _bugs(summary)


def _bugs(summary: dict) -> list[str]:
    """The BUG REPORT lines alone (bug_reports without its note)."""
    out = []
    for name, against, c in _comparisons(summary):
        d = c.get("divergence") or {}
        err = d.get("gap_err_max")
        for e in d.get("not_near_tie", []):
            measured = "" if err is None else (
                f"; {'beyond' if e['gap'] > err else 'within'} the largest gap error measured before this "
                f"comparison's divergences, {_g(err)} over {d['gap_err_n']} positions")
            out.append(f"BUG REPORT: {name} left {against} on prompt {e['question_id']} (round {e.get('round')}) at "
                       f"token {e['position']} with top-2 gaps {_g(e['gap_arm'])} + {_g(e['gap_ref'])} = "
                       f"{_g(e['gap'])} > the near-tie bound {_g(e['bound'])} ({e['dtype']} vs {e['dtype_ref']}, top "
                       f"logits {_g(e['top_arm'])} / {_g(e['top_ref'])}{measured}): not a rounding tie of the last "
                       "layer; investigate")
    return out


def markdown(summary: dict) -> list[str]:
    """table.md's divergence section: per comparison, rows identical, the median / max gap at the first
    divergences, how many exceed the near-tie bound, and every bug report (empty when nothing was compared)."""
    rows = list(_comparisons(summary))
    why = unchecked(summary)
    note = ["", f"Divergence from AR: {why}."] if why else []
    if not rows:
        return note
    lines = ["", "**Divergence from AR** (T=0; gap = the two runs' top-2 logit gaps added at each prompt's first "
             "divergence, turn 0; near-tie bound = 2 (e_A + e_B), e = "
             f"{NEAR_TIE_ULPS:g} ulp of the run's dtype at its top logit: a heuristic, see README.md)", "",
             "| arm | against | rows identical | divergences (gap measured) | median gap | max gap | beyond bound |",
             "|---|---|---|---|---|---|---|"]
    for name, against, c in rows:
        d = c.get("divergence") or {}
        flag = len(d.get("not_near_tie", []))
        lines.append(f"| {name} | {against} | {c['rows_identical']}/{c['rows_compared']} | "
                     f"{d.get('divergences', 0)} ({d.get('measured', 0)}) | {_g(d.get('gap_median'))} | "
                     f"{_g(d.get('gap_max'))} | {'**' + str(flag) + ' BUG**' if flag else '0'} |")
    for name, against, c in rows:
        d = c.get("divergence") or {}
        if d.get("gap_err_max") is not None:
            lines.append(f"\n{name} vs {against}: the largest difference of the two runs' top-2 gaps where they "
                         f"chose the same token (before each first divergence) is {_g(d['gap_err_max'])}, over "
                         f"{d['gap_err_n']} positions (the dtype's measured error on a gap); of the "
                         f"{len(d.get('not_near_tie', []))} divergence(s) beyond the near-tie bound, "
                         f"{d['beyond_measured']} exceed it too.")
    unmeasured = [f"{name} vs {against}: {len(c['divergence']['unmeasured'])}" for name, against, c in rows
                  if (c.get("divergence") or {}).get("unmeasured")]
    if unmeasured:
        lines.append(f"\ndivergences without a measured gap (no replay record: rows from an older run, T>0, or a "
                     f"replay that left the decode): {', '.join(unmeasured)}")
    bugs = _bugs(summary)
    return note + lines + (["", *[f"- **{b}**" for b in bugs]] if bugs else [])
