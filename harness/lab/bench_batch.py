"""Batched target steps against their byte floors (issue 29, item 5):
    python -m harness.lab.bench_batch --preset qwen3-8b --batch-sizes 1,2,4,8,16,32,64 --contexts 512,4096

Random weights (timing does not depend on values; labelled). For each batch size B, context C and width W (1: the
batched AR step; --block-size: the batched verify), B requests each hold C committed slots in their own row of a
batched KV cache (harness.decode.batch_target.BatchTarget), and one step is the forward of B x W rows:
- measured: the eager forward's median over --reps after --warmup (CUDA events on a GPU, the host clock on a CPU);
- floor: (the weight bytes one step reads + the KV bytes it reads: B x (C + W) slots x layers x 2 x kv heads x
  head_dim x element size) / the measured device-to-device copy bandwidth (read + write bytes);
- ratio = measured / floor; the goal is <= 1.15 at every B <= 16;
- compute floor: the step's FLOP (step_flop) / the measured dense matmul rate (timing.matmul_rate, an 8192-cubed
  product in the run's dtype); where it is above the byte floor the step is compute-bound and the byte floor's goal
  is out of reach; roofline_ratio = measured / the higher of the two floors.
Eager by default, so a small step's launch gaps are inside its time; --graphs (CUDA) captures each point's
forward as one CUDA graph (warmed up on a side stream first, captured outside the timing) and times its replays,
as the batched decode loop replays its whole-step graphs. Writes JSON (--out) and a markdown table beside it.
"""
from __future__ import annotations

import json
import os

import torch

from core.devices import resolve_backend
from core.errors import Parser, UsageError, cli_exit
from core.ops import make_ops
from harness.decode.batch_target import BatchTarget
from harness.decode.graphs import StepGraphs
from harness.decode.timing import copy_bandwidth, matmul_rate, median_ms
from harness.protocol.presets import PRESETS, RANDOM_LABEL, build_random, hf_config, preset
from harness.protocol.sweep_points import MAX_BATCH, points_of

GOAL = 1.15  # measured / floor at every B <= 16 (issue 29)


def kv_bytes(target, batch: int, slots: int) -> int:
    """The K and V bytes a step reads: every request's first `slots` slots in every layer."""
    kv = target.kv
    return batch * slots * target.n_layers * 2 * kv.n_kv_heads * kv.head_dim * kv.k.element_size()


def step_flop(target, weight_bytes: int, batch: int, width: int, slots: int) -> int:
    """A step's arithmetic: 2 FLOP per parameter read per row (the matmuls; the norms' few parameters counted
    alike) plus attention's two products (q.k and p.v: 4 FLOP per query head, slot and head dimension) for B x W
    rows over `slots` slots in every layer, the block's own slots counted whole (an upper bound by W^2 / 2). Every
    parameter counts: the batched steps run dense Llama/Qwen-style targets (BatchTarget refuses Gemma 4's experts
    and windows)."""
    rows = batch * width
    params = weight_bytes // target.kv.k.element_size()  # (the KV cache holds the weights' dtype here)
    attention = 4 * rows * slots * target.config.num_attention_heads * target.head_dim * target.n_layers
    return 2 * rows * params + attention


def graphed(graphs: StepGraphs, key: tuple, fn):
    """fn captured as one CUDA graph by the decode loop's own capture (StepGraphs: warmup on a side stream, then
    the capture); returns the graph's replay. A verify commits nothing, so no state needs restoring."""
    entry, _ = graphs.ensure(key, (), fn, [])
    return entry.graph.replay


def measure(m, batches: list[int], contexts: list[int], block: int, bw: float, flops: float, reps: int,
            warmup: int, graphs: bool = False, on_row=None) -> list[dict]:
    """Every point's row, in order; on_row(rows) after each one (main writes the files then, so a point that fails,
    e.g. a kernel the device refuses, leaves the points before it written)."""
    t, rows = m.target, []
    weights = m.target_weight_bytes(include_embedding=False)
    g = torch.Generator(device=m.backend.device).manual_seed(0)
    for b in batches:
        batch = BatchTarget(t, b)
        batch.ensure_capacity(max(contexts) + block + 1)
        steps = StepGraphs(m.backend.device) if graphs else None  # this batch size's graphs, dropped with it
        for c in contexts:
            batch.pos.fill_(c)  # the slots' values do not change the cost; their count does
            for w in (1, block):
                ids = torch.randint(10, t.vocab_size, (b, w), generator=g, device=m.backend.device)
                step = lambda: batch.verify(ids, c + w, want_features=False)  # noqa: E731
                if graphs:
                    step = graphed(steps, (b, c, w), step)
                ms = median_ms(step, m.backend.device, reps, warmup)
                kvb, flop = kv_bytes(t, b, c + w), step_flop(t, weights, b, w, c + w)
                floor, compute = 1000 * (weights + kvb) / bw, 1000 * flop / flops
                roof = max(floor, compute)
                rows.append({"batch": b, "context": c, "width": w, "step": "AR" if w == 1 else "verify",
                             "ms": round(ms, 6), "positions_per_s": round(b * w / ms * 1000, 1),
                             "weight_bytes": weights, "kv_bytes": kvb, "floor_ms": round(floor, 6),
                             "ratio": round(ms / floor, 3), "flop": flop, "compute_floor_ms": round(compute, 6),
                             "roofline_ratio": round(ms / roof, 3)})
                print(f"[bench-batch] B={b} C={c} W={w}: {ms:.3f} ms, floor {floor:.3f} ms, "
                      f"ratio {ms / floor:.2f}, compute floor {compute:.3f} ms", flush=True)
                if on_row is not None:
                    on_row(rows)
        del batch, steps
        if m.backend.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def markdown(res: dict) -> str:
    lines = [] if res.get("complete", True) else [
        f"**Incomplete**: {len(res['rows'])} of {res['planned_points']} points measured "
        f"({res.get('stopped_by') or 'the run stopped without a recorded error, or is still running'}).", ""]
    lines += [f"**{res['label']}**: {res['preset']} on {res['device_name']}, {res['dtype']}, kernels {res['kernels']}, "
             f"{'one CUDA graph per point' if res['graphs'] else 'eager'}, "
             f"copy bandwidth {res['copy_bandwidth_GBps']:.0f} GB/s, matmul rate {res['matmul_TFLOPs']:.0f} TFLOP/s "
             f"({res['matmul_shape']})", "",
             "| step | B | context | ms | positions/s | floor ms | ratio | compute floor ms | ratio to the higher |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['step']} | {r['batch']} | {r['context']} | {r['ms']:.3f} | {r['positions_per_s']:.0f} | "
                     f"{r['floor_ms']:.3f} | {r['ratio']:.2f} | {r['compute_floor_ms']:.3f} | "
                     f"{r['roofline_ratio']:.2f} |")
    lines += ["", f"Floor: (weight bytes read per step + KV bytes read) / copy bandwidth; goal: ratio <= {GOAL} at "
              "every B <= 16. Compute floor: the step's FLOP (2 a parameter a row, plus attention's two products "
              "over every slot) / the measured matmul rate; where it is above the byte floor, the byte floor's goal "
              "cannot be met on this device, and the last column is the time over the higher of the two. "
              "positions/s: B x the step's width (1 for AR, the block for a verify) over its time; "
              "a verify commits only its accepted drafts plus one, so for it this is no decode rate.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m harness.lab.bench_batch", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen3-8b", choices=sorted(PRESETS))
    p.add_argument("--device")
    p.add_argument("--dtype")
    p.add_argument("--kernels", choices=("auto", "triton", "torch"), default="auto")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--contexts", default="512,4096")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--graphs", action="store_true", help="time each point's forward as one CUDA graph (CUDA)")
    p.add_argument("--wide-rows", action="store_true",
                   help="with --kernels triton: linear and RMSNorm calls past 64 rows (the verify from B = 8) on the "
                        "kernels in 64-row tiles (Launch.wide_rows), not the torch ops")
    p.add_argument("--one-row-pdl", choices=("auto", "on", "off"), default="auto",
                   help="with the Triton kernels: programmatic dependent launch for one-row launches too (auto: "
                        "the target's rule, core.ops.triton_impl.launch_bound; off: several-row launches only, as "
                        "before it)")
    p.add_argument("--out", help="JSON path (markdown beside it); default results/perf/bench_batch_<preset>.json")
    a = p.parse_args(argv)

    def work():
        batches = points_of(a.batch_sizes, "--batch-sizes", 1, MAX_BATCH)
        contexts = points_of(a.contexts, "--contexts", 1)
        if a.block_size < 2 or a.reps < 1 or a.warmup < 0:
            raise UsageError("--block-size must be >= 2, --reps >= 1 and --warmup >= 0")
        if a.wide_rows and a.kernels != "triton":
            raise UsageError(f"--wide-rows routes calls to the Triton kernels: add --kernels triton (got --kernels "
                             f"{a.kernels})")
        config = hf_config(preset(a.preset))
        limit = config.max_position_embeddings
        if max(contexts) + a.block_size + 1 > limit:
            raise UsageError(f"--contexts {max(contexts)}: with block {a.block_size} it passes the preset's "
                             f"max_position_embeddings {limit}; use smaller contexts")
        backend = resolve_backend(a.device, a.dtype)
        if a.graphs and backend.kind != "cuda":
            raise UsageError(f"--graphs captures CUDA graphs and needs --device cuda; drop it on {backend.kind}")
        launch = None
        if a.wide_rows or a.one_row_pdl != "auto":
            from core.kernels import Launch
            launch = Launch(pdl=None, wide_rows=a.wide_rows,
                            one_row_pdl={"auto": None, "on": True, "off": False}[a.one_row_pdl])
        ops = make_ops(a.kernels, backend.device, backend.dtype, config, launch=launch)
        lch = getattr(ops, "launch", None)  # (the Triton ops': PDL resolved for this device)
        one_row = bool(lch is not None and lch.pdl and lch.one_row_pdl)
        m = build_random(a.preset, backend, block_size=a.block_size, capacity=max(contexts) + a.block_size + 1,
                         ops=ops)
        bw = copy_bandwidth(backend.device, nbytes=(1 << 31) if backend.kind == "cuda" else (1 << 24))
        n = 8192 if backend.kind == "cuda" else 256
        flops = matmul_rate(backend.device, backend.dtype, n)
        name = torch.cuda.get_device_name(backend.device) if backend.kind == "cuda" else "cpu"
        res = {"label": RANDOM_LABEL.split(" / ")[0], "preset": a.preset, "device_name": name,
               "dtype": str(backend.dtype)[6:], "kernels": m.target.kernels + (", wide rows" if a.wide_rows else "")
               + (", one-row PDL" if one_row else ""), "one_row_pdl": one_row,
               "graphs": a.graphs, "reps": a.reps, "warmup": a.warmup,
               "copy_bandwidth_GBps": bw / 1e9,
               "matmul_TFLOPs": flops / 1e12, "matmul_shape": f"{n}x{n}x{n} {str(backend.dtype)[6:]}",
               "torch": torch.__version__, "goal_ratio": GOAL,
               "complete": False, "planned_points": len(batches) * len(contexts) * 2, "rows": []}
        out = a.out or os.path.join("results", "perf", f"bench_batch_{a.preset}.json")
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        # the points so far go to OUT's .partial files (an earlier complete OUT is left alone until this run ends)
        partial = os.path.splitext(out)[0] + ".partial"

        def write(rows, base=partial):
            res["rows"] = rows
            with open(base + ".json", "w") as f:
                f.write(json.dumps(res, indent=1) + "\n")
            with open(base + ".md", "w") as f:
                f.write(markdown(res))
        try:
            rows = measure(m, batches, contexts, a.block_size, bw, flops, a.reps, a.warmup, a.graphs, on_row=write)
        except Exception as e:  # the points measured so far stay written, marked incomplete, and the error goes on
            res["stopped_by"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            write(res["rows"])
            print(f"[bench-batch] stopped after {len(res['rows'])} points ({res['stopped_by']}); they are in "
                  f"{partial}.json")
            raise
        res["complete"] = True
        write(rows, os.path.splitext(out)[0])
        for ext in (".json", ".md"):
            if os.path.exists(partial + ext):
                os.remove(partial + ext)
        print(f"[bench-batch] wrote {out}")
    return cli_exit(work)


if __name__ == "__main__":
    raise SystemExit(main())
