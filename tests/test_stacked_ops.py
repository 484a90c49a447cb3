"""core.ops.stacked: the refinement kernels over several requests in one launch, and under torch.func.vmap.

* The kernels take a stack: N requests' blocks (xPress) or slots (gated Markov) in one launch of N programs, each
  request's latent bit for bit its one-block launch's (each program runs the one-block program on its own rows).
* StackedTritonOps' ops under vmap launch each kernel once for the stack: an xPress refinement of K passes over N
  requests makes K latent launches and K readout launches, not N x K (the torch twin this replaced made none, a
  per-request loop N x K); the Markov head one of each a slot. Past kernels.MAX_ROWS rows the readout runs on the
  torch ops, as TritonOps routes any call that large, with the same tokens.
Triton's CPU interpreter here (fp32), compiled kernels on a GPU (fp16 there: fp32 xPress latents are refused)."""
import pytest
import torch
from torch.func import vmap

from kernel_env import DEV, pytestmark  # noqa: F401  (sets TRITON_INTERPRET first; skips without Triton)
from core import kernels
from core.ops import triton_ops
from core.ops.stacked import StackedTritonOps
from core.protocols import Proposal, RefineContext
from refiners.batch import BatchRefiner
from refiners.markov import MarkovRefiner, random_markov_head
from refiners.xpress import XPressRefiner, random_xpress_head
from tolerance import assert_close

DT = torch.float32 if DEV.type == "cpu" else torch.float16
VOCAB, HIDDEN = 200, 48


def _xpress(block=16, rank=80, mlp=160, folded=True):
    head = random_xpress_head(VOCAB, HIDDEN, rank, block, seed=0, mlp_hidden=mlp, std=0.2, mix_std=0.3)
    return (head.fold() if folded else head).to(DEV, DT).requires_grad_(False)


def _markov(rank=80):
    return random_markov_head("gated", VOCAB, HIDDEN, rank, seed=3, std=0.3).to(DEV, DT).requires_grad_(False)


def _latent_args(head):
    m, r = head.mlp, head.rank
    return (head.w1.weight, head.in_proj.weight[:, 2 * r:], head.mix.L, m.gate_proj.weight, m.up_proj.weight,
            m.down_proj.weight)


@pytest.mark.parametrize("folded", [True, False])
def test_a_stack_of_blocks_is_each_blocks_own_launch(folded):
    """The serving form (folded mixer) and the shipped heads' raw mixer (their config says `mixer: raw`)."""
    head = _xpress(folded=folded)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 16, HIDDEN, generator=g).to(DEV, DT)
    cache = torch.stack([head.block_cache(h) for h in hidden])
    prev = torch.randint(0, VOCAB, (3, 16), generator=g).to(DEV)
    z = kernels.xpress_latent(cache, prev, *_latent_args(head), folded=folded)
    assert z.shape == (3, 15, 80)
    for i in range(3):
        assert torch.equal(z[i], kernels.xpress_latent(cache[i], prev[i], *_latent_args(head), folded=folded)), i
    assert not torch.equal(z[0], z[1])
    # views with other strides (a wider buffer's columns, every other token of a wider prev) read their own rows
    wide = torch.zeros(3, 16, 90, device=DEV, dtype=DT)
    wide[..., 3:83] = cache
    pwide = torch.zeros(3, 32, dtype=prev.dtype, device=DEV)
    pwide[:, ::2] = prev
    assert torch.equal(kernels.xpress_latent(wide[..., 3:83], pwide[:, ::2], *_latent_args(head), folded=folded), z)


def test_a_stack_of_markov_slots_is_each_slots_own_launch():
    head = _markov()
    g = torch.Generator().manual_seed(2)
    h = torch.randn(4, HIDDEN, generator=g).to(DEV, DT)
    prev = torch.tensor([0, 17, 17, VOCAB - 1], device=DEV)
    w = (head.w1.weight, head.gate.weight, head.gate.bias)
    z = kernels.markov_gated_latent(prev, h, *w)
    assert z.shape == (4, 80)
    for i in range(4):
        assert torch.equal(z[i], kernels.markov_gated_latent(prev[i], h[i], *w)), i
    wide = torch.zeros(4, HIDDEN + 7, device=DEV, dtype=DT)
    wide[:, 5:5 + HIDDEN] = h
    pwide = torch.zeros(8, dtype=prev.dtype, device=DEV)
    pwide[::2] = prev
    assert torch.equal(kernels.markov_gated_latent(pwide[::2], wide[:, 5:5 + HIDDEN], *w), z)
    with pytest.raises(ValueError, match="does not fit"):
        kernels.markov_gated_latent(prev[:3], h, *w)


def _counting(monkeypatch):
    calls = {"linear": 0, "xpress_latent": 0, "markov_gated_latent": 0}
    for name in calls:
        real = getattr(kernels, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(kernels, name, counted)
    return calls


def _stack(n, block, seed=4):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, block - 1, VOCAB, generator=g).to(DEV, DT)
    hidden = torch.randn(n, block, HIDDEN, generator=g).to(DEV, DT)
    anchors = torch.randint(0, VOCAB, (n,), generator=g).to(DEV)
    prev = torch.randint(0, VOCAB, (n,), generator=g).to(DEV)
    return logits.argmax(-1), logits, hidden, anchors, prev


def _own(refiner, drafts, logits, hidden, anchors, prev):
    return [refiner.refine(Proposal(drafts[i], logits[i], hidden[i]),
                           RefineContext(anchor=anchors[i], prev_token=prev[i])) for i in range(len(anchors))]


@pytest.mark.parametrize("n,block", [(2, 16), (5, 16)])
def test_an_xpress_stack_launches_each_kernel_once_a_pass(monkeypatch, n, block):
    """K = 3 passes. n = 5 at block 16: 75 readout rows, past MAX_ROWS, so the readout runs on the torch ops (no
    linear launch) while the latent still launches once a pass; the tokens are each request's own either way. n = 2
    within MAX_ROWS: 3 launches of each kernel, neither once a request (2) nor N x K (6); the per-request references
    launch N x K = 6 times, as n = 3 at 2 passes did (each ~1 s of interpreter launches)."""
    r = XPressRefiner(_xpress(block), 3, ops=triton_ops(DEV))
    b = BatchRefiner(r, ops=StackedTritonOps(r.ops))
    args = _stack(n, block)
    own = _own(r, *args)
    calls = _counting(monkeypatch)
    tokens, q = b.refine_stacked(*args)
    over = n * (block - 1) > kernels.MAX_ROWS
    assert calls == {"linear": 0 if over else 3, "xpress_latent": 3, "markov_gated_latent": 0}, calls
    assert len({tuple(p.tokens.tolist()) for p in own}) == n
    for i, p in enumerate(own):
        assert torch.equal(tokens[i], p.tokens), i
        assert_close(q[i], p.logits, steps=4 if DT == torch.float32 else 2)
    assert not r.ops.fallbacks


def test_a_markov_stack_launches_each_kernel_once_a_slot(monkeypatch):
    r = MarkovRefiner(_markov(), ops=triton_ops(DEV))
    b = BatchRefiner(r, ops=StackedTritonOps(r.ops))
    # 3 slots for 2 requests: once a slot (3) is neither once a request (2) nor N x slots (6); 3 requests of 4 slots
    # cost twice as much in the per-request references
    args = _stack(2, 4, seed=6)
    own = _own(r, *args)
    calls = _counting(monkeypatch)
    tokens, q = b.refine_stacked(*args)
    assert calls == {"linear": 3, "xpress_latent": 0, "markov_gated_latent": 3}, calls
    for i, p in enumerate(own):
        assert torch.equal(tokens[i], p.tokens), i
        assert_close(q[i], p.logits, steps=4 if DT == torch.float32 else 2)


def test_outside_vmap_the_stacked_ops_are_the_triton_ops():
    """One request, no vmap: the custom ops run the same launches as TritonOps (equal outputs), and rms_norm, which
    no refinement calls, runs on the torch ops."""
    ops = triton_ops(DEV)
    st = StackedTritonOps(ops)
    head = _xpress()
    g = torch.Generator().manual_seed(8)
    cache = head.block_cache(torch.randn(16, HIDDEN, generator=g).to(DEV, DT))
    prev = torch.randint(0, VOCAB, (16,), generator=g).to(DEV)
    assert torch.equal(st.xpress_latent(head, cache, prev), ops.xpress_latent(head, cache, prev))
    x = torch.randn(5, 80, generator=g).to(DEV, DT)
    res = torch.randn(5, VOCAB, generator=g).to(DEV, DT)
    y1, i1 = st.linear(x, head.w2.weight, residual=res, argmax=True)
    y2, i2 = ops.linear(x, head.w2.weight, residual=res, argmax=True)
    assert torch.equal(y1, y2) and torch.equal(i1, i2)
    assert torch.equal(st.linear(x, head.w2.weight), ops.linear(x, head.w2.weight))


def test_weights_that_differ_per_request_are_refused():
    head = _xpress()
    g = torch.Generator().manual_seed(9)
    cache = torch.stack([head.block_cache(torch.randn(16, HIDDEN, generator=g).to(DEV, DT)) for _ in range(2)])
    prev = torch.randint(0, VOCAB, (2, 16), generator=g).to(DEV)
    w = _latent_args(head)
    two = torch.stack([w[0], w[0]])
    from core.ops import stacked
    with pytest.raises(NotImplementedError, match="shared by every request"):
        vmap(lambda c, p, w1: stacked.xpress_latent(c, p, w1, *w[1:], True, False))(cache, prev, two)


def test_nested_vmaps_launch_once_for_every_level(monkeypatch):
    """vmap over vmap (a stack of stacks): the latent rules flatten every level into one launch."""
    head, mh = _xpress(), _markov()
    st = StackedTritonOps(triton_ops(DEV))
    g = torch.Generator().manual_seed(10)
    cache = torch.stack([head.block_cache(h) for h in torch.randn(6, 16, HIDDEN, generator=g).to(DEV, DT)])
    prev = torch.randint(0, VOCAB, (6, 16), generator=g).to(DEV)
    h = torch.randn(6, HIDDEN, generator=g).to(DEV, DT)
    p1 = torch.randint(0, VOCAB, (6,), generator=g).to(DEV)
    calls = _counting(monkeypatch)
    z = vmap(vmap(lambda c, p: st.xpress_latent(head, c, p)))(cache.view(2, 3, 16, 80), prev.view(2, 3, 16))
    m = vmap(vmap(lambda p, x: st.markov_latent(mh, p, x, None)[0]))(p1.view(2, 3), h.view(2, 3, HIDDEN))
    assert calls["xpress_latent"] == 1 and calls["markov_gated_latent"] == 1, calls
    assert torch.equal(z.view(6, 15, 80), kernels.xpress_latent(cache, prev, *_latent_args(head)))
    assert torch.equal(m.view(6, 80), kernels.markov_gated_latent(p1, h, mh.w1.weight, mh.gate.weight, mh.gate.bias))
