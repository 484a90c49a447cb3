"""Batch invariance (issue 28) on CUDA at the real shapes (SmolLM2-135M, Qwen3-8B): the compiled kernels with
kernels.Launch(batch_invariant=True) give a row the same bits at 1..64 rows, and AR's bits in a verify block;
the CPU versions (Triton's interpreter, smaller sizes) are tests/test_batch_invariant.py."""
import pytest
import torch

from test_batch_invariant import INV, bits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEV = torch.device("cuda")
ROWS = (1, 2, 3, 8, 16, 17, 33, 64)
# (hidden, intermediate, vocab, query heads, K/V heads, head_dim, per-head q/k norms)
MODELS = {"SmolLM2-135M": (576, 1536, 49152, 9, 3, 64, False), "Qwen3-8B": (4096, 12288, 151936, 32, 8, 128, True)}


def rnd(*shape, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model", list(MODELS))
def test_every_linear_of_the_target_gives_a_row_the_same_bits_at_any_row_count(model, dtype):
    """q/k/v and gate/up (the norm before), o_proj (the residual), down_proj (gated, the residual) and the lm_head
    (the final norm, the argmax): the first and the last row of 1..64 rows are bitwise those rows computed alone."""
    from core import kernels
    hid, inter, vocab, n_q, n_kv, d, _ = MODELS[model]
    g, x = rnd(hid, dtype=dtype, seed=3), rnd(64, 2 * inter, dtype=dtype, seed=2)
    calls = {"qkv": (((n_q + 2 * n_kv) * d, hid), dict(norm=g, eps=1e-6)), "o": ((hid, n_q * d), "res"),
             "gate_up": ((2 * inter, hid), dict(norm=g, eps=1e-6)), "down": ((hid, inter), "gated"),
             "lm_head": ((vocab, hid), dict(norm=g, eps=1e-6, argmax=True))}
    for name, ((n, k), kw) in calls.items():
        w = rnd(n, k, dtype=dtype, scale=0.02, seed=1)
        r = rnd(64, n, dtype=dtype, seed=4)
        xs = x[:, :2 * k] if kw == "gated" else x[:, :k]

        def one(lo, hi):
            extra = kw if isinstance(kw, dict) else {"res": dict(residual=r[lo:hi]),
                                                     "gated": dict(gated=True, residual=r[lo:hi])}[kw]
            out = kernels.linear(xs[lo:hi], w, launch=INV, **extra)
            return (bits(out[0]), out[1]) if isinstance(out, tuple) else (bits(out), None)
        alone = {i: one(i, i + 1) for i in (0, 63)}
        for m in ROWS:
            y, ids = one(0, m)
            for i in {0, m - 1}:
                want = alone.get(i) or one(i, i + 1)
                assert torch.equal(y[i], want[0][0]), (name, m, i)
                assert ids is None or ids[i] == want[1][0], (name, m, i)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model", list(MODELS))
def test_attention_gives_a_verify_row_ar_bits_at_the_real_heads(model, dtype):
    """A block of 2, 16 or 64 tokens at slot 1000 of a 4608-slot cache (one split per 256 slots; 1024 starts one):
    each of its first 32 rows and its K/V writes are bitwise AR's, one token at a time."""
    from core import kernels
    _, _, _, n_q, n_kv, d, norm = MODELS[model]
    start, cap = 1000, 4608
    qkv = rnd(64, (n_q + 2 * n_kv) * d, dtype=dtype, seed=1)
    qn, kn = (rnd(d, dtype=dtype, seed=2), rnd(d, dtype=dtype, seed=3)) if norm else (None, None)
    pos = torch.arange(start, start + 64, device=DEV)
    ang = (pos.float()[:, None] * 0.9 ** torch.arange(d // 2, device=DEV).float()).repeat(1, 2)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    caches = [rnd(n_kv, cap, d, dtype=dtype, seed=s) for s in (4, 5)]
    counters = torch.zeros(n_kv, dtype=torch.int32, device=DEV)

    def run(lo, hi, kc, vc):
        return kernels.attention(qkv[lo:hi], qn, kn, 1e-6, cos[lo:hi], sin[lo:hi], pos[lo:hi], kc, vc, n_q,
                                 d ** -0.5, counters=counters, launch=INV)
    ar_k, ar_v = (c.clone() for c in caches)
    ar = torch.cat([run(i, i + 1, ar_k, ar_v) for i in range(32)])
    for w in (2, 16, 64):
        kc, vc = (c.clone() for c in caches)
        o = run(0, w, kc, vc)
        n = min(w, 32)
        assert torch.equal(bits(o[:n]), bits(ar[:n])), w
        assert torch.equal(bits(kc[:, :start + n]), bits(ar_k[:, :start + n])), w
        assert torch.equal(bits(vc[:, :start + n]), bits(ar_v[:, :start + n])), w
    assert not counters.any()


@pytest.mark.parametrize("graph", [False, True])
def test_greedy_bf16_speculative_decoding_emits_ar_tokens_on_cuda(graph):
    """The tiny model of the CPU test, compiled, eagerly and inside whole-step graphs: every arm emits AR's tokens."""
    from doubles import ScriptedDrafter
    from core.devices import Backend
    from core.ops import triton_ops
    from harness.decode.loop import DecodeSettings, generate
    from refiners.xpress import XPressRefiner, random_xpress_head
    from tiny import VOCAB, tiny_drafter, tiny_target
    b = Backend(DEV, torch.bfloat16)
    t = tiny_target("qwen3", backend=b, capacity=160)
    t.fuse_projections()
    t.use_ops(triton_ops(DEV, INV))
    with torch.no_grad():
        w = t.lm_head.weight
        w[VOCAB // 2:] = w[:VOCAB // 2] * (1 + 2 ** -8)
    d = tiny_drafter(t, block=8, backend=b)
    s, prompt = DecodeSettings(64, 512, (), use_graph=graph, graph_bucket=32), list(range(10, 30))
    ar = generate(t, prompt, s, b).tokens
    for drafter, refiner in ((ScriptedDrafter(prompt + ar, 8, VOCAB, wrong_at=[3, None, 1, 5, 0, 6]), None),
                             (d, None), (d, XPressRefiner(random_xpress_head(VOCAB, 64, 16, 8, seed=7, std=0.3)
                                                          .to(DEV, b.dtype), 2))):
        assert generate(t, prompt, s, b, drafter=drafter, refiner=refiner).tokens == ar
