"""Deliberate capture: a fixed-shape tensor function recorded once as a CUDA graph, then replayed.

Warmup runs on a side stream first (lazy initialisation and, for compiled functions, compilation happen there),
then one capture. Replay copies the new inputs into the static buffers; outputs live in static buffers too, so a
caller must consume them before the next replay (the decode loop does: a step ends before the next begins).

Two granularities:
- `CompiledRefiner`: only the refinement step, through torch.compile (--compile-refiner); the lab captures it
  alone as a graph (harness.lab.captured, the reference's --use-graph granularity).
- `StepGraphs`: the whole decode step (draft, refine, verify, accept, commit, observe) of harness.decode.loop.Stepper,
  one graph per (arm, width, KV-length bucket), all sharing one memory pool. The graphs read persistent state by
  address (output buffer, target.pos, drafter.ctx, KV caches, sampler noise, one generator), so those buffers
  live in the decode's state (harness.decode.state: output, stop ids, noise, gaps), here (the generator) or on
  their owners (caches, pos, ctx) and are never reallocated while a graph uses them; when a cache or the output
  buffer is reallocated, the graphs that read it are dropped and captured again.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from core.protocols import Proposal, RefineContext
from core.errors import UsageError


def refine_tensors(refiner, sampler=None) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The refiner as a pure tensor function, the unit that is compiled and captured. A draft sampler's frozen
    noise is read from its (persistent) buffer, refreshed in place before each block."""
    def fn(tokens, logits, hidden, anchor, prev):
        out = refiner.refine(Proposal(tokens=tokens, logits=logits, hidden=hidden),
                             RefineContext(anchor=anchor, prev_token=prev, sampler=sampler))
        return out.tokens, out.logits
    return fn


class CompiledRefiner:
    """A refiner whose refinement runs through torch.compile (--compile-refiner, --compile-all): one compiled
    tensor function per draft sampler (None = greedy), at fixed shapes. It captures no graph of its own, so it runs
    as is inside a whole-step graph."""
    compile = True  # (the runner's --compile-all check reads it)

    def __init__(self, refiner, watch=None):
        self.inner, self.watch = refiner, watch
        self.name, self.passes = refiner.name, refiner.passes
        self.fns: dict = {}

    def _fn(self, sampler):
        if sampler not in self.fns:
            fn = refine_tensors(self.inner, sampler)
            self.fns[sampler] = self.watch.compile(fn) if self.watch else torch.compile(fn, dynamic=False)
        return self.fns[sampler]

    def refine(self, proposal: Proposal, ctx: RefineContext) -> Proposal:
        tokens, logits = self._fn(ctx.sampler)(proposal.tokens, proposal.logits, proposal.hidden, ctx.anchor,
                                                ctx.prev_token)
        return proposal.with_tokens(tokens, logits)


def check_use_graph(use_graph: bool, device_kind: str) -> None:
    """THE check that --use-graph runs on CUDA (the decode loop and StepGraphs call it; so should a run's
    preparation, before any model loads)."""
    if use_graph and device_kind != "cuda":
        raise UsageError(f"--use-graph captures CUDA graphs and needs --device cuda; drop it on {device_kind}")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _ptr(obj) -> int | None:
    kv = getattr(obj, "kv", None)
    return None if kv is None else kv.k.data_ptr()


@dataclass
class _Entry:
    graph: object
    out: object          # the StepOut of the capture: static tensors, rewritten by every replay
    refs: tuple          # keeps the keyed objects alive, so that their ids are never reused by others
    layout: tuple


class StepGraphs:
    """Whole-step CUDA graphs of one target, captured lazily, replayed by harness.decode.loop.generate(use_graph=True);
    held by the decode's state (harness.decode.state.DecodeState.step_graphs)."""

    rng_unsupported = ("T>0 steps ran eagerly: this torch's CUDAGraph has no register_generator_state, so a "
                       "graph cannot draw from a per-(prompt, turn) generator")

    def __init__(self, device: torch.device):
        check_use_graph(True, device.type)
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.entries: dict = {}
        self.rng = torch.Generator(device=device)
        self.captures = 0          # graphs captured so far (recaptures after a cache grew included)
        self.capture_s = 0.0       # host seconds spent warming up and capturing

    # --- sizes -----------------------------------------------------------------------------------------------------
    @staticmethod
    def capacity_for(need: int, bucket: int) -> int:
        """Round a cache size up to whole buckets, so the last bucket never reads past the cache."""
        return _round_up(need, bucket) if bucket else need

    @staticmethod
    def length(needed: int, bucket: int, capacity: int) -> int:
        """KV slots a step attends over (masked beyond its positions): a bucket boundary, or the whole cache."""
        return min(_round_up(needed, bucket), capacity) if bucket else capacity

    # --- randomness --------------------------------------------------------------------------------------------
    @staticmethod
    def supports_rng() -> bool:
        return hasattr(torch.cuda.CUDAGraph, "register_generator_state")

    def adopt_rng(self, generator: torch.Generator | None) -> bool:
        """Move a generator's state into the one generator every graph is registered with (False: unsupported)."""
        if not self.supports_rng():
            return False
        self.rng.set_state(self._source(generator).get_state())
        return True

    def return_rng(self, generator: torch.Generator | None) -> None:
        """Hand the advanced state back, as if the generation had drawn from `generator` itself."""
        self._source(generator).set_state(self.rng.get_state())

    def _source(self, generator):
        return generator if generator is not None else torch.cuda.default_generators[self.device.index or 0]

    # --- capture and replay ------------------------------------------------------------------------------------
    def _layout(self, stepper) -> tuple:
        return (stepper.out.data_ptr(), _ptr(stepper.target), _ptr(stepper.drafter))

    def run(self, stepper, speculative: bool, width: int, length: int):
        """Replay (capturing first if needed) the step of `stepper`'s arm at this shape; returns its StepOut."""
        key = (id(stepper.drafter), id(stepper.refiner), id(stepper.sampler), id(stepper.stops),
               stepper.params, stepper.scripted, getattr(stepper, "gaps", None) is not None, speculative, width, length)
        live = [stepper.target.pos] + ([stepper.drafter.ctx] if hasattr(stepper.drafter, "ctx") else [])
        return self.replay(key, self._layout(stepper), lambda: stepper.step(speculative, width, length), live,
                           uses_rng=stepper.generator is self.rng,
                           refs=(stepper, stepper.drafter, stepper.refiner, stepper.sampler, stepper.stops))

    def ensure(self, key, layout: tuple, step: Callable, live: list, uses_rng: bool = False, refs: tuple = ()):
        """The graph of `step` under `key`, captured now unless one with this buffer layout is held; returns
        (entry, captured now). `step()` is a fixed-shape function of persistent state whose only state changes
        that matter are to the tensors in `live` (restored after each warmup run); layout: the addresses of the
        buffers it reads, whose change drops every graph that read the old ones (the first two elements)."""
        entry = self.entries.get(key)
        if entry is not None and entry.layout == layout:
            return entry, False
        # a cache or the output buffer was reallocated: graphs reading the old ones are useless
        kept = {k: e for k, e in self.entries.items() if e.layout[:2] == layout[:2] and k != key}
        if len(kept) < len(self.entries):
            # graphs were dropped: their pool may be released with them, and a released pool cannot take
            # new captures, so later captures go to a fresh pool
            self.pool = torch.cuda.graph_pool_handle()
        self.entries = kept
        entry = self.entries[key] = self._capture(step, live, uses_rng, refs, layout)
        return entry, True

    def replay(self, key, layout: tuple, step: Callable, live: list, uses_rng: bool = False, refs: tuple = ()):
        """Replay the graph of `step` under `key` (captured first if needed: `ensure`); returns its output."""
        entry, _ = self.ensure(key, layout, step, live, uses_rng, refs)
        entry.graph.replay()
        return entry.out

    def _capture(self, step: Callable, live: list, uses_rng: bool, refs: tuple, layout: tuple) -> _Entry:
        t0 = time.perf_counter()
        saved = [x.clone() for x in live]
        rng_state = self.rng.get_state() if uses_rng else None

        def restore():
            for x, s in zip(live, saved):
                x.copy_(s)
            if rng_state is not None:
                self.rng.set_state(rng_state)

        # Warm up (lazy init, cuBLAS handles, compilation) on a side stream, undoing each run's state changes:
        # the slots a run writes past the committed position are rewritten by the real step before any read.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
                restore()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if uses_rng:
            graph.register_generator_state(self.rng)
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        restore()  # capture launches nothing, but keep the invariant explicit
        torch.cuda.synchronize(self.device)
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        # refs: the stepper too, whose own small tensors (offsets, scripted counts) the graph reads
        return _Entry(graph, out, refs, layout)

    def stats(self) -> dict:
        return {"graphs": len(self.entries), "captures": self.captures, "capture_s": round(self.capture_s, 3)}

