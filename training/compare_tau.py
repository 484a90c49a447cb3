"""Two acceptance results compared prompt by prompt: one model against another on the same prompts (a drafter
continued against the one it started from), or two arms of one model (xPress K=4 against drafter-only), with a
paired bootstrap CI over the prompts both measured (harness.protocol.metrics.paired_tau_ci).

    python -m training.compare_tau BASE NEW [--set heldout] [--json OUT]

BASE and NEW: FILE or FILE:ARM, FILE an acceptance.json (train/<model>/acceptance.json, or the flat copy
results/perf keeps, <model>_acceptance.json), ARM one of its tau keys (default tau_drafter). Every set both files
measured with per-prompt records (training/acceptance.py per_prompt) is compared unless --set names one. Prompts
pair by position and must be the same prompts (their recorded keys); a capped evaluation measured a prefix of its
set, so the pair uses the shorter. The ratio is NEW's tau over BASE's; a CI that excludes 1 is a difference shown
at 95%, one that includes it is not. Prints one line per set; --json writes them too.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from core.checkpoints import read_json
from core.errors import UsageError, cli_exit


def parse(spec: str) -> tuple[Path, str]:
    file, _, arm = spec.partition(":")
    return Path(file), arm or "tau_drafter"


def pair(base: dict, new: dict, arm_b: str, arm_n: str, name: str) -> dict:
    """The paired comparison of one set; UsageError when the two did not measure the same prompts."""
    from harness.protocol.metrics import paired_tau_ci
    pb, pn = base.get("per_prompt"), new.get("per_prompt")
    for label, pp, arm in (("BASE", pb, arm_b), ("NEW", pn, arm_n)):
        if pp is None:
            raise UsageError(f"compare_tau: {label}'s set {name!r} has no per-prompt records (acceptance.json "
                             f"files written before they were kept cannot be paired)")
        if arm not in pp:
            raise UsageError(f"compare_tau: {label}'s set {name!r} has no arm {arm!r} (it has: "
                             f"{', '.join(sorted(k for k in pp if k != 'keys'))})")
    n = min(len(pb["keys"]), len(pn["keys"]))
    if pb["keys"][:n] != pn["keys"][:n]:
        at = next(i for i in range(n) if pb["keys"][i] != pn["keys"][i])
        raise UsageError(f"compare_tau: set {name!r}: prompt {at} differs between the two files (keys "
                         f"{pb['keys'][at]} and {pn['keys'][at]}): they were measured on different prompts")
    b, m = pb[arm_b][:n], pn[arm_n][:n]
    ci = paired_tau_ci([[t for t, _ in m]], [[s for _, s in m]], [[t for t, _ in b]], [[s for _, s in b]])
    return {"set": name, "prompts": n, "base": sum(t for t, _ in b) / sum(s for _, s in b),
            "new": sum(t for t, _ in m) / sum(s for _, s in m), **ci}


def compare(base_spec: str, new_spec: str, only: str | None = None) -> list[dict]:
    (fb, arm_b), (fn, arm_n) = parse(base_spec), parse(new_spec)
    rb, rn = read_json(fb, "compare_tau: acceptance file"), read_json(fn, "compare_tau: acceptance file")
    sets = [s for s, v in rb.items() if isinstance(v, dict) and "prompts" in v and isinstance(rn.get(s), dict)]
    if only is not None:
        if only not in sets:
            raise UsageError(f"compare_tau: --set {only!r} is not in both files (both have: {', '.join(sets)})")
        sets = [only]
    if not sets:
        raise UsageError(f"compare_tau: {fb} and {fn} share no measured set")
    return [pair(rb[s], rn[s], arm_b, arm_n, s) for s in sets]


def line(r: dict) -> str:
    lo, hi = r["ratio_ci95"]
    verdict = "higher" if lo > 1 else "lower" if hi < 1 else "no difference shown"
    return (f"{r['set']} ({r['prompts']} prompts): {r['base']:.3f} -> {r['new']:.3f}, ratio {r['ratio']:.3f} "
            f"[{lo:.3f}, {hi:.3f}] (paired bootstrap over prompts, 95%): {verdict}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.compare_tau", description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="FILE[:ARM]: the reference (ARM default tau_drafter)")
    p.add_argument("new", help="FILE[:ARM]: compared against it")
    p.add_argument("--set", default=None, help="one set (selection, heldout, bench:<name>); default: every shared one")
    p.add_argument("--json", default=None, help="also write the comparisons to this file")
    args = p.parse_args(argv)

    def work():
        rows = compare(args.base, args.new, args.set)
        for r in rows:
            print(line(r))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return cli_exit(work)


if __name__ == "__main__":
    sys.exit(main())
