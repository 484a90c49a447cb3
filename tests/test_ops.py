"""The models on the Triton ops against the torch ops (core.ops): target, drafter, refiners, whole
generations, the fallbacks, and the split-attention counters each cache owns. CPU through Triton's interpreter."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernel_env import DEV, pytestmark, tol  # noqa: F401  (sets TRITON_INTERPRET first)
from core.protocols import Proposal, RefineContext
from core import kernels
from core.devices import Backend
from harness.decode.loop import DecodeSettings, generate
from core.ops import TorchOps, make_ops, triton_ops
from core.errors import UsageError
from refiners.markov import MarkovRefiner, random_markov_head
from refiners.xpress import XPressRefiner, random_xpress_head
from tiny import tiny_config, tiny_drafter, tiny_target
from tolerance import assert_close

F32 = Backend(DEV, torch.float32)


def fast_target(family="qwen3", **kw):
    t = tiny_target(family, backend=F32, **kw)
    t.fuse_projections()
    t.use_ops(triton_ops(DEV))
    return t


class Count:
    """Counts the calls of a function reached as `module.name` (the ops look kernels up per call)."""

    def __init__(self, monkeypatch, module, name):
        real, self.calls = getattr(module, name), []
        monkeypatch.setattr(module, name, lambda *a, **k: self.calls.append(k.get("argmax")) or real(*a, **k))

    def __len__(self):
        return len(self.calls)


def rounding_steps(target) -> int:
    """Rounding steps in series through a target's forward: each layer's two sums into the residual stream
    (attention, MLP), then the lm_head (one a layer held at 6 layers, whose residual stream is larger; at 2 the
    llama logits were 14% over it)."""
    return 2 * target.n_layers + 1


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_target_on_triton_ops_matches_torch_ops(family):
    """2 layers (every layer runs the same kernels; 6 cost ~3x on the interpreter), both tapped: the last tap is
    the last layer's, after the final norm, as tap 5 of 6 was."""
    kw = dict(backend=F32, taps=(0, 1), capacity=48, layers=2)
    ref, fast = tiny_target(family, **kw), fast_target(family, **{k: v for k, v in kw.items() if k != "backend"})
    assert fast.kernels == "triton" and ref.kernels == "torch"
    prompt = torch.randint(8, 100, (9,), generator=torch.Generator().manual_seed(0)).to(DEV)
    for m in (ref, fast):
        m.prefill(prompt, want_features=True)
    block = torch.randint(8, 100, (4,), generator=torch.Generator().manual_seed(1)).to(DEV)
    (la, fa), (lb, fb) = (m.verify(block, 16, want_features=True) for m in (ref, fast))
    steps = rounding_steps(ref)
    assert_close(lb, la, steps=steps)
    assert_close(fb, fa, steps=steps)  # taps, the last one after the final norm
    assert_close(fast.kv.k[:, :, :, :13], ref.kv.k[:, :, :, :13], steps=steps)


def test_norms_fold_into_the_one_row_matmuls_after_them(monkeypatch):
    """An AR step of the tiny model (every one-row matmul without tensor cores) runs no RMSNorm launch of its
    own: each is folded into the matmul after it (q/k/v, gate/up, lm_head); a block of rows (tensor-core loops)
    runs one per norm. The drafter's context write normalises once, not once per layer. 2 target layers: the
    count per layer (2 a layer + the final norm) is what is checked; 6 cost ~3x on the interpreter."""
    t = fast_target(capacity=32, layers=2)
    norms = Count(monkeypatch, kernels.matmul, "rms_norm")
    direct = Count(monkeypatch, kernels, "rms_norm")
    t.prefill(torch.randint(8, 100, (5,), generator=torch.Generator().manual_seed(0)).to(DEV), want_features=False)
    for block, want in (([9], 0), ([9, 10, 11], 2 * t.n_layers + 1)):
        norms.calls.clear()
        t.verify(torch.tensor(block, device=DEV), 16, want_features=False)
        assert len(norms) == want and not direct
    d = tiny_drafter(t, block=4, backend=F32, target_layer_ids=[0, 1])
    d.ops = t.ops
    d.begin(torch.randn(6, len(d.target_layer_ids) * t.config.hidden_size, device=DEV))
    assert len(direct) == 1


class LayerWork(TorchDispatchMode):
    """Per decoder layer of a Target: the Triton launches (kernel names) and the ATen ops that would be device
    kernels (not views or allocations; the interpreter's own copies inside a launch left out)."""

    ALLOC = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")

    def __init__(self, monkeypatch, target):
        super().__init__()
        self.layers, self._cur, self._in_launch = [], None, 0
        kind = type(kernels.matmul._linear_kernel)  # InterpretedFunction on the CPU, JITFunction compiled
        real_run, real_layer, work = kind.run, target._layer, self

        def run(fn, *a, **k):
            if work._cur is not None and not work._in_launch and not k.get("warmup"):
                work._cur["triton"].append(fn.fn.__name__)
            work._in_launch += 1
            try:
                return real_run(fn, *a, **k)
            finally:
                work._in_launch -= 1

        def layer(*a, **k):
            work._cur = {"triton": [], "aten": []}
            try:
                return real_layer(*a, **k)
            finally:
                work.layers.append(work._cur)
                work._cur = None
        monkeypatch.setattr(kind, "run", run)
        monkeypatch.setattr(target, "_layer", layer)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._cur is not None and not self._in_launch and not func.is_view and \
                func.overloadpacket.__name__ not in self.ALLOC:
            self._cur["aten"].append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_decoder_layer_launch_budget(monkeypatch, family):
    """A decode step is launch-bound (a ~5 us launch against ~1 us of weights per small matmul), so what one layer
    launches is its cost: at one row five Triton launches (q/k/v with the norm folded, attention, o_proj with the
    residual, gate/up with the norm folded, down_proj with silu*up and the residual), for a block of rows eight
    (the two norms and the activation their own launches), and no torch op in between. An op the Triton ops
    hand to the torch ops (a fallback) shows here: when the activation was passed as a function, transformers'
    SiLUActivation module (HF's act_fn) sent down_proj to torch (silu, mul, mm, add: +0.15 ms per AR step of
    SmolLM2-135M on the H200); the ops now take its name."""
    t = fast_target(family, capacity=32, layers=2)
    t.prefill(torch.randint(8, 100, (5,), generator=torch.Generator().manual_seed(0)).to(DEV), want_features=False)
    lin, attn, norm, act = "_linear_kernel", "_attention_kernel", "_rmsnorm_kernel", "_silu_mul_kernel"
    budget = {1: [lin, attn, lin, lin, lin], 3: [norm, lin, attn, lin, norm, lin, act, lin]}
    work = LayerWork(monkeypatch, t)
    for rows, want in budget.items():
        work.layers.clear()
        with work:
            t.verify(torch.arange(9, 9 + rows, device=DEV), 16, want_features=False)
        assert len(work.layers) == t.n_layers
        for i, got in enumerate(work.layers):
            assert got == {"triton": want, "aten": []}, f"{rows} row(s), layer {i}"


def test_decode_sized_calls_the_kernels_cannot_take_are_counted():
    from core.ops.triton_impl import fallback_note
    ops = triton_ops(DEV)
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(*s, generator=g).to(DEV) for s in ((2, 16), (8, 16)))
    ops.linear(x, w)  # the kernel takes it
    ops.linear(torch.randn(kernels.MAX_ROWS + 1, 16, generator=g).to(DEV), w)  # a prompt's rows: by design
    assert not ops.fallbacks and fallback_note(ops) is None
    ops.linear(x, w, bias=torch.zeros(8, device=DEV))
    ops.linear(x, w, bias=torch.zeros(8, device=DEV))
    ops.linear(torch.randn(2, 32, generator=g).to(DEV), torch.randn(8, 16, generator=g).to(DEV), act="relu")
    assert ops.fallbacks == {("linear", "a bias"): 2, ("linear", "activation 'relu'"): 1}
    assert fallback_note(ops).endswith("linear (a bias) x2, linear (activation 'relu') x1")
    ops.fallbacks.clear()
    assert ops.sized(16, 4) is ops and ops.sized(4096, 4, prefill=True) is ops.torch and not ops.fallbacks
    assert ops.sized(40, 4) is ops.torch  # a block of 40 rows with 4 query heads per K/V head: no one program
    assert ops.sized(kernels.MAX_ROWS + 1, 1) is ops.torch  # wider than any kernel takes: by design, not counted
    assert ops.for_heads(24, 4, 2) is ops.torch  # a head size the kernels do not take: the whole model
    ops.rms_norm(torch.ones(1, 3, 8, device=DEV), torch.ones(8, device=DEV), 1e-6)
    ops.rms_norm(torch.ones(1, kernels.MAX_ROWS + 1, 8, device=DEV), torch.ones(8, device=DEV), 1e-6)  # not counted
    assert ops.fallbacks == {("forward", "40 rows x 4 query heads per K/V head"): 1,
                             ("model", "heads of 24 (4 query, 2 K/V)"): 1, ("rms_norm", "3-d rows"): 1}


def test_a_decode_with_refiners_hands_nothing_to_the_torch_ops():
    """Every decode-sized call of a fused target, the drafter and both refiners reaches a kernel (2 target layers and
    a 1-layer drafter: every layer makes the same calls, and each costs ~0.5 s a step on the interpreter)."""
    from tiny import VOCAB
    t = fast_target(capacity=64, layers=2)
    d = tiny_drafter(t, block=4, layers=1, backend=F32)
    d.ops = t.ops
    for r in (None, XPressRefiner(random_xpress_head(VOCAB, 64, 16, 4, seed=7, std=0.3).to(DEV), 2, ops=t.ops),
              MarkovRefiner(random_markov_head("vanilla", VOCAB, 64, 16, seed=2, std=0.3).to(DEV), ops=t.ops)):
        g = generate(t, list(range(10, 30)), DecodeSettings(3, 512, ()), F32, drafter=d, refiner=r)
        assert len(g.accepted) >= 1  # at least one speculative step: draft, refine, verify
    # fp32 on a GPU: the fused xPress latent is refused by design (core.kernels.xpress); every other call is a kernel's
    refused = kernels.xpress_refused(torch.float32, DEV)
    left = {k: n for k, n in t.ops.fallbacks.items() if refused is None or k != ("xpress latent", refused)}
    assert not left, dict(t.ops.fallbacks)


@pytest.mark.parametrize("graph", [False, True] if DEV.type == "cuda" else [False])
@pytest.mark.parametrize("drafter", [False, True])
def test_greedy_tokens_same_on_both_ops(drafter, graph):
    """fp32 greedy: the torch ops and the Triton ops (eagerly, and inside whole-step graphs on CUDA) agree. On the
    CPU interpreter 2 layers (every layer runs the same kernels; 6 took 25 s) and 8 tokens: two speculative blocks
    and more."""
    n, layers = (24, 6) if DEV.type == "cuda" else (8, 2)
    outs = []
    for fast in (False, True):
        t = fast_target(capacity=64, layers=layers) if fast else tiny_target("qwen3", backend=F32, capacity=64,
                                                                             layers=layers)
        d = tiny_drafter(t, block=4, backend=F32, target_layer_ids=[0, 1] if layers == 2 else None) \
            if drafter else None
        if d is not None:
            d.ops = t.ops
        s = DecodeSettings(n, 512, (), use_graph=graph and fast, graph_bucket=16)
        outs.append(generate(t, list(range(10, 30)), s, F32, drafter=d).tokens)
    assert outs[0] == outs[1] and len(outs[0]) == n


@pytest.mark.skipif(not kernels.pdl_supported(DEV), reason="programmatic dependent launch needs a Hopper GPU")
def test_programmatic_dependent_launch_changes_no_bit():
    """PDL only lets a launch start early and wait on the device: bf16 verify logits and the greedy tokens of
    whole-step graphs with the xPress and Markov refiners, and of AR (one-row launches: Launch.one_row_pdl), are
    bit-identical with it off and on."""
    from tiny import VOCAB
    b = Backend(DEV, torch.bfloat16)
    runs = []
    for pdl in (False, True):
        ops = triton_ops(DEV, kernels.Launch(pdl=pdl, one_row_pdl=pdl))
        t = tiny_target("qwen3", backend=b, capacity=96)
        t.fuse_projections()
        t.use_ops(ops)
        d = tiny_drafter(t, block=8, backend=b)
        d.ops = ops
        logits, _ = t.verify(torch.arange(8, 24, device=DEV), 16, want_features=False)
        refs = [XPressRefiner(random_xpress_head(VOCAB, 64, 16, 8, seed=7, std=0.3).to(DEV, b.dtype), 4, ops=ops),
                MarkovRefiner(random_markov_head("vanilla", VOCAB, 64, 16, seed=2, std=0.3).to(DEV, b.dtype),
                              ops=ops)]
        s = DecodeSettings(40, 512, (), use_graph=True, graph_bucket=32)
        runs.append((logits, [generate(t, list(range(10, 30)), s, b, drafter=d, refiner=r).tokens for r in refs]
                     + [generate(t, list(range(10, 30)), s, b).tokens]))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]


def test_make_ops_refuses_what_the_kernels_cannot_run():
    """Chosen from the config, before any weights: biases, another activation, odd heads, eager attention."""
    cpu = torch.device("cpu")
    assert make_ops("torch", DEV, torch.float32).name == "torch"
    assert make_ops("triton", DEV, torch.float32, tiny_config()).name == "triton"
    for change, why in ((dict(attention_bias=True), "biases"), (dict(hidden_act="gelu"), "activation"),
                        (dict(head_dim=24), "head_dim")):
        cfg = tiny_config()
        for k, v in change.items():
            setattr(cfg, k, v)
        with pytest.raises(UsageError, match=why):
            make_ops("triton", DEV, torch.float32, cfg)
        assert make_ops("auto", DEV, torch.bfloat16, cfg).name == "torch"
    with pytest.raises(UsageError, match="eager"):
        make_ops("triton", DEV, torch.float32, tiny_config(), attn_impl="eager")
    assert make_ops("auto", cpu, torch.float32, tiny_config()).name == "torch"  # auto: CUDA bf16/fp16 only
    with pytest.raises(UsageError, match="--kernels"):
        make_ops("cuda", DEV, torch.float32)


def test_prefill_and_wide_blocks_run_on_the_torch_ops(monkeypatch):
    """A prompt, and blocks whose query rows would not fit one attention program, take the torch ops. 2 layers: a
    launch a layer is the count checked (6 cost ~3x on the interpreter)."""
    assert kernels.fits(16, 4) and kernels.fits(64, 2) and not kernels.fits(65, 1) and not kernels.fits(40, 4)
    t = fast_target(capacity=160, layers=2)  # 2 query heads per K/V head
    attn = Count(monkeypatch, kernels, "attention")
    t.prefill(torch.arange(8, 20, device=DEV), want_features=False)
    t.verify(torch.arange(8, 73, device=DEV), 80, want_features=False)  # 65 rows
    assert not attn
    t.verify(torch.arange(8, 72, device=DEV), 80, want_features=False)  # 64 rows x 2 = 128
    assert len(attn) == t.n_layers


def test_unfused_projections_still_match_on_the_triton_ops():
    """2 layers: every layer runs the same unfused launches (6 cost ~3x on the interpreter)."""
    ref, fast = tiny_target("qwen3", backend=F32, capacity=32, layers=2), fast_target(capacity=32, layers=2)
    fast.fuse_projections(False)
    for m in (ref, fast):
        m.prefill(torch.arange(8, 20, device=DEV), want_features=False)
    a, b = (m.verify(torch.arange(30, 33, device=DEV), 16, want_features=False)[0] for m in (ref, fast))
    assert_close(b, a, steps=rounding_steps(ref))


def test_drafter_on_triton_ops_matches_torch():
    """The dFlash block and context writes: same proposals and hidden states as the torch ops."""
    t = tiny_target("qwen3", backend=F32, capacity=48)
    ref, fast = tiny_drafter(t, block=4, backend=F32), tiny_drafter(t, block=4, backend=F32)
    fast.ops = triton_ops(DEV)
    logits, feats = t.prefill(torch.arange(8, 20, device=DEV), want_features=True)
    for d in (ref, fast):
        d.begin(feats)
        d.observe(feats[:4] * 0.5, torch.tensor(2, device=DEV))  # a context write through the kernels
    pa, pb = (d.propose(torch.tensor(9, device=DEV), torch.tensor(14, device=DEV), 32) for d in (ref, fast))
    for got, want in ((fast.kv.k[:, :, :, :18], ref.kv.k[:, :, :, :18]), (fast.kv.v[:, :, :, :18],
                      ref.kv.v[:, :, :, :18]), (pb.hidden, pa.hidden), (pb.logits, pa.logits)):
        assert_close(got, want, steps=4)
    assert torch.equal(pb.tokens, pa.tokens)


def _block_case(seed, n, v, hidden_size):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=g).to(DEV)
    base = (torch.randn(n - 1, v, generator=g) * 0.3).to(DEV)
    anchor, prev = torch.randint(0, v, (2,), generator=g).to(DEV)
    return Proposal(base.argmax(-1), base, hidden), RefineContext(anchor=anchor, prev_token=prev)


def test_xpress_scoring_on_triton_ops_matches_torch(monkeypatch):
    """Greedy xPress passes with w2, the base add and the argmax in one kernels.linear: the same tokens and
    refined logits as the torch ops, with and without a shortlist (which stays on torch ops), the kernel path
    really taken."""
    v, n = 300, 8
    head = random_xpress_head(v, 24, 16, n, seed=0, std=0.2).to(DEV)
    changed = 0
    for topc in (0, 32):
        ref, fast = XPressRefiner(head, 3, topc=topc), XPressRefiner(head, 3, topc=topc, ops=triton_ops(DEV))
        for seed in range(4):
            p, ctx = _block_case(seed, n, v, 24)
            lin = Count(monkeypatch, kernels, "linear")
            got, want = fast.refine(p, ctx), ref.refine(p, ctx)
            assert lin.calls == ([True] * 3 if topc == 0 else [])
            assert torch.equal(got.tokens, want.tokens), (topc, seed)
            assert_close(got.logits, want.logits, steps=4)
            changed += int((want.tokens != p.tokens).sum())
    assert changed, "refinement changed no token: the comparison would prove little"


@pytest.mark.parametrize("variant", ["vanilla", "gated", "rnn"])
def test_markov_scoring_on_triton_ops_matches_torch(monkeypatch, variant):
    v, n = 200, 6
    head = random_markov_head(variant, v, 20, 12, seed=1, std=0.5).to(DEV)
    ref, fast = MarkovRefiner(head), MarkovRefiner(head, ops=triton_ops(DEV))
    changed = 0
    for seed in range(3):
        p, ctx = _block_case(seed, n, v, 20)
        lin = Count(monkeypatch, kernels, "linear")
        got, want = fast.refine(p, ctx), ref.refine(p, ctx)
        assert lin.calls == [True] * (n - 1)
        assert torch.equal(got.tokens, want.tokens), seed
        assert_close(got.logits, want.logits, steps=4)
        changed += int((want.tokens != p.tokens).sum())
    assert changed


def test_random_models_switch_target_drafter_and_refiners_together():
    """RandomModels.use_ops: the target, the drafter and every refiner, made before or after, on the same ops."""
    from harness.protocol.presets import build_random
    m = build_random("tiny", F32, block_size=8)
    before = m.refiner("xpress", 2)
    fast = triton_ops(DEV)
    m.use_ops(fast)
    after = m.refiner("markov")
    assert m.target.ops is fast and m.drafter.ops is fast and before.ops is fast and after.ops is fast
    m.use_ops(TorchOps())
    assert m.target.kernels == "torch" and m.drafter.ops.name == "torch" and m.refiner("xpress", 3).ops.name == "torch"
