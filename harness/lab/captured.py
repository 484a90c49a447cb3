"""The refinement step alone as one CUDA graph (the reference harness's --use-graph granularity), for
harness.lab.bench_refiner and the GPU tests; the decode loop captures whole steps instead (harness.decode.graphs)."""
from __future__ import annotations

from typing import Callable

import torch

from core.protocols import Proposal, RefineContext
from harness.decode.graphs import CompiledRefiner, refine_tensors
from core.errors import UsageError


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


class CapturedRefiner:
    """A refiner (compiled first if asked) captured as one CUDA graph per draft sampler on its first call. Inside
    a capture already under way (a whole-step graph) it runs its function uncaptured: graphs do not nest."""

    def __init__(self, refiner, compile: bool = False, watch=None):
        self.inner = refiner
        self.name, self.passes = refiner.name, refiner.passes
        self._compiled = CompiledRefiner(refiner, watch) if compile else None
        self.fns: dict = {}
        self.captured: dict = {}
        self.graph_count = 0

    def _fn(self, sampler) -> Callable:
        if sampler not in self.fns:
            self.fns[sampler] = self._compiled._fn(sampler) if self._compiled else refine_tensors(self.inner, sampler)
        return self.fns[sampler]

    def refine(self, proposal: Proposal, ctx: RefineContext) -> Proposal:
        args = (proposal.tokens, proposal.logits, proposal.hidden, ctx.anchor, ctx.prev_token)
        fn = self._fn(ctx.sampler)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return proposal.with_tokens(*fn(*args))
        if ctx.sampler not in self.captured:
            self.captured[ctx.sampler] = CapturedFn(fn, args)
            self.graph_count += 1
        return proposal.with_tokens(*self.captured[ctx.sampler](*args))
