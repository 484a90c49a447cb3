"""Two acceptance results compared prompt by prompt: one model against another on the same prompts (a drafter
continued against the one it started from), or two arms of one model (xPress K=4 against drafter-only), with a
paired bootstrap CI over the prompts both measured (harness.protocol.metrics.paired_tau_ci).

    python -m training.compare_tau BASE NEW [--set heldout] [--json OUT]

BASE and NEW: FILE or FILE:ARM, FILE an acceptance.json (train/<model>/acceptance.json, or the flat copy
results/perf keeps, <model>_acceptance.json), ARM one of its tau keys (default tau_drafter). Every set both files
measured with per-prompt records (training/acceptance.py per_prompt) is compared unless --set names one. Prompts
pair by position and must be the same prompts (their recorded keys); a capped evaluation measured a prefix of its
set, so the pair uses the shorter. Records decoded in another dtype, or with and without CUDA graphs, are refused.
The ratio is NEW's tau over BASE's; a CI that excludes 1 is a difference shown at 95%, one that includes it is not.
Prints one line per set; --json writes them too.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from core.checkpoints import read_json
from core.errors import Parser, UsageError, cli_exit
from core.json_out import write_json_arg


ARM = re.compile(r"tau_\w+")


def parse(spec: str) -> tuple[Path, str]:
    """FILE or FILE:ARM. A FILE that exists is taken whole (its name may hold a colon); else ARM is what follows the
    last colon and must be a tau key, and a colon followed by no path is a misspelt arm."""
    if Path(spec).exists():
        return Path(spec), "tau_drafter"
    file, sep, arm = spec.rpartition(":")
    if sep and ARM.fullmatch(arm):
        return Path(file), arm
    if sep and "/" not in arm:
        raise UsageError(f"compare_tau: {spec!r}: the arm after ':' must be a tau key (tau_drafter, tau_markov, "
                         f"tau_xpress_K<k>), got {arm!r}")
    return Path(spec), "tau_drafter"


def pair(base: dict, new: dict, arm_b: str, arm_n: str, name: str) -> dict:
    """The paired comparison of one set; UsageError when the two did not measure the same prompts."""
    from harness.protocol.metrics import paired_tau_ci
    pb, pn = base.get("per_prompt"), new.get("per_prompt")
    for label, pp, arm in (("BASE", pb, arm_b), ("NEW", pn, arm_n)):
        if pp is None:
            raise UsageError(f"compare_tau: {label}'s set {name!r} has no per-prompt records (acceptance.json "
                             f"files written before they were kept cannot be paired)")
        if arm not in pp or arm == "keys":
            raise UsageError(f"compare_tau: {label}'s set {name!r} has no arm {arm!r} (it has: "
                             f"{', '.join(sorted(k for k in pp if k != 'keys'))})")
    n = min(len(pb["keys"]), len(pn["keys"]))
    if n == 0:
        raise UsageError(f"compare_tau: set {name!r}: one of the two measured no prompt")
    if pb["keys"][:n] != pn["keys"][:n]:
        at = next(i for i in range(n) if pb["keys"][i] != pn["keys"][i])
        raise UsageError(f"compare_tau: set {name!r}: prompt {at} differs between the two files (keys "
                         f"{pb['keys'][at]} and {pn['keys'][at]}): they were measured on different prompts")
    b, m = pb[arm_b][:n], pn[arm_n][:n]
    if not sum(st for _, st in b) or not sum(st for _, st in m):
        raise UsageError(f"compare_tau: set {name!r}: an arm decoded no step on its {n} prompts (no tau to compare)")
    ci = paired_tau_ci([[t for t, _ in m]], [[s for _, s in m]], [[t for t, _ in b]], [[s for _, s in b]])
    return {"set": name, "prompts": n, "arms": [arm_b, arm_n], "base": sum(t for t, _ in b) / sum(s for _, s in b),
            "new": sum(t for t, _ in m) / sum(s for _, s in m), **ci}


def compare(base_spec: str, new_spec: str, only: str | None = None) -> list[dict]:
    """One comparison per set both files measured (or `only`); sets in one file alone are named in `skipped`."""
    from training.evaluate import measured
    (fb, arm_b), (fn, arm_n) = parse(base_spec), parse(new_spec)
    rb, rn = read_json(fb, "compare_tau: acceptance file"), read_json(fn, "compare_tau: acceptance file")
    for key in ("dtype", "cuda_graphs"):  # the decode's numerics: a bf16 tau and an fp32 one do not pair
        if key in rb and key in rn and rb[key] != rn[key]:
            raise UsageError(f"compare_tau: the two files decoded with different {key} ({rb[key]} and {rn[key]}); "
                             f"compare records made the same way")
    sets = [s for s in measured(rb) if s in measured(rn)]
    skipped = sorted(set(measured(rb)) ^ set(measured(rn)))
    if only is not None:
        if only not in sets:
            raise UsageError(f"compare_tau: --set {only!r} is not in both files (both have: "
                             f"{', '.join(sets) or 'none'})")
        sets, skipped = [only], []
    if not sets:
        raise UsageError(f"compare_tau: {fb} and {fn} share no measured set")
    return [{**pair(rb[s], rn[s], arm_b, arm_n, s), **({"skipped": skipped} if skipped else {})} for s in sets]


def line(r: dict) -> str:
    from harness.protocol.ci_text import verdict
    lo, hi = r["ratio_ci95"]
    arms = f"{r['arms'][0]} -> {r['arms'][1]}" if r["arms"][0] != r["arms"][1] else r["arms"][0]
    return (f"{r['set']} ({r['prompts']} prompts, {arms}): {r['base']:.3f} -> {r['new']:.3f}, ratio {r['ratio']:.3f} "
            f"[{lo:.3f}, {hi:.3f}] (paired bootstrap over prompts, 95%): {verdict(r['ratio_ci95'])}")


def main(argv=None) -> int:
    p = Parser(prog="python -m training.compare_tau", description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="FILE[:ARM]: the reference (ARM default tau_drafter)")
    p.add_argument("new", help="FILE[:ARM]: compared against it")
    p.add_argument("--set", default=None, help="one set (selection, heldout, bench:<name>); default: every shared one")
    p.add_argument("--json", default=None, help="also write the comparisons to this file")
    args = p.parse_args(argv)

    def work():
        rows = compare(args.base, args.new, args.set)
        if args.json:
            write_json_arg(args.json, rows, "compare_tau")
        for r in rows:
            print(line(r))
        if rows[0].get("skipped"):
            print(f"not compared (measured in one file only): {', '.join(rows[0]['skipped'])}")
    return cli_exit(work)


if __name__ == "__main__":
    sys.exit(main())
