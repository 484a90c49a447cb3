"""core.kernels against the torch ops, kernel by kernel: on CUDA compiled, on CPU through Triton's
interpreter (skipped where Triton is not installed). tests/test_ops.py runs the models on them."""
import dataclasses
import os

import pytest
import torch

from kernel_env import DEV, DTYPES, pytestmark, rnd, tol  # noqa: F401  (sets TRITON_INTERPRET first)
from core import kernels  # noqa: E402
from core.cache import attend, causal_mask, rotate  # noqa: E402
from core.kernels.common import launch_opts  # noqa: E402


def _numpy_breaks_interpreter() -> bool:
    from kernel_env import numpy_breaks_interpreter
    return numpy_breaks_interpreter()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("k", [96, 256])
def test_linear_plain_norm_gated_residual(dtype, m, k):
    w = rnd(40, k, dtype=dtype, scale=0.1, seed=1)
    x = rnd(m, k, dtype=dtype, seed=2)
    g = rnd(k, dtype=dtype, seed=3)
    r = rnd(m, 40, dtype=dtype, seed=4)
    lin = torch.nn.functional.linear
    torch.testing.assert_close(kernels.linear(x, w), lin(x, w), **tol(dtype))
    normed = g * torch.nn.functional.rms_norm(x, (k,), None, 1e-6)
    torch.testing.assert_close(kernels.linear(x, w, norm=g, eps=1e-6, residual=r), r + lin(normed, w), **tol(dtype))
    x2 = rnd(m, 2 * k, dtype=dtype, seed=5)
    gate, up = x2.chunk(2, dim=-1)
    ref = lin(torch.nn.functional.silu(gate) * up, w)
    torch.testing.assert_close(kernels.linear(x2, w, gated=True), ref, **tol(dtype))
    one_row = kernels.LinearConfig(block_n=16, block_k=32, warps=4, stages=1, dot=m == 1)  # activation in the loop
    torch.testing.assert_close(kernels.linear(x2, w, gated=True, config=one_row), ref, **tol(dtype))


def test_linear_one_row_without_dot_and_bad_shapes():
    w, x = rnd(48, 64, scale=0.1), rnd(1, 64, seed=2)
    cfg = kernels.LinearConfig(block_n=16, block_k=32, warps=4, stages=1, dot=False)
    torch.testing.assert_close(kernels.linear(x, w, config=cfg), torch.nn.functional.linear(x, w), **tol(w.dtype))
    xt = rnd(64, 3, seed=3).t()  # rows not contiguous (e.g. a transposed mixer output): copied first
    rt = rnd(48, 3, seed=4).t()  # so is a residual whose columns are strided
    torch.testing.assert_close(kernels.linear(xt, w, residual=rt), rt + torch.nn.functional.linear(xt, w),
                               **tol(w.dtype))
    with pytest.raises(ValueError, match="does not fit"):
        kernels.linear(rnd(1, 32), w)
    with pytest.raises(ValueError, match="rows"):
        kernels.linear(rnd(kernels.MAX_ROWS + 1, 64), w)
    with pytest.raises(ValueError, match="norm and gated"):
        kernels.linear(rnd(1, 128), w, norm=rnd(64), eps=1e-6, gated=True)


def test_tiles_fit_the_shared_memory_they_are_given():
    """The tiles were chosen for bf16 at up to 16 rows. fp32 (or more rows) must not ask for more shared memory
    than the device has: an fp32 16-row down_proj at SmolLM2-135M's shapes asked an H200 for 294912 bytes."""
    from core.kernels.common import pow2_at_least, shared_memory_limit
    from core.kernels.matmul import SHARED_SPARE, buffers, fit_shared
    h200, small = 232448, 101376  # an H200's per-program limit; an sm_86/89 card's
    cfg = kernels.choose_linear(16, 576, 1536)
    assert fit_shared(cfg, 16, 512, 4, h200) == (256, cfg.stages)  # fp32: block_k halved
    assert fit_shared(cfg, 16, 512, 2, h200) == (512, cfg.stages)  # bf16: the measured tile, unchanged
    assert fit_shared(cfg, 16, 512, 4, None) == (512, cfg.stages)  # no limit known: as chosen
    assert fit_shared(cfg, 64, 512, 4, h200) == (128, cfg.stages)  # 64 rows: halved twice
    assert fit_shared(cfg, 64, 16, 4, 4096)[1] == 2  # then the stages, down to two
    # a B = 4 verify at Qwen3-8B's q/k/v shape (64 rows, bf16): 4 x (64 + 64) x 256 x 2 = 262144 bytes, which the
    # H200 refused (Triton 3.6 buffered all four stages there); the count of stages - 1 let it through
    from core.kernels import matmul
    qkv = kernels.choose_linear(64, 6144, 4096)
    assert (qkv.block_k, qkv.stages) == (256, 4)  # no limit given: the measured tile
    bk, st = fit_shared(qkv, 64, 256, 2, h200)
    assert st * (64 + qkv.block_n) * bk * 2 <= h200 - SHARED_SPARE and (bk, st) == (128, 4)
    # while 32 rows keep stages - 1: the bf16 o_proj tile that ran in the B = 2 verify (3 x 64 x 512 x 2 bytes)
    o = kernels.choose_linear(32, 4096, 4096)
    assert fit_shared(o, 32, 512, 2, h200) == (512, 4)
    # and the measured bf16 tiles of the models' own shapes at up to 16 rows stay as measured
    for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096), (960, 576), (576, 576),
                 (3072, 576), (576, 1536), (49152, 576)):
        for m in (2, 8, 16):
            measured = matmul._measured_tiles(m, n, k)
            if measured.dot:
                assert kernels.choose_linear(m, n, k, 2, h200) == measured, (m, n, k)
    for limit in (h200, small):
        for elem in (2, 4):
            for m in (1, 2, 16, 17, 33, 64):
                for n in (64, 576, 4096, 8192, 49152):
                    for k in (64, 576, 1536, 4096, 12288):
                        cfg = kernels.choose_linear(m, n, k)
                        if not (cfg.dot or m > 1):
                            continue
                        bm, bk0 = pow2_at_least(m, 16), min(cfg.block_k, pow2_at_least(k, 16))
                        bk, st = fit_shared(cfg, bm, bk0, elem, limit)
                        assert buffers(st, bm) * (bm + cfg.block_n) * bk * elem <= limit - SHARED_SPARE, \
                            (m, n, k, elem, limit)
                        if elem == 2 and m <= 16 and limit == h200:
                            assert (bk, st) == (bk0, cfg.stages), (m, n, k)
    if DEV.type == "cpu":
        assert shared_memory_limit(DEV) is None


def test_linear_launches_the_fitted_tiles(monkeypatch):
    """linear hands fit_shared the launch's padded rows, element size and the device's limit, and computes right on
    the smaller tile it gets back (the interpreter has no limit of its own: one is given here)."""
    from core.kernels import matmul
    seen = []
    real = matmul.fit_shared
    monkeypatch.setattr(matmul, "shared_memory_limit", lambda device: 40000)
    monkeypatch.setattr(matmul, "fit_shared", lambda *a: seen.append((a[1:], real(*a))) or seen[-1][1])
    w, x = rnd(40, 256, scale=0.1, seed=1), rnd(5, 256, seed=2)
    torch.testing.assert_close(kernels.linear(x, w), torch.nn.functional.linear(x, w), **tol(torch.float32))
    assert seen == [((16, 256, 4, 40000), (32, 4))]  # 3 x (16 + 32) x 32 x 4 bytes fit in 40000 - 8192
    kernels.linear(x[:1], w)  # one row, no tensor cores: nothing to fit
    assert len(seen) == 1


@pytest.mark.skipif(DEV.type != "cuda", reason="the interpreter has no shared-memory limit")
@pytest.mark.parametrize("m", [16, 64])
def test_fp32_blocks_at_real_shapes_run(m):
    """fp32 on the GPU at SmolLM2-135M's down_proj (k 1536 -> 576; gated with the residual, as the drafter calls
    it) and at Qwen3-8B's (12288 -> 4096): each launch fits, and matches the exact product (fp64). At these lengths
    the allowance is the standard forward-error bound of a dot product summed in any order (Higham, Accuracy and
    Stability of Numerical Algorithms, section 3.1): gamma_n = n u / (1 - n u) times the sum of |terms|, u = eps / 2,
    with n = k + 8 roundings in series: the sum's k, silu's exp and division (approximate in Triton's fp32, a few
    ulps: counted as 4), the product silu(gate) * up, the residual add and two to spare. A dropped 256-wide K tile
    (the fitted width at 16 rows) moves an output by about 0.2 at the smaller shape, against a bound of under 1e-3."""
    u = torch.finfo(torch.float32).eps / 2
    for n, k in ((576, 1536), (4096, 12288)):
        w, x2, r = rnd(n, k, scale=0.02, seed=1), rnd(m, 2 * k, seed=2), rnd(m, n, seed=3)
        gate, up = x2.double().chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate) * up
        want = r.double() + a @ w.double().t()
        gamma = (k + 8) * u / (1 - (k + 8) * u)
        bound = gamma * (a.abs() @ w.double().abs().t() + r.double().abs())
        err = (kernels.linear(x2, w, gated=True, residual=r).double() - want).abs()
        assert (err <= bound).all(), (n, k, float((err - bound).max()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,cfg", [(1, 300, None), (15, 300, None), (1, 300, "no-dot"), (4, 300, "narrow")])
def test_linear_argmax_matches_torch_with_ties(dtype, m, n, cfg):
    """The fused argmax: the lowest column among equal maxima (torch.argmax's rule), across program boundaries, with
    and without the residual (the xPress base logits); a NaN counts as +inf. "narrow": 16-column programs on the
    tensor-core loop, 19 of them at n = 300 (the last partial; the tied columns 7, 100, 150, 297 in programs 0, 6, 9
    and 18; the reduction's block of 32 masked): 1000 columns (63 programs, ~0.1 s each on the interpreter) tested
    nothing more."""
    config = {None: None, "no-dot": kernels.LinearConfig(block_n=16, block_k=32, warps=4, stages=1, dot=False),
              "narrow": kernels.LinearConfig(block_n=16, block_k=32, warps=4, stages=1)}[cfg]
    w = rnd(n, 64, dtype=dtype, scale=0.1, seed=1)
    w[n // 2] = w[n - 3] = w[7] = w[n // 3]  # equal rows give equal outputs in different programs
    x = rnd(m, 64, dtype=dtype, seed=2)
    x[0] = 0.0  # a row of all-equal outputs: the answer is column 0
    r = rnd(m, n, dtype=dtype, seed=3)
    for res in (None, r):
        y, ids = kernels.linear(x, w, residual=res, config=config, argmax=True)
        want = torch.nn.functional.linear(x, w) + (0 if res is None else res)
        torch.testing.assert_close(y, want.to(dtype), **tol(dtype))
        assert ids.dtype == torch.long and ids.shape == (m,)
        assert torch.equal(ids, y.argmax(-1)), (ids, y.argmax(-1))  # exactly torch's pick over the same values
    assert ids[0] == r[0].argmax() and kernels.linear(x, w, argmax=True)[1][0] == 0
    xn = x.clone()
    xn[-1, 5] = float("nan")  # the whole last row is NaN
    assert kernels.linear(xn, w, argmax=True, config=config)[1][-1] == 0


def torch_attention(qkv, qn, kn, eps, cos, sin, positions, kc, vc, n_q, scale):
    """The torch path's steps (harness.decode.target / core.cache), on one layer's cache slice."""
    t, n_kv, d = qkv.shape[0], kc.shape[0], kc.shape[-1]
    q, k, v = qkv.split([n_q * d, n_kv * d, n_kv * d], dim=-1)
    q, k, v = q.view(t, n_q, d), k.view(t, n_kv, d), v.view(t, n_kv, d)
    if qn is not None:
        q = qn * torch.nn.functional.rms_norm(q, (d,), None, eps)
        k = kn * torch.nn.functional.rms_norm(k, (d,), None, eps)
    q = rotate(q.transpose(0, 1), cos, sin)
    kc[:, positions] = rotate(k.transpose(0, 1), cos, sin)
    vc[:, positions] = v.transpose(0, 1)
    n = int(positions[-1]) + 1
    return attend(q.unsqueeze(0), kc[:, :n].unsqueeze(0), vc[:, :n].unsqueeze(0), causal_mask(positions, n), scale,
                  impl="eager")[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("t,start,groups,d", [(1, 0, 2, 16), (1, 70, 4, 32), (5, 40, 2, 16), (16, 90, 4, 32)])
def test_attention_writes_cache_and_attends_causally(dtype, norm, t, start, groups, d):
    """Also split over the slots: by default (one split at these lengths), in one program, in up to 7 of one
    block each (the last case's block straddles a split boundary, so a split holds no visible slot for its first
    rows) and in up to 3 of at least 2 blocks; and reading 128 slots at a time."""
    n_kv, cap = 2, 160
    n_q = n_kv * groups
    qkv = rnd(t, (n_q + 2 * n_kv) * d, dtype=dtype, seed=1)
    qn, kn = (rnd(d, dtype=dtype, seed=2), rnd(d, dtype=dtype, seed=3)) if norm else (None, None)
    ang = (torch.arange(start, start + t).float()[:, None] * 0.3 ** torch.arange(d // 2).float()).repeat(1, 2)
    cos, sin = ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)
    positions = torch.arange(start, start + t, device=DEV)
    kc = rnd(n_kv, cap, d, dtype=dtype, seed=4)
    vc = rnd(n_kv, cap, d, dtype=dtype, seed=5)
    kc[:, start + t:] = float("nan")  # stale slots past the block are never read
    vc[:, start + t:] = float("nan")
    kr, vr = kc.clone(), vc.clone()
    ref = torch_attention(qkv, qn, kn, 1e-6, cos, sin, positions, kr, vr, n_q, d ** -0.5)
    counters = torch.zeros(n_kv, dtype=torch.int32, device=DEV)
    for splits, least, block in ((None, 4, 64), (1, 4, 64), (7, 1, 64), (3, 2, 64), (None, 1, 128), (2, 1, 128)):
        # block: slots read at a time (for at most 32 query rows)
        o = kernels.attention(qkv, qn, kn, 1e-6, cos, sin, positions, kc, vc, n_q, d ** -0.5, counters=counters,
                              splits=splits, min_blocks=least, block=block)
        torch.testing.assert_close(o, ref, **tol(dtype))
        torch.testing.assert_close(kc, kr, equal_nan=True, **tol(dtype))  # same slots written, nothing else
        torch.testing.assert_close(vc, vr, equal_nan=True, atol=0, rtol=0)
        assert not counters.any()  # the merging split put every head's count back at 0
    with pytest.raises(ValueError, match="counters"):
        kernels.attention(qkv, qn, kn, 1e-6, cos, sin, positions, kc, vc, n_q, d ** -0.5, splits=2)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("splits,inv", [(None, False), (3, False), (None, True)])
def test_attention_over_rows_of_several_requests_is_each_request_alone(causal, splits, inv):
    """Rows of R = 3 requests in one launch (positions [R, T], a batched cache [R, n_kv, capacity, d]): each
    request's output and cache writes are bitwise those of a launch of its own T rows over its own cache row, at
    its own KV length (74, 105 and 7 slots, read 32 at a time: two requests merge several active splits, the
    shortest has one), causal and not (the drafter's block), on the default kernel and on the batch-invariant
    one (inv). Other requests' slots are never read (NaN there would show), and each request counts arrivals on
    its own counters (two more, preset, stay as they were). Power: a launch that reads the first request's
    positions for all, or that shares one request's counters and partial results among all, fails."""
    r, t, n_kv, groups, d, cap = 3, 4, 2, 2, 16, 160
    n_q = n_kv * groups
    launch = kernels.Launch(batch_invariant=inv)
    starts = [70, 101, 3]
    qkv = rnd(r * t, (n_q + 2 * n_kv) * d, seed=11)
    qn, kn = rnd(d, seed=12), rnd(d, seed=13)
    pos = torch.stack([torch.arange(a, a + t) for a in starts]).to(DEV)
    ang = (pos.flatten().float().cpu()[:, None] * 0.3 ** torch.arange(d // 2).float()).repeat(1, 2)
    cos, sin = ang.cos().to(DEV), ang.sin().to(DEV)
    kc, vc = rnd(r, n_kv, cap, d, seed=14), rnd(r, n_kv, cap, d, seed=15)
    for i, a in enumerate(starts):
        kc[i, :, a + t:] = float("nan")
        vc[i, :, a + t:] = float("nan")
    k1, v1 = kc.clone(), vc.clone()

    def active(kv_len):  # the splits with slots to read (attention.py's and invariant.py's arithmetic, 32-slot blocks)
        if inv:
            return -(-kv_len // 64)  # one split per max(min_blocks * 64, block) slots
        n = splits or min(kernels.MAX_SPLITS, -(-cap // 32))
        per = max(-(-(-(-kv_len // n)) // 32), 1) * 32
        return -(-kv_len // per)
    assert active(starts[0] + t) > 1 and active(starts[1] + t) > 1 and active(starts[2] + t) == 1
    kw = dict(causal=causal, splits=splits, min_blocks=1, block=32, launch=launch)
    own = []
    for i in range(r):
        rows = slice(i * t, (i + 1) * t)
        cnt = torch.zeros(n_kv, dtype=torch.int32, device=DEV)
        own.append(kernels.attention(qkv[rows], qn, kn, 1e-6, cos[rows], sin[rows], pos[i], k1[i], v1[i], n_q,
                                     d ** -0.5, counters=cnt, **kw))
    counters = torch.zeros(r * n_kv + 2, dtype=torch.int32, device=DEV)
    counters[r * n_kv:] = 100
    o = kernels.attention(qkv, qn, kn, 1e-6, cos, sin, pos, kc, vc, n_q, d ** -0.5, counters=counters, **kw)
    assert o.shape == (r * t, n_q * d)
    assert torch.equal(o, torch.cat(own))
    assert torch.equal(kc.nan_to_num(7.0), k1.nan_to_num(7.0)) and torch.equal(vc.nan_to_num(7.0), v1.nan_to_num(7.0))
    assert not counters[:r * n_kv].any() and (counters[r * n_kv:] == 100).all()
    with pytest.raises(ValueError, match="counters"):
        kernels.attention(qkv, qn, kn, 1e-6, cos, sin, pos, kc, vc, n_q, d ** -0.5, counters=counters[:n_kv],
                          **{**kw, "splits": None if inv else 2})
    with pytest.raises(ValueError, match="3 requests of 4 rows"):
        kernels.attention(qkv[:t], qn, kn, 1e-6, cos, sin, pos, kc, vc, n_q, d ** -0.5, counters=counters,
                          launch=launch)


def test_launch_settings_are_checked_and_pdl_needs_a_hopper_gpu():
    with pytest.raises(ValueError, match="attention_splits"):
        kernels.Launch(attention_splits=kernels.MAX_SPLITS + 1)
    with pytest.raises(ValueError, match="attention_splits"):
        kernels.Launch(attention_splits=0)
    assert not kernels.pdl_supported(torch.device("cpu"))
    assert launch_opts(kernels.Launch(pdl=None), torch.device("cpu"), 16) == {"PDL": False}
    assert kernels.Launch(pdl=None).resolve(torch.device("cpu")) == kernels.Launch(pdl=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        kernels.Launch().pdl = True  # one object, passed in: nobody changes it under a captured graph


@pytest.mark.skipif(_numpy_breaks_interpreter(), reason="runs Triton's CPU interpreter, which needs numpy < 2.4")
def test_a_triton_without_grid_dependency_control_keeps_the_kernels_and_drops_pdl(tmp_path):
    """Older Triton releases lack triton.language.extra.cuda's gdc functions: the kernels must stay available
    (only PDL off), and one still runs."""
    import subprocess
    import sys
    code = (
        "import sys, types, torch\n"
        "import triton.language.extra.cuda as c\n"
        "stub = types.ModuleType(c.__name__)\n"
        "stub.__dict__.update({k: v for k, v in vars(c).items() if not k.startswith('gdc')})\n"
        "sys.modules[c.__name__] = stub\n"
        "from core import kernels\n"
        "assert kernels.available() and not kernels.HAS_GDC\n"
        "w, x = torch.randn(40, 32), torch.randn(2, 32)\n"
        "torch.testing.assert_close(kernels.linear(x, w), x @ w.t(), atol=1e-4, rtol=1e-4)\n"
        "print('ok')\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


