"""Step-level cost of every arm at a preset's real shapes: python -m harness.lab.bench_step --preset qwen3-8b

Random weights (timing does not depend on values) and scripted acceptance (DecodeSettings.scripted_accept), so
every number here is labelled "random weights / scripted acceptance". Measured, at batch 1 after a prompt of
--prompt-len tokens:
- the roofline: target weight bytes / measured device-to-device copy bandwidth (read + write bytes);
- per arm (AR, drafter-only, Markov, xPress at each K and top-C): the eager step per stage from CUDA events with
  no per-stage sync (harness.decode.timing.StageTimer), the graphed step (whole-step CUDA graph, harness.decode.graphs) and
  its host gap, and the per-stage device time with each stage captured as its own graph;
- speedup = tau x (AR step / spec step) at scripted tau, against the measured tok/s of the full graphed loop;
- attention over bucketed KV lengths against attention over the whole cache;
- extra reference arms: HF `generate` with its default cache and with cache_implementation="static".
Writes JSON (--out) and a markdown table beside it.
"""
from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time

import torch

from core.devices import resolve_backend
from core.ops import TorchOps, triton_ops
from harness.lab.step_markdown import markdown
from core.errors import Parser, UsageError
from harness.decode.graphs import StepGraphs
from harness.decode.state import graph_stats
from harness.decode.loop import DecodeSettings, Stepper, generate
from harness.protocol.presets import PRESETS, RANDOM_LABEL, build_random
from core.protocols import IdentityRefiner
from harness.decode.timing import StageTimer, capture_stage_graphs, copy_bandwidth, time_stage_graphs


def arm_list(ks: list[int], topcs: list[int]) -> list[tuple[str, str, int, int]]:
    arms = [("AR", "ar", 0, 0), ("drafter-only", "drafter-only", 0, 0), ("Markov", "markov", 0, 0)]
    for c in topcs:
        arms += [(f"xPress(K={k}{', C=%d' % c if c else ''})", "xpress", k, c) for k in ks]
    return arms


def _prompt(n: int, vocab: int) -> list[int]:
    return torch.randint(10, min(vocab, 30000), (n,), generator=torch.Generator().manual_seed(123)).tolist()


def _gen(m, method, K, topc, prompt, settings, mark=None):
    return generate(m.target, prompt, settings, m.backend, drafter=None if method == "ar" else m.drafter,
                    refiner=m.refiner(method, K, topc), mark=mark)


def _timed(m, method, K, topc, prompt, settings, warm: DecodeSettings | None = None):
    """One warm generation (with `warm`, else the same settings: captures every graph the timed one needs),
    then the timed one: (its Generation, its StageTimer)."""
    _gen(m, method, K, topc, prompt, warm or settings)
    timer = StageTimer(m.backend.device)
    return _gen(m, method, K, topc, prompt, settings, mark=timer), timer


def _ops(a, device, pdl: bool | None = None, attention_splits: int | None = None, invariant: bool | None = None,
         one_row: bool | None = None):
    """The Triton ops with this run's launch settings (--pdl, --batch-invariant, and a.one_row: Launch.one_row_pdl
    by the target's rule, which measure() sets; the arguments override them)."""
    from core.kernels import Launch
    pdl = (None if a.pdl == "auto" else False) if pdl is None else pdl
    inv = a.batch_invariant if invariant is None else invariant
    one_row = getattr(a, "one_row", None) if one_row is None else one_row
    return triton_ops(device, Launch(pdl=pdl, attention_splits=attention_splits, batch_invariant=inv,
                                     one_row_pdl=one_row))


def _stage_graph_times(m, method, K, topc, prompt, settings, reps: int) -> dict:
    """Each stage of one step at the prompt's end as its own graph; median device ms per stage."""
    t, d = m.target, (None if method == "ar" else m.drafter)
    w = d.block_size if d is not None else 1
    p = len(prompt)
    t.reset()
    out = torch.full((t.capacity + w + 1,), -1, dtype=torch.long, device=m.backend.device)
    out[:p] = torch.tensor(prompt)
    logits, feats = t.prefill(out[:p], want_features=d is not None)
    out[p] = logits.argmax()
    if d is not None:
        d.begin(feats)
    stops = torch.tensor([-2], device=m.backend.device)
    stepper = Stepper(t, d, m.refiner(method, K, topc) or IdentityRefiner(), settings, out, stops, None, None)
    live = [t.pos] + ([d.ctx] if d is not None else [])
    saved = [x.clone() for x in live]
    restore = lambda: [x.copy_(s) for x, s in zip(live, saved)]  # noqa: E731
    length = StepGraphs.length(p + w, settings.graph_bucket, t.capacity)
    stepper.step(d is not None, w, length)
    restore()
    graphs = capture_stage_graphs(lambda mark: stepper.step(d is not None, w, length, mark), restore)
    res = time_stage_graphs(graphs, restore, reps=reps)
    del graphs
    return res


def measure_arm(m, arm, prompt, base: DecodeSettings, new_tokens: int, graphs: bool, reps: int) -> dict:
    name, method, K, topc = arm
    s = dataclasses.replace(base, max_new_tokens=new_tokens)
    row = {"arm": name, "method": method, "K": K, "topc": topc}
    g, timer = _timed(m, method, K, topc, prompt, s, warm=dataclasses.replace(s, max_new_tokens=8))
    row["eager"] = {**timer.summary(), "wall_per_step_ms": 1000 * g.decode_s / len(g.accepted)}
    if graphs:
        g, timer = _timed(m, method, K, topc, prompt, dataclasses.replace(s, use_graph=True))
        sm = timer.summary()
        row["graph"] = {"step_ms": sm["step"], "host_ms": sm.get("host"), "n_steps": sm["n_steps"],
                        "wall_per_step_ms": 1000 * g.decode_s / len(g.accepted), "graph_steps": g.graph_steps}
        row["stage_graphs"] = _stage_graph_times(m, method, K, topc, prompt, base, reps)
    return row


def tok_s(m, arm, prompt, settings) -> tuple[float, float, float]:
    """Full graphed loop: tok/s, wall ms per step, and mean device ms per step (events, same run)."""
    g, timer = _timed(m, *arm[1:], prompt, settings)
    return g.decode_tokens / g.decode_s, 1000 * g.decode_s / len(g.accepted), timer.summary(skip=0)["mean_step"]


def kernel_profile(m, method: str, prompt, settings: DecodeSettings) -> dict:
    """Device time per kernel name over a graphed generation (torch.profiler / CUPTI, which sees the kernels
    inside graph replays), per step; `gap_ms` is the graphed step minus the kernels' sum (launch gaps). A kernel
    launched early by PDL counts its wait for the launch before it, so with PDL the sum exceeds the step."""
    from torch.profiler import ProfilerActivity, profile
    _gen(m, method, 0, 0, prompt, settings)  # captured before the profile
    timer = StageTimer(m.backend.device)
    prof = profile(activities=[ProfilerActivity.CUDA])

    def mark(name: str) -> None:  # the profile starts at the first step's begin: the prefill stays out
        if not timer.marks:
            torch.cuda.synchronize()
            prof.start()
        timer(name)
    try:
        g = _gen(m, method, 0, 0, prompt, settings, mark=mark)
        torch.cuda.synchronize()
    finally:
        prof.stop()
    steps = len(g.accepted)
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        us = e.cuda_time_total if us is None else us
        if us > 0:
            rows.append({"kernel": e.key[:90], "calls_per_step": e.count / steps, "us_per_step": us / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows) / 1000
    step = timer.summary(skip=0)["mean_step"]
    return {"arm": method, "steps": steps, "step_ms": step, "kernel_sum_ms": total, "gap_ms": step - total,
            "kernels": rows[:25]}


def hf_reference(model, prompt, n: int, device) -> dict:
    """HF generate per new token (prefill excluded: a 1-token run is subtracted), greedy."""
    ids = torch.tensor([prompt], device=device)
    res = {}
    for label, extra in (("HF generate, default cache", {}),
                         ("HF generate, static cache (no auto-compile)",
                          {"cache_implementation": "static", "disable_compile": True})):
        def run(k):
            torch.cuda.synchronize() if device.type == "cuda" else None
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0, **extra)
            torch.cuda.synchronize() if device.type == "cuda" else None
            return time.perf_counter() - t0
        try:
            run(2)
            t1, tn = run(1), run(n)
            res[label] = {"ms_per_token": 1000 * (tn - t1) / (n - 1), "new_tokens": n}
        except Exception as e:  # a reference arm only: report and go on
            res[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    return res


def _save(result: dict, path: str | None) -> None:
    """Written after every phase, so that a run cut short still leaves what it measured."""
    if path:
        from harness.protocol.results_io import write_record
        write_record(path, {**result, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}, markdown(result))


def measure(a, path: str | None = None) -> dict:
    backend = resolve_backend(a.device, a.dtype)
    graphs = backend.kind == "cuda" and not a.no_graph
    t0 = time.perf_counter()
    m = build_random(a.preset, backend, block_size=a.block_size, capacity=256)
    build_s = time.perf_counter() - t0
    from core.ops.triton_impl import launch_bound  # (core.kernels only where it is asked for)
    a.one_row = launch_bound(m.target.config, backend.dtype)  # as core.ops.make_ops chooses for a run
    vocab = m.target.vocab_size
    prompt = _prompt(a.prompt_len, vocab)
    limit = m.target.max_position or 4096
    base = DecodeSettings(a.new_tokens, limit, (), scripted_accept=a.scripted, graph_bucket=a.bucket)
    bw = copy_bandwidth(backend.device, nbytes=(1 << 31) if backend.kind == "cuda" else (1 << 26))
    wb, wb_step = m.target_weight_bytes(), m.target_weight_bytes(include_embedding=False)
    db_step = m.drafter_step_bytes()
    res = {"label": RANDOM_LABEL, "what": __doc__.splitlines()[0], "preset": a.preset, "preset_note": m.preset.note,
           "device": str(backend.device),
           "device_name": torch.cuda.get_device_name(backend.device) if backend.kind == "cuda" else platform.processor() or "cpu",
           "dtype": str(backend.dtype), "batch": 1, "prompt_len": a.prompt_len, "block_size": a.block_size,
           "scripted_accept_per_arm": a.scripted, "new_tokens_per_arm": a.new_tokens, "graph_bucket": a.bucket,
           "torch": torch.__version__, "transformers": __import__("transformers").__version__,
           "build_s": round(build_s, 1), "copy_bandwidth_GBps": bw / 1e9, "weight_bytes": wb,
           "weight_bytes_read_per_step": wb_step, "roofline_ms": 1000 * wb / bw, "roofline_read_ms": 1000 * wb_step / bw,
           "drafter_bytes_per_step": db_step, "spec_over_ar_byte_floor": (wb_step + db_step) / wb_step,
           "arms": [], "tau_sweep": [], "attention": {}, "hf_reference": {}}
    print(f"[bench] {RANDOM_LABEL}: {a.preset} on {res['device_name']}, copy {bw / 1e9:.0f} GB/s, roofline "
          f"{res['roofline_ms']:.2f} ms ({wb / 1e9:.2f} GB)", flush=True)
    if graphs:  # the levers, on the AR step (the graphs are recaptured per setting)
        res["fusion"] = {}
        levers = [("separate projections (7 matmuls/layer), torch ops", False, None),
                  ("fused q/k/v and gate/up (4 matmuls/layer), torch ops", True, None)]
        if a.kernels == "triton":
            from core import kernels
            levers += [("fused projections, core.kernels (5 launches/layer: both norms folded at one row), "
                        "no PDL", True, _ops(a, backend.device, pdl=False, invariant=False)),
                       ("the same, attention in one program per K/V head", True,
                        _ops(a, backend.device, pdl=False, attention_splits=1, invariant=False)),
                       ("core.kernels batch-invariant (16-row tiles fixed by n, k; slots split by index), no PDL",
                        True, _ops(a, backend.device, pdl=False, invariant=True))]
            if kernels.pdl_supported(backend.device):
                levers += [("core.kernels with programmatic dependent launch (several-row launches)", True,
                            _ops(a, backend.device, pdl=True, invariant=False, one_row=False)),
                           ("core.kernels with programmatic dependent launch (one-row launches too)", True,
                            _ops(a, backend.device, pdl=True, invariant=False, one_row=True))]
        res["fusion_drafter_only"] = {}
        for label, fuse, ops in levers:
            m.use_ops(ops or TorchOps())
            m.target.fuse_projections(fuse)
            s = dataclasses.replace(base, use_graph=True)
            for method, into in (("ar", res["fusion"]), ("drafter-only", res["fusion_drafter_only"])):
                if method == "ar" or ops is not None:
                    into[label] = _timed(m, method, 0, 0, prompt, s)[1].summary()["step"]
    m.target.fuse_projections(True)
    if a.kernels == "triton":
        m.use_ops(_ops(a, backend.device))
        res["pdl"], res["batch_invariant"] = bool(m.target.ops.launch.pdl), a.batch_invariant
        res["one_row_pdl"] = bool(m.target.ops.launch.pdl and m.target.ops.launch.one_row_pdl)
    res["kernels"] = m.target.kernels
    watch = _compile_refiners(m, a.compile_backend) if a.compile else None
    for arm in arm_list(a.ks, a.topc):
        row = measure_arm(m, arm, prompt, base, a.new_tokens, graphs, a.reps)
        res["arms"].append(row)
        if watch is not None:
            res["compile"] = watch.stats()  # saved with every phase: a run cut short keeps it
        _save(res, path)
        gr = row.get("graph")
        print(f"[bench] {arm[0]}: eager {row['eager']['step']:.2f} ms/step" +
              (f", graph {gr['step_ms']:.3f} ms/step (+{gr['host_ms'] or 0:.3f} host)" if gr else ""), flush=True)
    if graphs:
        by = {r["arm"]: r for r in res["arms"]}
        ar = by["AR"]["graph"]["step_ms"]
        res["ratios"] = {"AR_step_over_roofline": ar / res["roofline_ms"],
                         "AR_step_over_roofline_read": ar / res["roofline_read_ms"],
                         "spec_step_over_AR_step": {r["arm"]: r["graph"]["step_ms"] / ar for r in res["arms"]}}
        sweep = dataclasses.replace(base, max_new_tokens=a.loop_tokens, use_graph=True)
        ar_tps, ar_wall, ar_dev = tok_s(m, ("AR", "ar", 0, 0), prompt, sweep)
        for arm in [x for x in arm_list(a.ks, a.topc) if x[0] in a.sweep_arms]:
            spec = by[arm[0]]["graph"]["step_ms"]
            for tau in a.taus:
                tps, wall, dev = tok_s(m, arm, prompt, dataclasses.replace(sweep, scripted_accept=tau - 1))
                res["tau_sweep"].append({
                    "arm": arm[0], "tau": tau, "predicted_speedup": tau * ar / spec,
                    "predicted_speedup_same_run": tau * ar_dev / dev,
                    "predicted_speedup_wall": tau * ar_wall / wall, "measured_speedup": tps / ar_tps,
                    "spec_tok_s": tps, "ar_tok_s": ar_tps, "new_tokens": a.loop_tokens,
                    "ar_step_ms_same_run": ar_dev, "spec_step_ms_same_run": dev,
                    "rel_diff": tps / ar_tps / (tau * ar / spec) - 1,
                    "rel_diff_same_run": tps / ar_tps / (tau * ar_dev / dev) - 1})
                _save(res, path)
        for arm in (("AR", "ar", 0, 0), ("xPress(K=6)", "xpress", 6, 0)):
            got = {}
            # a bucket of the whole cache (graph_bucket >= 1): every step attends over all of it
            for label, bucket in ((f"bucket {a.bucket}", a.bucket),
                                  (f"whole cache {a.full_capacity}", a.full_capacity)):
                m.target.ensure_capacity(a.full_capacity)
                m.drafter.ensure_capacity(a.full_capacity)
                s = dataclasses.replace(base, use_graph=True, graph_bucket=bucket)
                got[label] = _timed(m, *arm[1:], prompt, s)[1].summary()["step"]
            res["attention"][arm[0]] = got
            _save(res, path)
        res["graph_stats"] = graph_stats(m.target)
        n_long = long_prompt_len(a.long_prompt, limit, a.new_tokens, a.block_size)
        if a.kernels == "triton" and n_long > a.prompt_len:  # recaptures: after the graph statistics
            res["long_prompt"] = long_prompt_attention(m, a, base, n_long)
            _save(res, path)
    if watch is not None:
        res["compile"] = watch.stats()
    if not a.skip_hf:
        res["hf_reference"] = hf_reference(m.target.model, prompt, a.hf_tokens, backend.device)
    if graphs and a.profile:  # last: the profiler's hooks slow what runs after it
        s = dataclasses.replace(base, use_graph=True)
        res["profile"] = [kernel_profile(m, meth, prompt, s) for meth in ("ar", "drafter-only")]
    return res


def long_prompt_len(requested: int, limit: int, new_tokens: int, block: int) -> int:
    """The long prompt's length: as asked, but leaving room in the model's context for the generation and a
    verify block (0: no room for one)."""
    return max(0, min(requested, limit - new_tokens - 2 * block))


def long_prompt_attention(m, a, base: DecodeSettings, n: int) -> dict:
    """Graphed AR and xPress(K=6) steps after an n-token prompt, the attention split over the slots (the
    default) and in one program per K/V head: where splitting pays."""
    prompt = _prompt(n, m.target.vocab_size)
    for model in (m.target, m.drafter):
        model.ensure_capacity(n + a.new_tokens + 2 * a.block_size)
    out = {"prompt_len": n}
    s = dataclasses.replace(base, use_graph=True)
    for label, splits in (("split", None), ("one program per K/V head", 1)):
        m.use_ops(_ops(a, m.backend.device, attention_splits=splits))
        for arm in (("AR", "ar", 0, 0), ("xPress(K=6)", "xpress", 6, 0)):
            out[f"{arm[0]}, attention {label}"] = _timed(m, *arm[1:], prompt, s)[1].summary()["step"]
    m.use_ops(_ops(a, m.backend.device))
    return out


def _compile_refiners(m, backend: str):
    """--compile: every arm's refinement step through torch.compile (what --compile-all does in the CLI)."""
    from harness.decode.compiling import CompileWatch
    from harness.decode.graphs import CompiledRefiner
    watch, raw, wrapped = CompileWatch(backend), m.refiner, {}

    def refiner(method, K=0, topc=0):
        r = raw(method, K, topc)
        if r is not None and (method, K, topc) not in wrapped:
            wrapped[method, K, topc] = CompiledRefiner(r, watch=watch)
        return wrapped.get((method, K, topc))
    m.refiner = refiner
    return watch


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m harness.lab.bench_step", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-8b", choices=sorted(PRESETS))
    p.add_argument("--device")
    p.add_argument("--dtype")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per measured generation of each arm")
    p.add_argument("--scripted", type=int, default=3, help="accepted drafts per step in the per-arm rows")
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    p.add_argument("--topc", default="0,128")
    p.add_argument("--taus", default="2,4,6,8")
    p.add_argument("--sweep-arms", default="drafter-only;Markov;xPress(K=6)")
    p.add_argument("--loop-tokens", type=int, default=256, help="new tokens per full-loop tok/s measurement")
    p.add_argument("--bucket", type=int, default=256)
    p.add_argument("--full-capacity", type=int, default=4096)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--hf-tokens", type=int, default=32)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile the refiners (the CLI's --compile-all)")
    p.add_argument("--compile-backend", default="inductor", choices=("inductor", "aot_eager", "eager"))
    p.add_argument("--kernels", choices=("triton", "torch"), default=None,
                   help="target decode ops (default: triton where available on CUDA)")
    p.add_argument("--pdl", choices=("auto", "off"), default="auto",
                   help="programmatic dependent launch for the kernels (auto: on Hopper and later)")
    p.add_argument("--batch-invariant", action="store_true", help="arms on the batch-invariant kernels (issue 28)")
    p.add_argument("--long-prompt", type=int, default=2048,
                   help="prompt length of the split-attention comparison (0: skip it)")
    p.add_argument("--profile", action="store_true",
                   help="per-kernel device time of the graphed AR and drafter-only steps (torch.profiler)")
    p.add_argument("--out", help="JSON path (markdown beside it); default results/perf/<gpu>_<preset>.json")
    a = p.parse_args(argv)
    try:
        a.ks, a.topc, a.taus = ([int(x) for x in s.split(",") if x.strip()] for s in (a.ks, a.topc, a.taus))
        if a.kernels is None:
            from core import kernels
            a.kernels = "triton" if kernels.available() and torch.cuda.is_available() and a.device != "cpu" else "torch"
        if a.batch_invariant and a.kernels != "triton":
            raise UsageError("--batch-invariant times the Triton kernels; use --kernels triton on CUDA")
        a.sweep_arms = [x.strip() for x in a.sweep_arms.split(";") if x.strip()]
        if min(a.taus, default=2) < 1 or max(a.taus, default=1) > a.block_size:
            raise UsageError(f"--taus must lie in 1..{a.block_size}")
        path = a.out or os.path.join("results", "perf", f"{_slug(a.device)}_{a.preset}.json")
        result = measure(a, path)
    except (UsageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown(result))
    _save(result, path)
    print(f"[bench] wrote {path}")
    return 0


def _slug(device: str | None) -> str:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    s = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return "".join(c.lower() if c.isalnum() else "-" for c in s).strip("-") or "device"


if __name__ == "__main__":
    sys.exit(main())
