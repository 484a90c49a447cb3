"""The graphed AR, drafter-only and xPress K=6 steps of the qwen3-8b preset under a few kernel launch settings,
alternated over repetitions in one process (so machine drift hits every setting alike), and with --profile the
device time per kernel of the AR step. Random weights / scripted acceptance; CUDA only.

    PYTHONPATH=. python harness/lab/probe_levers.py [--reps 2] [--profile] [--out probe.json]

NOTES.md's probe numbers for the kept code come from this script's settings (an earlier copy of it also ran the
reverted variants, whose code was not kept: see NOTES.md)."""
import argparse
import json

from harness.decode import kernels
from harness.lab.bench_step import _prompt, _timed, kernel_profile
from harness.decode.devices import resolve_backend
from harness.decode.loop import DecodeSettings
from harness.protocol.presets import build_random
from harness.decode.timing import copy_bandwidth

SETTINGS = (("default", {}), ("norm as its own launch", dict(fold_norms=False)),
            ("64-slot attention blocks", dict(attention_block=64)))
ARMS = (("ar", 0), ("drafter-only", 0), ("xpress", 6))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default="probe_levers.json")
    a = p.parse_args()
    b = resolve_backend("cuda", "bfloat16")
    m = build_random("qwen3-8b", b, block_size=16, capacity=256)
    prompt = _prompt(128, m.target.vocab_size)
    base = DecodeSettings(128, 4096, (), scripted_accept=3, graph_bucket=256, use_graph=True)
    bw = copy_bandwidth(b.device, nbytes=1 << 31)
    roof = 1000 * m.target_weight_bytes() / bw
    res = {"label": "random weights / scripted acceptance", "copy_GBps": bw / 1e9, "roofline_ms": roof, "rows": []}
    print(f"copy {bw / 1e9:.0f} GB/s, roofline {roof:.3f} ms", flush=True)
    for rep in range(a.reps):
        for label, kw in SETTINGS:
            kernels.set_launch(**kw)
            m.use_kernels(kernels)
            row = {"setting": label, "rep": rep}
            for method, K in ARMS:
                row[method] = _timed(m, method, K, 0, prompt, base)[1].summary()["step"]
            res["rows"].append(row)
            print(f"{label:26s} AR {row['ar']:.3f} ms ({row['ar'] / roof:.3f}x roofline), drafter-only "
                  f"{row['drafter-only']:.3f}, xPress K=6 {row['xpress']:.3f}", flush=True)
    kernels.set_launch()
    m.use_kernels(kernels)
    if a.profile:
        res["profile"] = kernel_profile(m, "ar", prompt, base)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
