"""The default (non-batch-invariant) Triton path is main's, to the byte (issue 28): the batch-invariant kernels sit
beside it (core/kernels/invariant.py), and nothing of theirs may change what every user's default CUDA path
compiles or launches, since every speedup divides by its AR step and none of it has run on a GPU.

Pinned from main before the invariant kernels (commit 1ae01ae; `python tests/test_kernel_defaults.py` prints the
pins of a checkout): the source of every default @triton.jit function, choose_linear's tiles for 1..64 rows at
the SmolLM2-135M and Qwen3-8B shapes, fits(), and every launch (grid, scalars, constexprs, warps, stages,
buffers) that linear, rms_norm, silu_mul, the argmax reduction, attention and write_kv make at those shapes,
with and without PDL and a shared-memory limit. A deliberate change to the default path updates the pins, with
the GPU measurement that justifies it (results/perf/NOTES.md). Updated for fab8c94's change to the attention kernel, its
request axis (a grid of (n_kv, splits, 1) and one more stride for one request; B = 1 on the H200 unchanged: the
graphed AR step 4.42 ms against 4.40 before at Qwen3-8B's shape, results/perf/bench_batch_qwen3-8b_{rows,sdpa}).
Updated for the shared-memory count of 64-row tiles (matmul.buffers): Qwen3-8B's q/k/v tile at 33-64 rows, which
the H200 refused in a B = 4 verify (262144 bytes of shared memory against 232448, 2026-12-04, results/perf/NOTES.md);
every tile up to 32 rows, and every launch that ran on the GPU, unchanged."""
import hashlib
import inspect
import json
import sys

import pytest
import torch

from kernel_env import pytestmark  # noqa: F401  (sets TRITON_INTERPRET first)
from core import kernels  # noqa: E402

H200 = 232448  # an H200's shared memory per program
LINEARS = {"SmolLM2-135M": [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)],
           "Qwen3-8B": [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)]}
HEADS = {"SmolLM2-135M": (9, 3, 64, False), "Qwen3-8B": (32, 8, 128, True)}  # n_q, n_kv, head_dim, q/k norms
DEFAULT_JIT = {"common": ["after_previous"], "matmul": ["_prefetch_l2", "_linear_kernel"],
               "attention": ["_norm_rope", "_store_kv", "_kv_write_kernel", "_attention_kernel"],
               "rows": ["_argmax_reduce_kernel", "_rmsnorm_kernel", "_silu_mul_kernel"]}
LAUNCHED = {"matmul": ["_linear_kernel"], "attention": ["_attention_kernel", "_kv_write_kernel"],
            "rows": ["_argmax_reduce_kernel", "_rmsnorm_kernel", "_silu_mul_kernel"]}


def _module(name):
    return sys.modules[f"core.kernels.{name}"]


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def sources() -> dict:
    """Kernel name -> a digest of its Python source (what Triton compiles)."""
    return {f"{mod}.{fn}": _digest(inspect.getsource(getattr(getattr(_module(mod), fn), "fn", None) or
                                                     getattr(_module(mod), fn)))
            for mod, fns in DEFAULT_JIT.items() for fn in fns}


def tiles() -> dict:
    """'n,k' -> choose_linear's tiles by row count, as runs 'first-last: block_n,block_k,warps,stages,dot', per
    (bytes per value, shared-memory limit)."""
    out = {}
    for n, k in sum(LINEARS.values(), []):
        for elem, limit in ((2, None), (2, H200), (4, H200)):
            runs, last = [], None
            for m in range(1, kernels.MAX_ROWS + 1):
                c = kernels.choose_linear(m, n, k, elem, limit)
                cfg = f"{c.block_n},{c.block_k},{c.warps},{c.stages},{int(c.dot)}"
                if cfg == last:
                    runs[-1][1] = m
                else:
                    runs.append([m, m, cfg])
                last = cfg
            out[f"{n},{k} elem={elem} limit={limit}"] = " ".join(f"{a}-{b}: {c}" for a, b, c in runs)
    return out


def fits_table() -> str:
    """fits(tokens, groups) for groups 1..8 (rows) and tokens 1..70 (columns), as 0/1."""
    return " ".join("".join(str(int(kernels.fits(t, g))) for t in range(1, 71)) for g in range(1, 9))


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kw)` records the launch instead of running it."""

    def __init__(self, name, seen):
        self.name, self.seen = name, seen

    def __getitem__(self, grid):
        def launch(*args, **kw):
            def desc(a):
                if isinstance(a, torch.Tensor):
                    return ["tensor", list(a.shape), list(a.stride()), str(a.dtype)]
                return a if isinstance(a, (int, float, str, bool, type(None))) else str(a)
            self.seen.append([self.name, list(grid), [desc(a) for a in args], {k: desc(v) for k, v in kw.items()}])
        return launch


def launches(monkeypatch) -> dict:
    """'family model setting' -> a digest of every launch the default entry points make at those shapes."""
    seen = []
    for mod, names in LAUNCHED.items():
        for name in names:
            monkeypatch.setattr(_module(mod), name, Recorder(name, seen))
    meta = dict(device="meta")
    out = {}
    for pdl, limit in ((False, None), (True, H200)):
        monkeypatch.setattr(_module("common"), "pdl_supported", lambda device, on=pdl: on)
        monkeypatch.setattr(_module("matmul"), "shared_memory_limit", lambda device, lim=limit: lim)
        launch = kernels.Launch(pdl=pdl)
        for model, shapes in LINEARS.items():
            for dtype in (torch.bfloat16, torch.float32):
                seen.clear()
                for n, k in shapes:
                    w, g = torch.empty(n, k, dtype=dtype, **meta), torch.empty(k, dtype=dtype, **meta)
                    for m in range(1, kernels.MAX_ROWS + 1):
                        x, x2 = torch.empty(m, k, dtype=dtype, **meta), torch.empty(m, 2 * k, dtype=dtype, **meta)
                        r = torch.empty(m, n, dtype=dtype, **meta)
                        kernels.linear(x, w, norm=g, eps=1e-6, launch=launch)
                        kernels.linear(x, w, residual=r, argmax=True, launch=launch)
                        kernels.linear(x2, w, gated=True, residual=r, launch=launch)
                assert seen, model
                out[f"linear {model} {dtype} pdl={pdl}"] = _digest(seen)
        for model, (n_q, n_kv, d, norm) in HEADS.items():
            seen.clear()
            cnt = torch.empty(n_kv, dtype=torch.int32, **meta)
            qn = torch.empty(d, dtype=torch.bfloat16, **meta) if norm else None
            for cap in (64, 640, 4608, 40960):
                kc = torch.empty(n_kv, cap, d, dtype=torch.bfloat16, **meta)
                for t in range(1, kernels.MAX_ROWS + 1):
                    qkv = torch.empty(t, (n_q + 2 * n_kv) * d, dtype=torch.bfloat16, **meta)
                    cs, pos = torch.empty(t, d, dtype=torch.bfloat16, **meta), torch.empty(t, dtype=torch.long, **meta)
                    for causal, lch in ((True, launch), (False, launch), (True, kernels.Launch(pdl, 1))):
                        kernels.attention(qkv, qn, qn, 1e-6, cs, cs, pos, kc, kc, n_q, d ** -0.5, causal=causal,
                                          counters=cnt, launch=lch)
                    kernels.write_kv(qkv[:, :2 * n_kv * d], qn, 1e-6, cs, cs, pos, kc, kc, launch)
            assert seen, model
            out[f"attention {model} pdl={pdl}"] = _digest(seen)
    return out


# recorded from main at 572be98 (its core/kernels as at 1ae01ae, where h/inv branched)
PINNED_SOURCES = {
    'common.after_previous': '4fb578447e7ba698',
    'matmul._prefetch_l2': '34396d593be8f362',
    'matmul._linear_kernel': '35af60af2a54771f',
    'attention._norm_rope': '6a2c7387e982a7a8',
    'attention._store_kv': '70d8023838bef3bc',
    'attention._kv_write_kernel': '5de4e2f82f690b8f',
    'attention._attention_kernel': 'f323f714a89fd2db',
    'rows._argmax_reduce_kernel': '1362eded4f3f8356',
    'rows._rmsnorm_kernel': 'dc917bcb1a540830',
    'rows._silu_mul_kernel': 'e668e72a8a48d401',
}
PINNED_TILES = {
    '960,576 elem=2 limit=None': '1-1: 16,64,4,1,0 2-64: 32,64,4,4,1',
    '960,576 elem=2 limit=232448': '1-1: 16,64,4,1,0 2-64: 32,64,4,4,1',
    '960,576 elem=4 limit=232448': '1-1: 16,64,4,1,0 2-64: 32,64,4,4,1',
    '576,576 elem=2 limit=None': '1-1: 16,64,4,1,0 2-64: 32,64,4,4,1',
    '576,576 elem=2 limit=232448': '1-1: 16,64,4,1,0 2-64: 32,64,4,4,1',
    '576,576 elem=4 limit=232448': '1-1: 16,64,4,1,0 2-64: 32,64,4,4,1',
    '3072,576 elem=2 limit=None': '1-1: 16,64,4,1,0 2-64: 32,64,4,4,1',
    '3072,576 elem=2 limit=232448': '1-1: 16,64,4,1,0 2-64: 32,64,4,4,1',
    '3072,576 elem=4 limit=232448': '1-1: 16,64,4,1,0 2-64: 32,64,4,4,1',
    '576,1536 elem=2 limit=None': '1-1: 16,512,4,1,0 2-64: 32,512,4,4,1',
    '576,1536 elem=2 limit=232448': '1-1: 16,512,4,1,0 2-32: 32,512,4,4,1 33-64: 32,256,4,4,1',
    '576,1536 elem=4 limit=232448': '1-1: 16,512,4,1,0 2-32: 32,256,4,4,1 33-64: 32,128,4,4,1',
    '49152,576 elem=2 limit=None': '1-64: 64,64,4,3,1',
    '49152,576 elem=2 limit=232448': '1-64: 64,64,4,3,1',
    '49152,576 elem=4 limit=232448': '1-64: 64,64,4,3,1',
    '6144,4096 elem=2 limit=None': '1-1: 8,512,4,1,0 2-64: 64,256,4,4,1',
    '6144,4096 elem=2 limit=232448': '1-1: 8,512,4,1,0 2-32: 64,256,4,4,1 33-64: 64,128,4,4,1',
    '6144,4096 elem=4 limit=232448': '1-1: 8,512,4,1,0 2-32: 64,128,4,4,1 33-64: 64,64,4,4,1',
    '4096,4096 elem=2 limit=None': '1-1: 16,1024,4,1,0 2-64: 32,512,4,4,1',
    '4096,4096 elem=2 limit=232448': '1-1: 16,1024,4,1,0 2-32: 32,512,4,4,1 33-64: 32,256,4,4,1',
    '4096,4096 elem=4 limit=232448': '1-1: 16,1024,4,1,0 2-32: 32,256,4,4,1 33-64: 32,128,4,4,1',
    '24576,4096 elem=2 limit=None': '1-64: 64,128,4,3,1',
    '24576,4096 elem=2 limit=232448': '1-64: 64,128,4,3,1',
    '24576,4096 elem=4 limit=232448': '1-64: 64,128,4,3,1',
    '4096,12288 elem=2 limit=None': '1-1: 4,1024,4,1,0 2-64: 32,512,4,4,1',
    '4096,12288 elem=2 limit=232448': '1-1: 4,1024,4,1,0 2-32: 32,512,4,4,1 33-64: 32,256,4,4,1',
    '4096,12288 elem=4 limit=232448': '1-1: 4,1024,4,1,0 2-32: 32,256,4,4,1 33-64: 32,128,4,4,1',
    '151936,4096 elem=2 limit=None': '1-64: 64,128,4,3,1',
    '151936,4096 elem=2 limit=232448': '1-64: 64,128,4,3,1',
    '151936,4096 elem=4 limit=232448': '1-64: 64,128,4,3,1',
}
PINNED_FITS = ('1111111111111111111111111111111111111111111111111111111111111111000000 '
               '1111111111111111111111111111111111111111111111111111111111111111000000 '
               '1111111111111111111111111111111111111111110000000000000000000000000000 '
               '1111111111111111111111111111111100000000000000000000000000000000000000 '
               '1111111111111111111111111000000000000000000000000000000000000000000000 '
               '1111111111111111111110000000000000000000000000000000000000000000000000 '
               '1111111111111111110000000000000000000000000000000000000000000000000000 '
               '1111111111111111000000000000000000000000000000000000000000000000000000')
PINNED_LAUNCHES = {
    'linear SmolLM2-135M torch.bfloat16 pdl=False': '22a8434efcfc5141',
    'linear SmolLM2-135M torch.float32 pdl=False': '20ebd7b15c6967e3',
    'linear Qwen3-8B torch.bfloat16 pdl=False': 'e03b98216197df7b',
    'linear Qwen3-8B torch.float32 pdl=False': 'ebbe3030e31e29df',
    'attention SmolLM2-135M pdl=False': '1182216f4b480cd8',
    'attention Qwen3-8B pdl=False': 'c49eea05ec8cc6d8',
    'linear SmolLM2-135M torch.bfloat16 pdl=True': '2e500308d3aca32b',
    'linear SmolLM2-135M torch.float32 pdl=True': '7a3d4fe5f820b8e9',
    'linear Qwen3-8B torch.bfloat16 pdl=True': '08ca8a826b36b439',
    'linear Qwen3-8B torch.float32 pdl=True': 'a7cd04ade35936d4',
    'attention SmolLM2-135M pdl=True': 'f99d404f6abed260',
    'attention Qwen3-8B pdl=True': '7d77c38a5318bc71',
}


def test_the_default_kernels_source_is_mains():
    """Fails if any default @triton.jit function's source differs from main's (h/inv's row loops in _store_kv
    and _attention_kernel, its M_TILES in _linear_kernel, its interpreter upcast in their dots all did)."""
    assert sources() == PINNED_SOURCES


def test_the_default_tiles_and_fits_are_mains():
    """Fails if choose_linear's tiles for 1..64 rows at the two models' shapes, or fits(), differ from main's
    (h/inv's fits() without the 128-query-row cap when invariant kept main's default; this pins it)."""
    assert tiles() == PINNED_TILES
    assert fits_table() == PINNED_FITS
    assert not kernels.fits(33, 4) and kernels.fits(33, 4, invariant=True)  # Qwen3-8B past 32 rows: invariant only


def test_the_default_launches_are_mains(monkeypatch):
    """Fails if any launch of the default entry points (kernels.linear with a norm, a residual and argmax, gated;
    attention causal, the drafter's block and one split; write_kv) at the two models' shapes, 1..64 rows, with and
    without PDL and H200's shared-memory limit, differs from main's in grid, arguments, constexprs, warps or
    stages (h/inv's 1-d grid times M_TILES and its extra kernel arguments did)."""
    assert launches(monkeypatch) == PINNED_LAUNCHES


def test_the_interpreter_upcast_is_the_interpreters_alone(monkeypatch):
    """The invariant kernels take 16-bit dot operands to fp32 under Triton's interpreter only (numpy has no bf16):
    compiled for a GPU their UPCAST constexpr is False, the plain tensor-core dot; fp32 never upcasts. (The
    default kernels have no such argument: their source is main's, above.)"""
    from core.kernels.invariant import upcast
    for flag, want in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv("TRITON_INTERPRET", flag)
        assert upcast(torch.bfloat16) is want and upcast(torch.float16) is want and not upcast(torch.float32)


if __name__ == "__main__":  # print this checkout's pins (run from tests/, with the checkout on PYTHONPATH)
    mp = pytest.MonkeyPatch()
    try:
        print(json.dumps({"sources": sources(), "tiles": tiles(), "fits": fits_table(), "launches": launches(mp)},
                         indent=1))
    finally:
        mp.undo()
