"""CUDA-event timing without per-stage synchronisation.

What is timed: `StageTimer` is a `mark` callback for harness.decode.loop.generate; each mark records a CUDA event on the
current stream (a host clock on the CPU), and nothing is read until the generation is over, so timing adds no
sync. A stage's time is the gap between its mark and the previous one on the device timeline: on an eager step
that includes the device waiting for the host to launch the stage's kernels (the eager path is host-bound), on a
graphed step there is one stage, "graph", the replay. "host" is the gap between one step's end and the next
step's begin: the per-step sync, the Python bookkeeping and the launch.

What is not: the prefill (TTFT) and the drafter's prefill, and the first `skip` steps (warm caches).

`capture_stage_graphs` cuts one step into one CUDA graph per stage, so that each stage's device time can be read
with events between replays: the per-stage cost once host overhead is gone.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch


class StageTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []

    def __call__(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((name, ev))
        else:
            self.marks.append((name, time.perf_counter()))

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else 1000.0 * (b - a)

    def steps(self) -> list[dict[str, float]]:
        """Per step: ms per stage, "step" (begin to end) and "host" (previous end to this begin)."""
        if self.cuda:
            torch.cuda.synchronize()
        out, cur, prev_mark, prev_name, prev_end = [], None, None, None, None
        for name, m in self.marks:
            if name == "begin":
                cur = {} if prev_end is None else {"host": self._ms(prev_end, m)}
                begin = m
            elif name == "end":
                if prev_name != "begin":  # after the last stage: packing the step's result
                    cur["pack"] = self._ms(prev_mark, m)
                cur["step"] = self._ms(begin, m)
                out.append(cur)
                prev_end = m
            else:
                cur[name] = cur.get(name, 0.0) + self._ms(prev_mark, m)
            prev_mark, prev_name = m, name
        return out

    def summary(self, skip: int = 2) -> dict[str, float]:
        """Median ms per stage over the steps after the first `skip` (steps that lack a stage are left out)."""
        rows = self.steps()[skip:]
        cols = defaultdict(list)
        for r in rows:
            for k, v in r.items():
                cols[k].append(v)
        res = {k: statistics.median(v) for k, v in cols.items()}
        res.update({f"mean_{k}": statistics.fmean(v) for k, v in cols.items() if k in ("step", "host")})
        res["n_steps"] = len(rows)
        return res


def capture_stage_graphs(step, restore, pool=None) -> list[tuple[str, "torch.cuda.CUDAGraph"]]:
    """Capture `step(mark)` as consecutive graphs, one per stage: at each mark the capture in progress ends and
    the next begins. The step must already have run eagerly at this shape (lazy initialisation). `restore()`
    undoes the step's state changes (it is called once after the capture too)."""
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    graphs: list = []
    live: dict = {}

    def cut(name: str) -> None:
        if "g" in live:  # the stage that just ended is the one this mark names
            live.pop("g").capture_end()
            graphs[-1] = (name, graphs[-1][1])
        if name != "end":
            g = torch.cuda.CUDAGraph()
            graphs.append(("?", g))
            g.capture_begin(pool=pool)
            live["g"] = g

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(cut)
        live.pop("g").capture_end()  # what follows the last stage mark: packing (n_accept, first_stop)
        graphs[-1] = ("pack", graphs[-1][1])
    torch.cuda.current_stream().wait_stream(side)
    restore()
    torch.cuda.synchronize()
    return graphs


def time_stage_graphs(graphs, restore, reps: int = 20, warmup: int = 3) -> dict[str, float]:
    """Median device ms per stage graph over `reps` replays of the whole sequence (restoring state before each,
    outside the timed spans); "sum" is the step."""
    per = defaultdict(list)
    for r in range(warmup + reps):
        restore()
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(len(graphs) + 1)]
        evs[0].record()
        for i, (_, g) in enumerate(graphs):
            g.replay()
            evs[i + 1].record()
        if r >= warmup:
            per["_events"].append(evs)
    torch.cuda.synchronize()
    out = defaultdict(list)
    for evs in per["_events"]:
        total = 0.0
        for i, (name, _) in enumerate(graphs):
            ms = evs[i].elapsed_time(evs[i + 1])
            out[name].append(ms)
            total += ms
        out["sum"].append(total)
    return {k: statistics.median(v) for k, v in out.items()}


def median_ms(fn, device: torch.device, reps: int, warmup: int) -> float:
    """Median milliseconds of fn() over reps after warmup calls: CUDA events around each call on a GPU (each call
    waited for), the host clock on a CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 31, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (median of reps)."""
    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = median_ms(lambda: b.copy_(a), device, reps, warmup=2)
    del a, b
    return 2 * nbytes / (ms / 1000)


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int = 8192, reps: int = 10) -> float:
    """The device's measured dense matmul rate in FLOP/s: an n x n by n x n product in dtype (2 n^3 FLOP), the
    median of reps after 2 warmup products. A compute floor divides a step's FLOP by it, as a byte floor divides
    its bytes by copy_bandwidth: both are what this device sustains, not its datasheet's peaks."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=device).to(dtype)
    b = torch.randn(n, n, generator=g, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    ms = median_ms(lambda: torch.mm(a, b, out=out), device, reps, warmup=2)
    del a, b, out
    return 2 * n ** 3 / (ms / 1000)
