"""Weight-streaming rate of the skinny matmuls: python -m harness.lab.bench_kernels --preset qwen3-8b

For each weight shape of a preset's target layer and lm_head, at 1 row (an AR step) and at the verify width,
times cuBLAS (torch.nn.functional.linear) and core.kernels.linear over a grid of tile configurations, each
as a CUDA graph of calls over enough weight copies that nothing is served from L2. Reports GB/s of weight bytes
against two ceilings measured in the same run: the device-to-device copy (read + write bytes) and a read-only
reduction (torch.sum). The best configurations feed core.kernels.choose_linear.
"""
from __future__ import annotations

import itertools
import json
import os
import sys
import time

import torch

from core.errors import Parser
from core import kernels
from core.kernels.common import shared_memory_limit

AUTO = kernels.Launch(pdl=None)  # PDL where the GPU has it (resolved per call)
from harness.protocol.presets import PRESETS, hf_config, preset
from harness.decode.timing import copy_bandwidth


def shapes(name: str) -> dict[str, tuple[int, int, bool]]:
    """label -> (N, K, gated input)."""
    c = hf_config(preset(name))
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd
    return {"qkv": (qkv, c.hidden_size, False), "o_proj": (c.hidden_size, c.num_attention_heads * hd, False),
            "gate_up": (2 * c.intermediate_size, c.hidden_size, False),
            "down (gated input)": (c.hidden_size, c.intermediate_size, True),
            "lm_head": (c.vocab_size, c.hidden_size, False)}


def graph_ms(calls, reps: int = 5) -> float:
    """Median device ms of one replay of a graph that makes every call in `calls` once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def read_bandwidth(device, nbytes: int = 1 << 32) -> float:
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    ms = graph_ms([lambda: x.sum(dtype=torch.float32)] * 4)
    return 4 * nbytes / (ms / 1000)


def grid(m: int) -> list[kernels.LinearConfig]:
    out = []
    if m == 1:
        for bn, bk, w in itertools.product((4, 8, 16, 32), (256, 512, 1024), (2, 4, 8)):
            if bn * bk <= 16384:
                out.append(kernels.LinearConfig(bn, bk, w, 1, False))
        for bn, bk, s in itertools.product((16, 32, 64), (128, 256), (3, 4)):
            out.append(kernels.LinearConfig(bn, bk, 4, s, True))
        return out
    for bn, bk, w, s in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4)):
        if bn * bk <= 32768:
            out.append(kernels.LinearConfig(bn, bk, w, s, True))
    return out


def sweep(name: str, rows: list[int], dtype, budget_bytes: int = 1 << 31, full: bool = True) -> dict:
    """Each shape's weight copies fill `budget_bytes` (at the model's 16 GB, translation misses are the model's)."""
    dev = torch.device("cuda")
    res = {}
    for label, (n, k, gated) in shapes(name).items():
        wbytes = n * k * torch.finfo(dtype).bits // 8
        copies = max(2, -(-budget_bytes // wbytes))
        ws = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, 2 * k if gated else k, device=dev, dtype=dtype)
            xin = torch.nn.functional.silu(x[:, :k]) * x[:, k:] if gated else x
            ys = torch.empty(m, n, device=dev, dtype=dtype)
            ms = graph_ms([lambda w=w: torch.nn.functional.linear(xin, w, out=ys) for w in ws]) / copies
            row = {"N": n, "K": k, "rows": m, "weight_MB": wbytes / 1e6, "cublas_ms": ms,
                   "cublas_GBps": wbytes / ms / 1e6, "configs": []}
            # what linear picks for this dtype on this device (the measured tiles, fitted to its shared memory)
            chosen = kernels.choose_linear(m, n, k, torch.finfo(dtype).bits // 8, shared_memory_limit(dev))
            cfgs = grid(m) if full else [chosen]
            best = None
            for cfg in cfgs:
                try:
                    t = graph_ms([lambda w=w: kernels.linear(x, w, gated=gated, out=ys, config=cfg, launch=AUTO)
                                  for w in ws]) / copies
                except Exception as e:  # a tile that does not compile here (shared memory): skip it
                    row["configs"].append({"config": cfg.__dict__, "error": f"{type(e).__name__}"[:80]})
                    continue
                row["configs"].append({"config": cfg.__dict__, "ms": t, "GBps": wbytes / t / 1e6})
                if best is None or t < best[1]:
                    best = (cfg, t)
            tc = graph_ms([lambda w=w: kernels.linear(x, w, gated=gated, out=ys, launch=AUTO) for w in ws]) / copies
            row.update(best_config=best[0].__dict__, best_ms=best[1], best_GBps=wbytes / best[1] / 1e6,
                       chosen_config=chosen.__dict__, chosen_ms=tc, chosen_GBps=wbytes / tc / 1e6)
            ref = torch.nn.functional.linear(xin, ws[0])
            got = kernels.linear(x, ws[0], gated=gated, launch=AUTO)
            row["max_abs_diff_vs_cublas"] = (got.float() - ref.float()).abs().max().item()
            res[f"{label} x{m}"] = row
            print(f"[kernels] {label} rows={m}: cuBLAS {row['cublas_GBps']:.0f} GB/s, best {row['best_GBps']:.0f} "
                  f"GB/s {best[0]}, chosen {row['chosen_GBps']:.0f} GB/s", flush=True)
        del ws
        torch.cuda.empty_cache()
    return res


def main(argv=None) -> int:
    p = Parser(prog="python -m harness.lab.bench_kernels", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-8b", choices=sorted(PRESETS))
    p.add_argument("--rows", default="1,16")
    p.add_argument("--chosen-only", action="store_true", help="time choose_linear's pick only (no sweep)")
    p.add_argument("--budget-gb", type=float, default=2.0,
                   help="weight copies per shape (GB): 2 fits the sweep's first use; 16 is a whole qwen3-8b step")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available() or not kernels.available():
        print("error: harness.lab.bench_kernels needs a CUDA device and triton", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    res = {"what": __doc__.splitlines()[0], "preset": a.preset, "device_name": torch.cuda.get_device_name(dev),
           "torch": torch.__version__, "triton": kernels.triton.__version__, "dtype": "torch.bfloat16",
           "copy_bandwidth_GBps": copy_bandwidth(dev, nbytes=1 << 31) / 1e9,
           "read_bandwidth_GBps": read_bandwidth(dev) / 1e9}
    print(f"[kernels] copy {res['copy_bandwidth_GBps']:.0f} GB/s, read (torch.sum) {res['read_bandwidth_GBps']:.0f} "
          "GB/s", flush=True)
    res["budget_gb"] = a.budget_gb
    res["shapes"] = sweep(a.preset, [int(r) for r in a.rows.split(",")], torch.bfloat16,
                          budget_bytes=int(a.budget_gb * 1e9), full=not a.chosen_only)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    path = a.out or os.path.join("results", "perf", "kernels_h200.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"[kernels] wrote {path} in {res['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
