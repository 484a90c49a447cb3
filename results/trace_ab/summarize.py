"""Summarise the --trace A/B runs of run_ab.sh: per run, AR and drafter-only ms per step and the speedup, all
recomputed from each run's samples.jsonl.gz with the current report (the same statistic for every run)."""
import json
import sys

import numpy as np
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from harness.protocol.report import summarize  # noqa: E402
from harness.protocol.results_io import read_folder_rows  # noqa: E402


def ms_per_step(rows, arm):
    rows = [r for r in rows if r["arm"] == arm and not r["warmup"]]
    steps = sum(r.get("spec_steps", 0) + r.get("ar_steps", 0) for r in rows)
    return 1000 * sum(r["decode_s"] for r in rows) / steps


def main(out: str) -> None:
    result = {}
    for run in ("before_trace_off", "before_trace_on", "after_trace_off", "after_trace_on"):
        reps = []
        for folder in sorted(Path(out).glob(f"{run}_*/")):
            rows = read_folder_rows(folder)
            sp = summarize(rows, n_boot=1000)["arms"]["drafter-only"]["speedup"]
            reps.append({"AR_ms_per_step": ms_per_step(rows, "AR"),
                         "drafter_only_ms_per_step": ms_per_step(rows, "drafter-only"),
                         "speedup_median": sp["value"], "speedup_ci95": sp["ci95"], "speedup_mean": sp["mean"]})
        result[run] = {"repetitions": reps,
                       **{f"median_{k}": float(np.median([r[k] for r in reps]))
                          for k in ("AR_ms_per_step", "drafter_only_ms_per_step", "speedup_median")}}
    print("| run (median of 3 repetitions) | AR ms/step | drafter-only ms/step | drafter-only Sp. (median of rounds) |")
    print("|---|---|---|---|")
    for run, r in result.items():
        print(f"| {run} | {r['median_AR_ms_per_step']:.3f} | {r['median_drafter_only_ms_per_step']:.3f} | "
              f"{r['median_speedup_median']:.3f} |")
    print()
    print("| run, repetition | AR ms/step | drafter-only ms/step | Sp. [95% CI] |")
    print("|---|---|---|---|")
    for run, r in result.items():
        for i, x in enumerate(r["repetitions"], start=1):
            print(f"| {run} {i} | {x['AR_ms_per_step']:.3f} | {x['drafter_only_ms_per_step']:.3f} | "
                  f"{x['speedup_median']:.3f} [{x['speedup_ci95'][0]:.2f}, {x['speedup_ci95'][1]:.2f}] |")
    (Path(out) / "ab.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
