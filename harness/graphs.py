"""Deliberate capture: a fixed-shape tensor function recorded once as a CUDA graph, then replayed.

Warmup runs on a side stream first (lazy initialisation and, for compiled functions, compilation happen there),
then one capture. Replay copies the new inputs into the static buffers; outputs live in static buffers too, so a
caller must consume them before the next replay (the decode loop does: a step ends before the next begins).
"""
from __future__ import annotations

from typing import Callable

import torch

from drafters.base import Proposal
from harness.errors import UsageError
from refiners.base import RefineContext


class CapturedFn:
    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], example: tuple[torch.Tensor, ...],
                 warmup: int = 3):
        if not example or example[0].device.type != "cuda":
            raise UsageError("--use-graph needs a CUDA device; drop it on CPU")
        self.inputs = tuple(t.clone() for t in example)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = fn(*self.inputs)

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for buf, x in zip(self.inputs, args):
            buf.copy_(x)
        self.graph.replay()
        return self.outputs


def refine_tensors(refiner, sampler=None) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The refiner as a pure tensor function, the unit that is compiled and captured. A draft sampler's frozen
    noise is read from its (persistent) buffer, refreshed in place before each block."""
    def fn(tokens, logits, hidden, anchor, prev):
        out = refiner.refine(Proposal(tokens=tokens, logits=logits, hidden=hidden),
                             RefineContext(anchor=anchor, prev_token=prev, sampler=sampler))
        return out.tokens, out.logits
    return fn


class AcceleratedRefiner:
    """Wraps a refiner: optionally torch.compile'd, optionally captured as one CUDA graph on its first call."""

    def __init__(self, refiner, use_graph: bool = False, compile: bool = False):
        self.inner, self.use_graph, self.compile = refiner, use_graph, compile
        self.name, self.passes = refiner.name, refiner.passes
        self.fns: dict = {}       # per draft sampler (None = greedy): the tensor function, compiled if asked
        self.captured: dict = {}  # per draft sampler: its CUDA graph
        self.graph_count = 0

    def _fn(self, sampler):
        if sampler not in self.fns:
            fn = refine_tensors(self.inner, sampler)
            self.fns[sampler] = torch.compile(fn, dynamic=False) if self.compile else fn
        return self.fns[sampler]

    def refine(self, proposal: Proposal, ctx: RefineContext) -> Proposal:
        args = (proposal.tokens, proposal.logits, proposal.hidden, ctx.anchor, ctx.prev_token)
        fn = self._fn(ctx.sampler)
        if not self.use_graph:
            tokens, logits = fn(*args)
        else:
            if ctx.sampler not in self.captured:
                self.captured[ctx.sampler] = CapturedFn(fn, args)
                self.graph_count += 1
            tokens, logits = self.captured[ctx.sampler](*args)
        return proposal.with_tokens(tokens, logits)
