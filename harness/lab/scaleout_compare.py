"""The scale-out checks of one N-GPU run against the same run on one GPU (harness/lab/scaleout_run.sh runs both):

- the AR step of every rank of the N-GPU run within TOLERANCE of each other (max / min - 1) and of the one-GPU
  run's AR step;
- the wall time of each run (measured by the caller around the whole launcher command: start-up, model build,
  warmup, rounds, merge) and their ratio;
- each rank's SM clock before and after the timed rounds (env.json), where a throttled GPU shows.

    python -m harness.lab.scaleout_compare --multi RUN_N --single RUN_1 --wall-multi S --wall-single S --out F.md

The AR step is 1000 / the AR arm's POOLED tok/s over the rank's prompts (turn 0, measured rounds): one decode step
of the target per token. Exit status 1 when a check fails.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from core.errors import Parser
from harness.protocol.tables import run_labels

TOLERANCE = 0.03


def _load(folder: str) -> tuple[dict, dict]:
    path = Path(folder)
    return (json.loads((path / "summary.json").read_text()), json.loads((path / "env.json").read_text()))


def _ranks(summary: dict) -> list[dict]:
    if not summary.get("ranks"):
        raise SystemExit("error: no per-rank section in the summary; was the run launched by torchrun?")
    return summary["ranks"]["ranks"]


def _clock(gpu: dict | None) -> str:
    smi = (gpu or {}).get("smi") or {}
    sm, top = smi.get("clocks.sm [MHz]"), smi.get("clocks.max.sm [MHz]")
    return "-" if sm is None else f"{sm:.0f}/{top:.0f} MHz" if top else f"{sm:.0f} MHz"


def compare(multi: str, single: str, wall_multi: float, wall_single: float) -> tuple[str, dict, bool]:
    sm, em = _load(multi)
    ss, es = _load(single)
    ranks = _ranks(sm)
    steps = [r["ar_step_ms"] for r in ranks]
    one = [r["ar_step_ms"] for r in _ranks(ss)] if ss.get("ranks") else [1000 / ss["arms"][ss["reference_arm"]]
                                                                           ["pooled_tok_s"]["mean"]]
    spread = max(steps) / min(steps) - 1
    vs_one = [s / one[0] - 1 for s in steps]
    checks = {f"per-rank AR step within {TOLERANCE:.0%} of each other": spread <= TOLERANCE,
              f"every rank's AR step within {TOLERANCE:.0%} of the one-GPU AR step": all(
                  abs(v) <= TOLERANCE for v in vs_one)}
    env_ranks = {e["rank"]: e for e in em.get("ranks", [])}
    lines = [f"# Scale-out: {len(ranks)} GPUs against one", "",
             f"{'; '.join(run_labels(sm)) or 'measured weights'}; {sm['prompts']} prompts, arms {list(sm['arms'])}, rounds "
             f"{sm['rounds']['all']} (warmup {sm['rounds']['warmup']} excluded); folders `{multi}` and `{single}`.",
             "", "| run | rank | GPU | prompts | AR step ms | vs one GPU | loop s | SM clock before -> after |",
             "|---|---|---|---|---|---|---|---|"]
    for r, v in zip(ranks, vs_one):
        e = env_ranks.get(r["rank"], {})
        lines.append(f"| {len(ranks)} GPUs | {r['rank']} | {r['gpu'] or '-'} | {r['prompts']} | {r['ar_step_ms']:.4f} | "
                     f"{100 * v:+.2f}% | {r['loop_s']:.1f} | {_clock(e.get('gpu_before'))} -> "
                     f"{_clock(e.get('gpu_after'))} |")
    e1 = (es.get("ranks") or [{}])[0]
    loop1 = ((ss.get("ranks") or {}).get("ranks") or [{}])[0].get("loop_s")
    lines.append(f"| 1 GPU | 0 | {(e1.get('gpu_before') or {}).get('name', '-')} | "
                 f"{ss['prompts']} | {one[0]:.4f} | ref | {'-' if loop1 is None else f'{loop1:.1f}'} | "
                 f"{_clock(e1.get('gpu_before'))} -> {_clock(e1.get('gpu_after'))} |")
    lines += ["", f"- AR step spread over the ranks (max / min - 1): {100 * spread:.2f}%",
              f"- wall time (whole launcher command): {len(ranks)} GPUs {wall_multi:.1f} s, one GPU {wall_single:.1f} s,"
              f" ratio {wall_single / wall_multi:.2f}x",
              *[f"- {name}: {'PASS' if ok else 'FAIL'}" for name, ok in checks.items()]]
    data = {"multi": multi, "single": single, "ar_step_ms": steps, "ar_step_ms_one_gpu": one[0], "spread": spread,
            "vs_one_gpu": vs_one, "wall_s": {"multi": wall_multi, "single": wall_single}, "checks": checks}
    return "\n".join(lines) + "\n", data, all(checks.values())


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m harness.lab.scaleout_compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--multi", required=True, help="results folder of the N-GPU run")
    p.add_argument("--single", required=True, help="results folder of the one-GPU run")
    p.add_argument("--wall-multi", type=float, required=True, help="seconds the N-GPU command took")
    p.add_argument("--wall-single", type=float, required=True, help="seconds the one-GPU command took")
    p.add_argument("--out", help="write the markdown here (and the numbers beside it as .json)")
    ns = p.parse_args(argv)
    text, data, ok = compare(ns.multi, ns.single, ns.wall_multi, ns.wall_single)
    sys.stdout.write(text)
    if ns.out:
        Path(ns.out).write_text(text)
        Path(ns.out).with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
