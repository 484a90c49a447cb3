"""--compile-all: torch.compile where it still helps, its cost reported, and recompiles after warmup refused.

With the target's and the drafter's layers on core.kernels, the stages left as chains of small torch ops are
the refinements (xPress's latent and scoring passes, the Markov head's sequential steps). Measured inside the
H200 step graph (results/perf/h200_qwen3-8b_compiled.md), compiling cut xPress K=6 from 0.92 to 0.61 ms and made
the Markov head slower (0.56 -> 0.97 ms), so --compile-all compiles refiners that do not declare
`compile_helps = False`. Every compiled function is compiled at a fixed shape (dynamic=False) during the warmup
generations; afterwards `freeze()` makes any recompile an error (a guard that fails mid-run would silently time a
recompilation), which the runner reports as a one-line failure.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

BACKENDS = ("inductor", "aot_eager", "eager")


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def recompile_error_types() -> tuple[type, ...]:
    from torch._dynamo import exc
    return tuple(t for t in (getattr(exc, "RecompileError", None), getattr(exc, "FailOnRecompileLimitHit", None))
                 if t is not None)


class CompileWatch:
    def __init__(self, backend: str = "inductor"):
        if backend not in BACKENDS:
            raise ValueError(f"compile backend {backend!r}: use one of {', '.join(BACKENDS)}")
        self.backend = backend
        self.functions = 0
        self.seconds = 0.0
        self._start = _unique_graphs()
        self.guarded = False  # whether freeze() ran: recompiles after it were refused
        cfg = torch._dynamo.config
        # one compiled refinement per arm shares one code object: let every arm have its own entry (until release)
        self._saved = {n: getattr(cfg, n) for n in ("recompile_limit", "cache_size_limit", "error_on_recompile")
                       if hasattr(cfg, n)}
        for name in ("recompile_limit", "cache_size_limit"):
            if name in self._saved:
                setattr(cfg, name, max(self._saved[name], 64))

    def compile(self, fn: Callable) -> Callable:
        """fn compiled at fixed shapes; calls that compiled something add their wall time to `seconds`."""
        compiled = torch.compile(fn, dynamic=False, backend=self.backend)
        self.functions += 1

        def run(*args):
            before = _unique_graphs()
            t0 = time.perf_counter()
            out = compiled(*args)
            if _unique_graphs() != before:
                self.seconds += time.perf_counter() - t0
            return out
        return run

    def freeze(self) -> None:
        """From now on a recompile raises (torch._dynamo.config.error_on_recompile) until `release()`."""
        torch._dynamo.config.error_on_recompile = True
        self.guarded = True

    def release(self) -> None:
        """Put back every dynamo setting this watch changed (the cache limits and the recompile guard)."""
        for k, v in self._saved.items():
            setattr(torch._dynamo.config, k, v)

    def stats(self) -> dict:
        return {"backend": self.backend, "functions": self.functions, "graphs": _unique_graphs() - self._start,
                "compile_s": round(self.seconds, 2), "recompile_guard": self.guarded}
