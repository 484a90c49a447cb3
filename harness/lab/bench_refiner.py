"""Cost of the refinement step alone, per pass: python -m harness.lab.bench_refiner --preset qwen3-8b --device cpu

Random heads at real shapes (timing does not depend on weight values), a random proposal, and the refine() call
timed in isolation: the median over repeats after warmup, with a device sync around each call (this is a
micro-benchmark of one stage, not the decode loop). The per-pass cost is the slope of time over K.
"""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from functools import partial

import torch

from core.protocols import Proposal, RefineContext
from core.devices import resolve_backend
from core.errors import Parser, UsageError
from core.ops import KINDS, make_ops
from core.ops.base import Ops
from harness.decode.graphs import CompiledRefiner
from harness.lab.captured import CapturedRefiner
from harness.protocol.algorithms import MarkovRefiner, XPressRefiner, random_markov_head, random_xpress_head

PRESETS = {  # vocab, hidden, rank, block
    "qwen3-8b": (151936, 4096, 256, 16),
    "smollm2-135m": (49152, 576, 80, 16),  # the shipped heads' geometry (weights/smollm2-135m/xpress: rank 80)
    "tiny": (512, 64, 16, 8),
}


def time_call(fn, backend, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = backend.now()
        fn()
        samples.append(backend.now() - t0)
    return statistics.median(samples)


def profiled(fn, backend, calls: int) -> dict:
    """`calls` calls of fn under torch.profiler, after the timed ones: harness.lab.profiled's record per call (on a
    GPU each kernel's own device time, so a pass's time splits into its launches, and the device's busy time
    against the call's wall time)."""
    from torch.profiler import ProfilerActivity, profile
    from harness.lab.profiled import summary
    on_gpu = backend.kind == "cuda"
    fn()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
        t0 = backend.now()
        for _ in range(calls):
            fn()
        wall = backend.now() - t0
    return {"per": "call", **summary(prof.key_averages(), calls, wall, on_gpu, top=12)}


def measure(preset: str, device: str | None, dtype: str | None, passes: list[int], topcs: list[int],
            repeats: int, use_graph: bool = False, kernels: str = "torch", compiled: bool = False,
            profile_k: int | None = None, fused_latents: bool = True, rank: int | None = None,
            mlp_ratio: int = 2) -> dict:
    """`kernels`: the ops both heads run on (the decode's --kernels: triton runs an xPress pass's latent and a gated
    Markov step's in one launch each, and their w2 product, base add and argmax in one more); `compiled`: each
    refiner through torch.compile first, as --compile-refiner runs it; `profile_k`: xPress at that K (full
    vocabulary) once more under the profiler, eagerly (a graph's replay hides its kernels from it);
    `fused_latents=False`: the xPress pass's and the Markov step's latents on the heads' own torch modules (as
    before the fused kernels), everything else on `kernels`: the fused latents' effect, read on one machine;
    `rank`: both heads' rank instead of the preset's (e.g. a recipe's xpress_rank 160 at SmolLM2's shapes);
    `mlp_ratio`: the xPress head's MLP hidden over its rank (a recipe's xpress_mlp_ratio; 2, the shipped head's)."""
    backend = resolve_backend(device, dtype)
    ops = make_ops(kernels, backend.device, backend.dtype)
    if not fused_latents:
        ops.xpress_latent, ops.markov_latent = partial(Ops.xpress_latent, ops), partial(Ops.markov_latent, ops)
    vocab, hidden, preset_rank, block = PRESETS[preset]
    rank = rank or preset_rank
    g = torch.Generator().manual_seed(0)
    proposal = Proposal(tokens=torch.randint(0, vocab, (block - 1,), generator=g).to(backend.device),
                        logits=torch.randn(block - 1, vocab, generator=g).to(backend.device, backend.dtype),
                        hidden=torch.randn(block, hidden, generator=g).to(backend.device, backend.dtype))
    ctx = RefineContext(anchor=torch.tensor(5, device=backend.device), prev_token=torch.tensor(7, device=backend.device))
    head = random_xpress_head(vocab, hidden, rank, block, seed=1, mlp_hidden=mlp_ratio * rank)
    head = head.to(backend.device, backend.dtype).fold()
    rows = []

    def wrap(refiner):
        if compiled:
            refiner = CompiledRefiner(refiner)
        return CapturedRefiner(refiner) if use_graph else refiner

    with torch.no_grad():
        for c in topcs:
            times = {}
            for k in passes:
                r = wrap(XPressRefiner(head, k, topc=c, ops=ops))
                times[k] = time_call(lambda: r.refine(proposal, ctx), backend, repeats)
                rows.append({"refiner": "xpress", "K": k, "topc": c, "ms": 1000 * times[k]})
            # K = 0 skips the head entirely, so the slope is taken over K >= 1 (the per-block work is in every K >= 1)
            used = [k for k in passes if k >= 1]
            lo, hi = (min(used), max(used)) if used else (0, 0)
            if hi > lo:
                slope = (times[hi] - times[lo]) / (hi - lo)
                rows.append({"refiner": "xpress", "K": "per pass", "topc": c, "ms": 1000 * slope,
                             "fixed_ms": 1000 * (times[lo] - slope * lo)})
        for variant in ("vanilla", "gated", "rnn"):
            mk = random_markov_head(variant, vocab, hidden, rank, seed=2).to(backend.device, backend.dtype)
            r = wrap(MarkovRefiner(mk, ops=ops))
            t = time_call(lambda: r.refine(proposal, ctx), backend, repeats)
            rows.append({"refiner": f"markov-{variant}", "K": f"{block - 1} steps", "topc": 0, "ms": 1000 * t})
        profile = None
        if profile_k is not None:
            r = XPressRefiner(head, profile_k, topc=0, ops=ops)
            profile = {"refiner": f"xpress K={profile_k}", "eager": True,
                       **profiled(lambda: r.refine(proposal, ctx), backend, repeats)}
    device_name = torch.cuda.get_device_name(backend.device) if backend.kind == "cuda" else platform.processor() or "cpu"
    return {"what": "refinement step alone (seed + K passes, or the Markov steps), median wall time per call",
            "preset": preset, "shapes": {"vocab": vocab, "hidden": hidden, "rank": rank, "block": block,
                                          "xpress_mlp": mlp_ratio * rank},
            "device": str(backend.device), "device_name": device_name, "dtype": str(backend.dtype),
            "threads": torch.get_num_threads(), "cuda_graph": use_graph, "kernels": type(ops).__name__,
            "latents": ops_latents(ops) if fused_latents else "torch modules (--unfused-latents)",
            "latent_launch": latent_launch(ops, block, rank, backend) if fused_latents else None,
            "compiled": compiled,
            "host_load_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "repeats": repeats,
            "torch": torch.__version__, "weights": "random (timing does not depend on values)", "rows": rows,
            **({"profile": profile} if profile else {})}


def ops_latents(ops) -> str:
    """How these ops run the heads' latents: the Triton ops fuse them (a head that fits), the others do not."""
    return "fused (Triton)" if getattr(ops, "name", None) == "triton" else "torch modules"


def latent_launch(ops, block: int, rank: int, backend) -> dict | None:
    """The fused xPress latent's launch at this geometry (the mix path, warps, tiles: kernels.xpress.settings), so a
    file says which setting it timed; None where the latents are not fused, or where the ops handed this head's
    passes to the torch modules (their `fallbacks`: a geometry outside one program, a dtype the kernel refuses)."""
    if ops_latents(ops) != "fused (Triton)" or any(what == "xpress latent" for what, _ in ops.fallbacks):
        return None
    from core.kernels import xpress
    s = xpress.settings(block, rank, backend.dtype, backend.device)
    return {"mix": "by rows (transposed)" if s["MIXT"] else "by slot columns", "num_warps": s["num_warps"],
            "BK": s["BK"], "BH": s["BH"]}


def launch_words(launch: dict | None) -> str:
    return "" if not launch else (f" (mix {launch['mix']}, {launch['num_warps']} warps, BK {launch['BK']}, "
                                  f"BH {launch['BH']})")


def markdown(result: dict) -> str:
    lines = [f"Refinement cost, preset {result['preset']} {result['shapes']}, {result['device_name']} "
             f"({result['device']}, {result['dtype']}, {result['threads']} threads, graph={result['cuda_graph']}, "
             f"xPress ops {result.get('kernels', 'TorchOps')}, latents {result.get('latents', 'unrecorded')}"
             f"{launch_words(result.get('latent_launch'))}, "
             f"compiled={result.get('compiled', False)}), "
             f"median of {result['repeats']} calls; {result['weights']}.", "",
             "| refiner | K | top-C | ms |", "|---|---|---|---|"]
    for r in result["rows"]:
        extra = f" (fixed {r['fixed_ms']:.3f})" if "fixed_ms" in r else ""
        lines.append(f"| {r['refiner']} | {r['K']} | {r['topc'] or 'full'} | {r['ms']:.3f}{extra} |")
    prof = result.get("profile")
    if prof:
        unit = "device" if prof["sort"] == "own device time" else "host"
        lines += ["", f"Profile of {prof['refiner']}, eager, per call: wall {1e3 * prof['wall_s_per_step']:.3f} ms, "
                      f"device busy {1e3 * prof['device_busy_s_per_step']:.3f} ms; own {unit} time per call:", "",
                  "| kernel or op | count per call | ms |", "|---|---|---|"]
        for k in prof["top_kernels"] or prof["top"]:
            name = k.get("kernel") or k.get("op")
            ms = 1e3 * (k.get("s_per_step") if "kernel" in k else k["own_s_per_step"])
            lines.append(f"| {name[:60]} | {k['count'] / prof['steps']:g} | {ms:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m harness.lab.bench_refiner", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-8b", choices=sorted(PRESETS))
    p.add_argument("--device")
    p.add_argument("--dtype")
    p.add_argument("--passes", default="0,1,2,4,6,8")
    p.add_argument("--topc", default="0,128")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--use-graph", action="store_true")
    p.add_argument("--kernels", choices=KINDS, default="torch",
                   help="the ops the heads run on, as the decode's --kernels (default torch)")
    p.add_argument("--compile", action="store_true", help="each refiner through torch.compile (--compile-refiner)")
    p.add_argument("--unfused-latents", action="store_true",
                   help="the xPress pass's and Markov step's latents on the heads' torch modules, the rest on "
                        "--kernels (the fused kernels' effect on one machine)")
    p.add_argument("--profile", type=int, metavar="K",
                   help="also profile xPress at K passes, eagerly, --repeats calls: each kernel's time per call")
    p.add_argument("--rank", type=int, help="the heads' rank instead of the preset's (its vocab, hidden and block kept)")
    p.add_argument("--mlp-ratio", type=int, default=2,
                   help="the xPress head's MLP hidden over its rank (default 2, the shipped head's)")
    p.add_argument("--out", help="write JSON here and markdown beside it (.md)")
    a = p.parse_args(argv)
    try:
        passes = [int(x) for x in a.passes.split(",")]
        topcs = [int(x) for x in a.topc.split(",")]
        if any(k < 0 for k in passes) or any(c < 0 for c in topcs) or a.repeats < 1 or (a.profile or 0) < 0:
            raise UsageError("--passes, --topc and --profile must be non-negative integers and --repeats >= 1")
        if a.mlp_ratio < 1:
            raise UsageError(f"--mlp-ratio {a.mlp_ratio}: give a positive integer (2 is the shipped head's)")
        if a.rank is not None and a.rank < 1:
            raise UsageError(f"--rank {a.rank}: give a positive rank (e.g. 80 or 160), or drop it for the preset's")
        result = measure(a.preset, a.device, a.dtype, passes, topcs, a.repeats, a.use_graph, a.kernels, a.compile,
                         a.profile, fused_latents=not a.unfused_latents, rank=a.rank, mlp_ratio=a.mlp_ratio)
    except (UsageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = markdown(result)
    print(text)
    if a.out:
        from harness.protocol.results_io import write_record
        write_record(a.out, {**result, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
