"""Where a training step's host time goes, counted on the CPU (issue 26 item 3): `python -m training.step_cost`.

One step of `python -m training` at the real model shapes (SmolLM2-135M's config with random weights, the 5-layer
dflash drafter of training/configs/smollm2-gpu.json, hidden.mode=online), replayed call by call as speculators
0.9.0's `Trainer.train_epoch` makes them, with every aten op counted by a TorchDispatchMode and attributed to a
phase: the online target forward (OnlineTaps.compute), the drafter forward (its mask and anchors apart), the loss,
backward, clipping, the optimizer, speculators' loop and our glue (training/trainer.py's hooks, training/box.py).

Counted per op: all dispatched aten ops, those that are views (no kernel on a GPU), and the host-device syncs a
CUDA device would make: `.item()`/int()/bool() (`_local_scalar_dense`), data-dependent shapes (nonzero, boolean
mask indexing, bincount (a min and a max), repeat_interleave without output_size, unique, masked_select) and, at
the Python level, `.tolist()`/`.cpu()`. What a CPU run cannot see: blocking host-to-device copies
(`torch.tensor(list, device=cuda)`: a stream synchronisation each), named in the JSON from reading the code.

The CPU only counts: the kernels' own time on the H200 is not here. `dispatch_us` is this CPU's eager cost of one
small op, a lower bound on the host cost per launch (a CUDA launch adds the driver's few microseconds).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NO_KERNEL = {"detach", "alias", "lift_fresh", "_unsafe_view", "empty", "empty_strided", "sym_size", "sym_stride",
             "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type", "set_"}
DATA_DEPENDENT = {"_local_scalar_dense": 1, "nonzero": 1, "masked_select": 1, "bincount": 2, "_unique2": 1,
                  "unique_dim": 1, "unique_consecutive": 1, "equal": 1, "is_nonzero": 1, "nonzero_static": 0}


def sync_weight(func, args, kwargs) -> int:
    """How many host-device syncs this aten call makes on a CUDA device (0 for most)."""
    name = func._overloadpacket.__name__
    if name in DATA_DEPENDENT:
        return DATA_DEPENDENT[name]
    if name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor"):
        return int(kwargs.get("output_size") is None)  # the output's length is the repeats' sum
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        idx = args[1] if len(args) > 1 else []
        return int(any(i is not None and i.dtype == torch.bool for i in idx))
    return 0


class StepCounter(TorchDispatchMode):
    """aten ops and would-be syncs by phase (`with counter.phase(name)`); Python-level host reads patched in."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, Counter] = defaultdict(Counter)
        self.views: Counter = Counter()
        self.syncs: dict[str, Counter] = defaultdict(Counter)
        self.stack = ["unattributed"]
        self._saved = {}

    @property
    def current(self) -> str:
        return self.stack[-1]

    @contextlib.contextmanager
    def phase(self, name: str):
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        self.ops[self.current][name] += 1
        if func.is_view or name in NO_KERNEL:
            self.views[self.current] += 1
        w = sync_weight(func, args, kwargs)
        if w:
            self.syncs[self.current][name] += w
        return func(*args, **kwargs)

    def _host_read(self, what: str):
        orig = getattr(torch.Tensor, what)
        counter = self

        def read(t, *a, **k):
            counter.syncs[counter.current][f"Tensor.{what}"] += 1
            return orig(t, *a, **k)
        self._saved[what] = orig
        setattr(torch.Tensor, what, read)

    def __enter__(self):
        for what in ("tolist", "cpu", "numpy"):
            self._host_read(what)
        return super().__enter__()

    def __exit__(self, *exc):
        for what, orig in self._saved.items():
            setattr(torch.Tensor, what, orig)
        self._saved.clear()
        return super().__exit__(*exc)

    def table(self) -> dict:
        out = {}
        for ph in sorted(set(self.ops) | set(self.syncs)):
            ops = self.ops[ph]
            out[ph] = {"aten_ops": sum(ops.values()), "kernel_ops": sum(ops.values()) - self.views[ph],
                       "syncs": sum(self.syncs[ph].values()), "sync_ops": dict(self.syncs[ph]),
                       "top_ops": dict(ops.most_common(8))}
        return out


def total_syncs(counter: StepCounter) -> int:
    return sum(sum(c.values()) for c in counter.syncs.values())
