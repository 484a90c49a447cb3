"""What a τ goal asks of the draft's later slots, read from a table's committed acceptance per position.

A step accepts drafts 1..k with the rate a_k (summary.json's `per_position`, non-increasing), and τ per step is
1 + sum_k a_k. Write a_k = a_1 c^(k-1): c is the one conditional rate (slot k accepted, given slots 1..k-1 were)
that gives the arm's measured τ with its own first slot; solved here by bisection, it summarises how well an arm
continues a block once its first draft is right. A refiner of the later slots leaves a_1 nearly where the drafter
had it (xPress refines a slot from the tokens before it, and the first one's is the verified token), so a goal
"τ = R x drafter-only" asks for the c that gives (R x τ_drafter - 1) with the refined arm's a_1; the share of
the drafter's later-slot rejections (1 - c) it must remove is 1 - (1 - c_goal) / (1 - c_drafter), set beside the
share the arm removed (a cut of a fitted conditional rate, not a count: a step has one rejection at most). A goal
above 1 + (B-1) a_1 cannot be reached without a better first slot: reported as such.

    python -m harness.lab.tau_needs results/smollm2-135m/gsm8k_t0 ... --goal 1.30 --arm "xPress(K=4)" --out FILE

It models the positions, it does not measure anything new: every number it prints is a function of the tables'
own per-position rates (the real arms' a_k need not be geometric; c is the geometric rate with the same sum).
"""
from __future__ import annotations

import sys
from pathlib import Path

from core.checkpoints import read_json
from core.errors import Parser, UsageError, cli_exit

REFERENCE = "drafter-only"


def continued(a1: float, c: float, slots: int) -> float:
    """sum_k a_k for a_k = a1 c^(k-1), k = 1..slots: the accepted drafts per step."""
    return a1 * sum(c ** k for k in range(slots))


def rate_for(a1: float, accepted: float, slots: int) -> float | None:
    """The c in [0, 1] with continued(a1, c, slots) == accepted; None where no c gives it: even c = 1 falls short,
    or the first slot alone already accepts more (accepted < a1)."""
    if a1 <= 0 or accepted > continued(a1, 1.0, slots) * (1 + 1e-12) or accepted < a1 * (1 - 1e-12):
        return None
    lo, hi = 0.0, 1.0
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if continued(a1, mid, slots) < accepted else (lo, mid)
    return (lo + hi) / 2


def needs(summary: dict, goal: float, arm: str, table: str = "") -> dict:
    """One table's rows: each arm's a_1, c and τ; the c and rejection cut `goal` x drafter-only asks with `arm`'s
    a_1, and what `arm` achieved."""
    arms = summary.get("arms") if isinstance(summary.get("arms"), dict) else {}
    rows = {}
    for name, a in arms.items():
        pp = a.get("per_position") if isinstance(a, dict) else None
        if not pp or pp[0] is None or a.get("tau_per_step") is None:
            continue
        slots, a1, tau = len(pp), float(pp[0]), float(a["tau_per_step"])
        rows[name] = {"a1": a1, "tau": tau, "c": rate_for(a1, tau - 1, slots)}
    for name in (REFERENCE, arm):
        if name not in rows:
            raise UsageError(f"tau_needs: {table or 'the table'} has no per-position acceptance and tau for arm "
                             f"{name!r} (arms with both: {', '.join(rows) or 'none'}); name one with --arm")
    ref, own = rows[REFERENCE], rows[arm]
    slots = len(arms[arm]["per_position"])
    c_goal = rate_for(own["a1"], goal * ref["tau"] - 1, slots)
    cut = (lambda c: None if c is None or ref["c"] is None or ref["c"] >= 1 else 1 - (1 - c) / (1 - ref["c"]))
    return {"table": table, "dataset": summary.get("dataset"), "temperature": summary.get("temperature"),
            "slots": slots, "goal": goal, "arm": arm, "arms": rows, "tau_goal": goal * ref["tau"],
            "c_goal": c_goal, "reachable": c_goal is not None,
            "ceiling_tau": 1 + continued(own["a1"], 1.0, slots),
            "rejection_cut_goal": cut(c_goal), "rejection_cut_arm": cut(own["c"])}


def fmt(x: float | None, d: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{d}f}"


def markdown(rows: list[dict]) -> str:
    goal, arm = rows[0]["goal"], rows[0]["arm"]
    out = [f"What τ = {goal} x drafter-only asks of the later slots, with {arm}'s first slot (harness/lab/tau_needs.py; "
           "c: the one conditional rate of slots 2.. that gives the arm's τ with its own first-slot rate a1; a cut: "
           "the share of drafter-only's later-slot rejections 1 - c removed)", "",
           f"| table | drafter-only a1 | drafter-only c | {arm} a1 | {arm} c | {arm} τ ratio | c for the goal | "
           "rejections cut: the arm | rejections cut: the goal |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref, own = r["arms"][REFERENCE], r["arms"][r["arm"]]
        goal_c = fmt(r["c_goal"]) if r["reachable"] else (
            f"unreachable (ceiling τ {r['ceiling_tau']:.2f})" if r["tau_goal"] > r["ceiling_tau"] else
            "n/a (the first slot alone gives more)")
        out.append(f"| {r['table']} | {fmt(ref['a1'])} | {fmt(ref['c'])} | {fmt(own['a1'])} | {fmt(own['c'])} | "
                   f"{own['tau'] / ref['tau']:.3f} | {goal_c} | {fmt(r['rejection_cut_arm'])} | "
                   f"{fmt(r['rejection_cut_goal'])} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m harness.lab.tau_needs", description=__doc__.split("\n\n")[0])
    p.add_argument("tables", nargs="+", help="table folders (each with summary.json)")
    p.add_argument("--goal", type=float, default=1.30, help="τ over drafter-only to ask for (default 1.30)")
    p.add_argument("--arm", default="xPress(K=4)", help="the refined arm, as summary.json names it")
    p.add_argument("--out", help="write JSON here and markdown beside it (.md)")
    a = p.parse_args(argv)

    def work():
        if not a.goal > 0:
            raise UsageError(f"--goal {a.goal}: give a ratio > 0, e.g. 1.30")
        summaries = [read_json(Path(t) / "summary.json", "tau_needs: a table folder's") for t in a.tables]
        rows = [needs(s, a.goal, a.arm, Path(t).name) for s, t in zip(summaries, a.tables)]
        text = markdown(rows)
        print(text, end="")
        if a.out:
            from harness.protocol.results_io import write_record
            write_record(a.out, {"what": "tau_needs: the later slots' conditional rate a tau goal asks",
                                 "tables": [str(t) for t in a.tables], "rows": rows}, text)
    return cli_exit(work)


if __name__ == "__main__":
    sys.exit(main())
