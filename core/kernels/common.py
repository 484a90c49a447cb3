"""What every kernel family shares: the Triton import, the launch settings and programmatic dependent launch.

Contract for all of core.kernels: tensors on one CUDA device (or CPU tensors under TRITON_INTERPRET=1,
the tests' way to run them), row-major rows, fp32/bf16/fp16; launches of one forward are queued on one stream, in
order (PDL lets a launch start early, but each waits on the device for the one before it before reading its
inputs).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch ops are used instead (core.ops.make_ops checks `available()`)
    triton = None
    tl = None
try:  # grid dependency control (programmatic dependent launch): Triton releases from 2025 on
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = True
except ImportError:  # the kernels still run, without PDL (the names are only read under PDL=True)
    gdc_launch_dependents = gdc_wait = None
    HAS_GDC = False

MAX_ROWS = 64     # new rows one matmul or attention call takes (verify blocks up to 64 tokens)
MAX_SPLITS = 16  # programs per K/V head that share one attention's slots


def available() -> bool:
    return triton is not None


def interpreted() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1)."""
    return triton is not None and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class Launch:
    """How the kernels are launched; one object, made once and passed to every call.

    pdl: programmatic dependent launch for launches of several rows (a launch starts while the one before it
    drains and waits on the device for its writes; Hopper and later; `resolve` turns None into what the GPU
    supports; a call given None checks each time). attention_splits: programs per K/V head in `attention` (None: by the cache's capacity, up to
    MAX_SPLITS). batch_invariant (opt-in, issue 28): `core.kernels.linear` and `attention` run the kernels of
    core.kernels.invariant instead, which compute a row the same way whatever the number of rows beside it
    (1..MAX_ROWS); the default kernels (matmul, attention) are untouched by it. wide_rows (opt-in, unmeasured):
    core.ops.TritonOps runs linear and rms_norm calls of more than MAX_ROWS rows (a batched verify or draft from
    B x W = 128) on the kernels, the matmul as launches over row tiles of MAX_ROWS (core.kernels.matmul
    .wide_linear, WIDE_ROWS at most), instead of the torch ops. one_row_pdl: PDL for launches of one row too
    (None or False: several rows only); core.ops.make_ops sets it for a launch-bound target (core.ops.triton_impl
    .launch_bound). It changes no bit, as PDL never does. The settings the measurements settled
    (results/perf/NOTES.md) are constants, not levers."""
    pdl: bool | None = False
    attention_splits: int | None = None
    batch_invariant: bool = False
    wide_rows: bool = False
    one_row_pdl: bool | None = None

    def __post_init__(self):
        s = self.attention_splits
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= MAX_SPLITS):
            raise ValueError(f"attention_splits must be None or in 1..{MAX_SPLITS}, got {s!r}")
        if s is not None and self.batch_invariant:
            raise ValueError("attention_splits does not combine with batch_invariant (its split is by slot index)")
        if self.wide_rows and self.batch_invariant:
            raise ValueError("wide_rows does not combine with batch_invariant (its kernels take 1..MAX_ROWS rows)")
        if not (self.one_row_pdl is None or isinstance(self.one_row_pdl, bool)):
            raise ValueError(f"one_row_pdl must be None, False or True, got {self.one_row_pdl!r}")

    def resolve(self, device: torch.device) -> "Launch":
        """pdl=None becomes whether `device` supports it."""
        if self.pdl is not None:
            return self
        return replace(self, pdl=pdl_supported(device))


@lru_cache(maxsize=None)
def _capability_at_least_hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: compiled kernels on a Hopper or later GPU."""
    device = torch.device(device)
    if device.type != "cuda" or interpreted() or triton is None or not HAS_GDC:
        return False
    return _capability_at_least_hopper(device.index if device.index is not None else torch.cuda.current_device())


def launch_opts(launch: Launch, device: torch.device, rows: int) -> dict:
    """The PDL constexpr and, when on, the launch attribute that lets the kernel start early: launches of several
    rows, and of one row under Launch.one_row_pdl (at one row PDL was neutral or slower at Qwen3-8B's shapes,
    results/perf/NOTES.md; a launch-bound target's one-row launches are what it hides)."""
    on = (rows > 1 or bool(launch.one_row_pdl)) and launch.pdl is not False and pdl_supported(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@lru_cache(maxsize=None)
def _shared_bytes(index: int) -> int | None:
    try:  # Triton's own figure, the one its out-of-resources error names (driver utils, Triton 3.5-3.6)
        return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # another Triton's driver API: torch's figure, else no limit (the tiles as chosen)
        return getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", None)


def shared_memory_limit(device: torch.device) -> int | None:
    """Bytes of shared memory one program may take on `device`; None where there is no such limit (the CPU
    interpreter) or it cannot be read."""
    device = torch.device(device)
    if device.type != "cuda" or interpreted() or triton is None:
        return None
    return _shared_bytes(device.index if device.index is not None else torch.cuda.current_device())


def pow2_at_least(n: int, lo: int) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


def prec(dtype: torch.dtype) -> str | None:
    """fp32 products in full precision (tensor cores would round the inputs to tf32); other dtypes: the default."""
    return "ieee" if dtype == torch.float32 else None


after_previous = rounded = None  # without Triton: every module here still imports (its kernels are never launched)
if triton is not None:
    @triton.jit
    def rounded(x, dt: tl.constexpr):
        """x rounded to dt and back to fp32: where a torch op would have written its output in the model's dtype."""
        return x.to(dt).to(tl.float32)

    @triton.jit
    def after_previous(PDL: tl.constexpr):
        """With programmatic dependent launch this launch may start while the one before it drains: wait for it
        (its writes are this launch's inputs), then let the next launch start early in turn."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
