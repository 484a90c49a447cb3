"""harness.decode.kernels against the torch path: on CUDA compiled, on CPU through Triton's interpreter (skipped where
Triton is not installed; CI does not install it, the GPU run covers these)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before harness.decode.kernels is imported

from harness.decode import kernels  # noqa: E402
from harness.decode.cache import StaticKV, attend, causal_mask, rotate  # noqa: E402
from harness.decode.devices import Backend  # noqa: E402
from harness.errors import UsageError  # noqa: E402
from harness.decode.loop import DecodeSettings, generate  # noqa: E402
from drafters.base import Proposal  # noqa: E402
from refiners.base import RefineContext  # noqa: E402
from refiners.markov import MarkovRefiner, random_markov_head  # noqa: E402
from refiners.xpress import XPressRefiner, random_xpress_head  # noqa: E402
from tiny import tiny_drafter, tiny_target  # noqa: E402

def _numpy_breaks_interpreter() -> bool:
    """Triton 3.6's CPU interpreter turns size-1 arrays into scalars, which numpy >= 2.4 refuses."""
    import numpy
    return tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4)


def _interpreter_broken() -> bool:
    return kernels.interpreted() and _numpy_breaks_interpreter()


pytestmark = [pytest.mark.skipif(not kernels.available(), reason="triton is not installed"),
              pytest.mark.skipif(kernels.available() and _interpreter_broken(),
                                 reason="Triton's CPU interpreter needs numpy < 2.4")]
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Triton's interpreter runs tensor-core dots in fp32 only; compiled runs check bf16 too
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV.type == "cuda" else [])


def tol(dtype):
    return dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)


def rnd(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,cfg", [(1, 300, None), (15, 300, None), (1, 300, "no-dot"), (4, 1000, "narrow")])
def test_linear_argmax_matches_torch_with_ties(dtype, m, n, cfg):
    """The fused argmax: the lowest column among equal maxima (torch.argmax's rule), across program boundaries, with
    and without the residual (the xPress base logits); a NaN counts as +inf."""
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
    """The torch path's steps (harness.decode.target / harness.decode.cache), on one layer's cache slice."""
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
    for splits, least, block in ((None, 4, 64), (1, 4, 64), (7, 1, 64), (3, 2, 64), (None, 1, 128), (2, 1, 128)):
        kernels.set_launch(attention_block=block)  # slots read at a time (for at most 32 query rows)
        try:
            o = kernels.attention(qkv, qn, kn, 1e-6, cos, sin, positions, kc, vc, n_q, d ** -0.5, splits=splits,
                                  min_blocks=least)
        finally:
            kernels.set_launch()
        torch.testing.assert_close(o, ref, **tol(dtype))
        torch.testing.assert_close(kc, kr, equal_nan=True, **tol(dtype))  # same slots written, nothing else
        torch.testing.assert_close(vc, vr, equal_nan=True, atol=0, rtol=0)
        assert not kernels._counter(DEV).any()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_target_kernels_match_torch_forward(family):
    b = Backend(DEV, torch.float32)
    ref, fast = (tiny_target(family, backend=b, taps=(1, 5), capacity=48) for _ in range(2))
    assert fast.use_kernels() and fast.kernels == "triton" and ref.kernels == "torch"
    prompt = torch.randint(8, 100, (9,), generator=torch.Generator().manual_seed(0)).to(DEV)
    for m in (ref, fast):
        m.prefill(prompt, want_features=True)
    block = torch.randint(8, 100, (4,), generator=torch.Generator().manual_seed(1)).to(DEV)
    (la, fa), (lb, fb) = (m.verify(block, 16, want_features=True) for m in (ref, fast))
    loose = dict(atol=2e-4, rtol=2e-4)  # six layers of fp32 summation-order differences
    torch.testing.assert_close(lb, la, **loose)
    torch.testing.assert_close(fb, fa, **loose)  # taps, the last one after the final norm
    torch.testing.assert_close(fast.kv.k[:, :, :, :13], ref.kv.k[:, :, :, :13], **loose)


def test_norms_fold_into_the_one_row_matmuls_after_them(monkeypatch):
    """An AR step of the tiny model (every one-row matmul without tensor cores) runs no RMSNorm launch of its
    own: each is folded into the matmul after it (q/k/v, gate/up, lm_head). With fold_norms=False, and for a
    block of rows (tensor-core loops), it runs one per norm; the logits agree within summation order."""
    b = Backend(DEV, torch.float32)
    t = tiny_target("qwen3", backend=b, capacity=32)
    assert t.use_kernels()
    prompt = torch.randint(8, 100, (5,), generator=torch.Generator().manual_seed(0)).to(DEV)
    calls = []
    real = kernels.rms_norm
    monkeypatch.setattr(kernels, "rms_norm", lambda *a: calls.append(1) or real(*a))
    try:
        for block in ([9], [9, 10, 11]):
            out = []
            for fold in (True, False):
                kernels.set_launch(fold_norms=fold)
                t.reset()
                t.prefill(prompt, want_features=False)
                calls.clear()
                out.append(t.verify(torch.tensor(block, device=DEV), 16, want_features=False)[0])
                assert len(calls) == (0 if fold and len(block) == 1 else 2 * t.n_layers + 1)
            torch.testing.assert_close(out[0], out[1], atol=2e-4, rtol=2e-4)
    finally:
        kernels.set_launch()
    d = tiny_drafter(t, block=4, backend=b)
    d.model.use_kernels(kernels)
    calls.clear()
    d.begin(torch.randn(6, len(d.target_layer_ids) * t.config.hidden_size, device=DEV))
    assert len(calls) == 1  # the drafter's context write normalises once, not once per layer


@pytest.mark.parametrize("graph", [False, True] if DEV.type == "cuda" else [False])
@pytest.mark.parametrize("drafter", [False, True])
def test_greedy_tokens_same_with_kernels(drafter, graph):
    """fp32 greedy: the torch path and the kernels (eagerly, and inside whole-step graphs on CUDA) agree."""
    b = Backend(DEV, torch.float32)
    n = 24 if DEV.type == "cuda" else 12  # the CPU interpreter is slow
    outs = []
    for on in (False, True):
        t = tiny_target("qwen3", backend=b, capacity=64)
        d = tiny_drafter(t, block=4, backend=b) if drafter else None
        t.use_kernels(on)
        if on and d is not None:
            d.model.use_kernels(kernels)
        s = DecodeSettings(n, 512, (), use_graph=graph and on, graph_bucket=16)
        outs.append(generate(t, list(range(10, 30)), s, b, drafter=d).tokens)
    assert outs[0] == outs[1] and len(outs[0]) == n


@pytest.mark.skipif(not kernels.pdl_supported(DEV), reason="programmatic dependent launch needs a Hopper GPU")
def test_programmatic_dependent_launch_changes_no_bit():
    """PDL only lets a launch start early and wait on the device: bf16 verify logits, drafter proposals and the
    greedy tokens of whole-step graphs with the xPress and Markov refiners are bit-identical with it off and on."""
    from tiny import VOCAB
    b = Backend(DEV, torch.bfloat16)
    runs = []
    try:
        for pdl in (False, None):
            kernels.set_launch(pdl=pdl, prefetch_tiles=1)
            t = tiny_target("qwen3", backend=b, capacity=96)
            d = tiny_drafter(t, block=8, backend=b)
            t.use_kernels()
            d.model.use_kernels(kernels)
            logits, feats = t.verify(torch.arange(8, 24, device=DEV), 16, want_features=False)
            refs = [XPressRefiner(random_xpress_head(VOCAB, 64, 16, 8, seed=7, std=0.3).to(DEV, b.dtype), 4),
                    MarkovRefiner(random_markov_head("vanilla", VOCAB, 64, 16, seed=2, std=0.3).to(DEV, b.dtype))]
            for r in refs:
                r.use_kernels(kernels)
            s = DecodeSettings(40, 512, (), use_graph=True, graph_bucket=32)
            toks = [generate(t, list(range(10, 30)), s, b, drafter=d, refiner=r).tokens for r in refs]
            runs.append((logits, toks))
    finally:
        kernels.set_launch()
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]


def test_launch_settings_are_checked_and_pdl_needs_a_hopper_gpu():
    with pytest.raises(ValueError, match="prefetch_tiles"):
        kernels.set_launch(prefetch_tiles=-1)
    with pytest.raises(ValueError, match="attention_splits"):
        kernels.set_launch(attention_splits=kernels.MAX_SPLITS + 1)
    with pytest.raises(ValueError, match="attention_min_blocks"):
        kernels.set_launch(attention_min_blocks=0)
    assert not kernels.pdl_supported(torch.device("cpu"))
    assert kernels._launch_opts(torch.device("cpu"), 16) == {"PDL": False}


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
        "from harness.decode import kernels\n"
        "assert kernels.available() and not kernels._HAS_GDC\n"
        "w, x = torch.randn(40, 32), torch.randn(2, 32)\n"
        "torch.testing.assert_close(kernels.linear(x, w), x @ w.t(), atol=1e-4, rtol=1e-4)\n"
        "print('ok')\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_refused_with_biases():
    t = tiny_target("qwen3", backend=Backend(DEV, torch.float32))
    t.layers[0].self_attn.q_proj.bias = torch.nn.Parameter(torch.zeros(t.layers[0].self_attn.q_proj.out_features,
                                                                      device=DEV))
    t._fused = None
    with pytest.raises(UsageError, match="biases"):
        t.use_kernels()


def test_prefill_stays_on_torch_and_kv_shapes_unchanged():
    """Prefill (last_only) takes the torch path even with kernels on; decode writes the same cache layout."""
    t = tiny_target("qwen3", backend=Backend(DEV, torch.float32), capacity=32)
    t.use_kernels()
    assert isinstance(t.kv, StaticKV) and t.kv.k.shape[3] == 32
    called = []
    real = t._forward_kernels
    t._forward_kernels = lambda *a: called.append(1) or real(*a)
    t.prefill(torch.arange(8, 20, device=DEV), want_features=False)
    assert not called
    t.verify(torch.arange(8, 10, device=DEV), 16, want_features=False)
    assert called


def test_drafter_kernels_match_torch():
    """The dFlash block and context writes on the kernels: same proposals and hidden states as torch ops."""
    b = Backend(DEV, torch.float32)
    t = tiny_target("qwen3", backend=b, capacity=48)
    ref, fast = tiny_drafter(t, block=4, backend=b), tiny_drafter(t, block=4, backend=b)
    assert kernels.drafter_fits(fast.model.config)
    fast.model.use_kernels(kernels)
    logits, feats = t.prefill(torch.arange(8, 20, device=DEV), want_features=True)
    for d in (ref, fast):
        d.begin(feats)
        d.observe(feats[:4] * 0.5, torch.tensor(2, device=DEV))  # a context write through the kernels
    pa, pb = (d.propose(torch.tensor(9, device=DEV), torch.tensor(14, device=DEV), 32) for d in (ref, fast))
    loose = dict(atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(fast.kv.k[:, :, :, :18], ref.kv.k[:, :, :, :18], **loose)
    torch.testing.assert_close(fast.kv.v[:, :, :, :18], ref.kv.v[:, :, :, :18], **loose)
    torch.testing.assert_close(pb.hidden, pa.hidden, **loose)
    torch.testing.assert_close(pb.logits, pa.logits, **loose)
    assert torch.equal(pb.tokens, pa.tokens)


def _block_case(seed, n, v, hidden_size):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=g).to(DEV)
    base = (torch.randn(n - 1, v, generator=g) * 0.3).to(DEV)
    anchor, prev = torch.randint(0, v, (2,), generator=g).to(DEV)
    return Proposal(base.argmax(-1), base, hidden), RefineContext(anchor=anchor, prev_token=prev)


def _counting_linear(fn, *args):
    """fn(*args) and the `argmax` flag of every kernels.linear call it made."""
    calls, real = [], kernels.linear
    kernels.linear = lambda *a, **k: calls.append(k.get("argmax")) or real(*a, **k)
    try:
        return fn(*args), calls
    finally:
        kernels.linear = real


def test_xpress_fused_scoring_matches_torch():
    """Greedy xPress passes with w2, the base add and the argmax in one kernels.linear: the same tokens and
    refined logits as the torch passes, with and without a shortlist (which stays on torch ops), and the kernel
    path really taken."""
    v, n = 300, 8
    head = random_xpress_head(v, 24, 16, n, seed=0, std=0.2).to(DEV)
    changed = 0
    for topc in (0, 32):
        ref, fast = XPressRefiner(head, 3, topc=topc), XPressRefiner(head, 3, topc=topc)
        fast.use_kernels(kernels)
        for seed in range(4):
            p, ctx = _block_case(seed, n, v, 24)
            got, calls = _counting_linear(fast.refine, p, ctx)
            want = ref.refine(p, ctx)
            assert calls == ([True] * 3 if topc == 0 else [])
            assert torch.equal(got.tokens, want.tokens), (topc, seed)
            torch.testing.assert_close(got.logits, want.logits, **tol(torch.float32))
            changed += int((want.tokens != p.tokens).sum())
    assert changed, "refinement changed no token: the comparison would prove little"


@pytest.mark.parametrize("variant", ["vanilla", "gated", "rnn"])
def test_markov_fused_scoring_matches_torch(variant):
    v, n = 200, 6
    head = random_markov_head(variant, v, 20, 12, seed=1, std=0.5).to(DEV)
    ref, fast = MarkovRefiner(head), MarkovRefiner(head)
    fast.use_kernels(kernels)
    changed = 0
    for seed in range(3):
        p, ctx = _block_case(seed, n, v, 20)
        (got, calls), want = _counting_linear(fast.refine, p, ctx), ref.refine(p, ctx)
        assert calls == [True] * (n - 1)
        assert torch.equal(got.tokens, want.tokens), seed
        torch.testing.assert_close(got.logits, want.logits, **tol(torch.float32))
        changed += int((want.tokens != p.tokens).sum())
    assert changed


def test_wide_blocks_fall_back_to_torch():
    """Blocks whose query rows would not fit one attention program's registers take the torch path."""
    assert kernels.fits(16, 4) and kernels.fits(64, 2) and not kernels.fits(65, 1) and not kernels.fits(40, 4)
    t = tiny_target("qwen3", backend=Backend(DEV, torch.float32), capacity=160)  # 2 query heads per K/V head
    t.use_kernels()
    called = []
    real = t._forward_kernels
    t._forward_kernels = lambda *a: called.append(1) or real(*a)
    t.prefill(torch.arange(8, 20, device=DEV), want_features=False)
    t.verify(torch.arange(8, 73, device=DEV), 80, want_features=False)  # 65 rows
    assert not called
    t.verify(torch.arange(8, 72, device=DEV), 80, want_features=False)  # 64 rows x 2 = 128
    assert called


def test_unfusing_turns_the_kernels_off():
    t = tiny_target("qwen3", backend=Backend(DEV, torch.float32))
    t.use_kernels()
    t.fuse_projections(False)
    assert t.kernels == "torch"  # the kernels read the fused weights


def test_random_models_switch_target_drafter_and_refiners_together():
    """RandomModels.use_kernels: the target, the drafter and every refiner, made before or after, on the kernels;
    None puts all of them back on torch ops."""
    from harness.protocol.presets import build_random
    m = build_random("tiny", Backend(DEV, torch.float32), block_size=8)
    before = m.refiner("xpress", 2)
    m.use_kernels(kernels)
    after = m.refiner("markov")
    assert m.target.kernels == "triton" and m.drafter.model._kern is kernels
    assert before._kern is kernels and after._kern is kernels
    m.use_kernels(None)
    assert m.target.kernels == "torch" and m.drafter.model._kern is None
    assert before._kern is None and after._kern is None and m.refiner("xpress", 3)._kern is None
