"""The --trace A/B in one process, paired: for each (repetition, prompt, arm) the three ways of decoding run back
to back in rotated order, so the load of a shared machine cancels in the paired ratios.

    OMP_NUM_THREADS=1 python3 results/trace_ab/ab_inprocess.py [--reps 20] [--out results/trace_ab/inprocess.json]

- untraced:            generate(on_step=None), what an untraced run times;
- traced, before:      generate(on_step=tracer), the tracer inside the timer (the runner before issue 13);
- traced, after:       harness.protocol.trace.timed_then_traced, the decode timed untraced then replayed untimed
                       with the tracer (the runner now).
Random weights (tiny preset), scripted acceptance 3, 64 new tokens, CPU, float32. Reports per arm the median
ms per step of each way and the median over pairs of (traced / untraced) per step.
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from core.devices import Backend  # noqa: E402
from harness.decode.loop import DecodeSettings, generate  # noqa: E402
from harness.protocol.presets import build_random  # noqa: E402
from harness.protocol.trace import StepTracer, timed_then_traced  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    ns = ap.parse_args()
    b = Backend(torch.device("cpu"), torch.float32)
    models = build_random("tiny", b, block_size=16, capacity=256, seed=0)
    s = DecodeSettings(64, 1024, (), scripted_accept=3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 500, (int(n),), generator=g).tolist() for n in torch.randint(8, 40, (8,), generator=g)]
    tracer = StepTracer(tempfile.mktemp(suffix=".jsonl"))
    ways = ("untraced", "traced, before", "traced, after")
    ms = {arm: {w: [] for w in ways} for arm in ("AR", "drafter-only")}
    for rep in range(ns.reps):
        for i, prompt in enumerate(prompts):
            for arm, drafter in (("AR", None), ("drafter-only", models.drafter)):
                decode = lambda gen, cb: generate(models.target, prompt, s, b, drafter=drafter, generator=gen,
                                                  on_step=cb)
                order = ways[(rep + i) % 3:] + ways[:(rep + i) % 3]
                for w in order:
                    if w == "untraced":
                        res = decode(b.generator(0), None)
                    elif w == "traced, before":
                        res = decode(b.generator(0), tracer)
                    else:
                        res = timed_then_traced(decode, b.generator(0), tracer)
                    ms[arm][w].append(1000 * res.decode_s / res.host_syncs)
    tracer.close()
    out = {}
    for arm, by in ms.items():
        base = np.array(by["untraced"])
        out[arm] = {w: {"median_ms_per_step": float(np.median(v)),
                        "median_paired_ratio_to_untraced": float(np.median(np.array(v) / base))}
                    for w, v in by.items()}
    sp = {w: float(np.median(np.array(ms["AR"][w]) * 4 / np.array(ms["drafter-only"][w]))) for w in ways}
    print(f"{ns.reps} repetitions x {len(prompts)} prompts, paired (ms per step; ratio = median over pairs of "
          "traced / untraced):")
    for arm, by in out.items():
        for w, v in by.items():
            print(f"  {arm:13s} {w:15s} {v['median_ms_per_step']:.3f} ms/step   x{v['median_paired_ratio_to_untraced']:.3f}")
    print("  drafter-only / AR throughput (4 tokens per drafter-only step, median over pairs): "
          + ", ".join(f"{w} {v:.3f}" for w, v in sp.items()))
    if ns.out:
        Path(ns.out).write_text(json.dumps({"per_arm": out, "spec_over_ar": sp, "reps": ns.reps}, indent=2) + "\n")


if __name__ == "__main__":
    main()
