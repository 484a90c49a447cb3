"""core.kernels.xpress_latent: the xPress head's per-pass latent in one launch equals the head's torch modules
(XPressHead.latent) within the dtype's rounding, at the shipped geometry and at odd ones, folded or raw mixer;
TritonOps runs it (one launch a pass) and hands a head too large for one program to the torch modules, counted; the
refiner's greedy drafts on the Triton ops are the torch ops'. Triton's CPU interpreter here (fp32, and fp16, whose
roundings check the kernel's rounding points), compiled kernels on a GPU (bf16 too; fp32 there is refused, as
wrong results were measured: kernels.xpress.refused).

Power: the random heads' parts are of comparable size (std 0.2, mixer 0.3), so dropping the MLP, the mix or the
token half, or silu for relu, moves outputs by far more than the half-precision tolerance (8 ulps of the largest
output, steps=1); at fp16 the kernel's outputs are within 1 ulp of the torch modules' (measured here)."""
import pytest
import torch

from kernel_env import DEV, pytestmark  # noqa: F401  (sets TRITON_INTERPRET first; skips without Triton)
from core import kernels
from core.ops import TorchOps, triton_ops
from core.protocols import Proposal, RefineContext
from refiners.xpress import XPressRefiner, random_xpress_head
from tolerance import assert_close

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV.type == "cuda" else [])
STEPS = 4  # fp32: the sums of the matmuls and the mix, in another order than the torch ops
# the dtype of the tests below that need the kernel: fp32 in the interpreter; on a GPU, where fp32 is refused
# (kernels.xpress.refused), fp16, whose outputs are within 1 ulp of the torch modules'
KDT = torch.float32 if DEV.type == "cpu" else torch.float16


def steps(dtype: torch.dtype) -> int:
    return STEPS if dtype == torch.float32 else 1


def _case(block, rank, mlp, dtype, vocab=300, hidden=48, seed=0, folded=True):
    head = random_xpress_head(vocab, hidden, rank, block, seed=seed, mlp_hidden=mlp, std=0.2, mix_std=0.3)
    head = (head.fold() if folded else head).to(DEV, dtype).requires_grad_(False)
    g = torch.Generator().manual_seed(seed + 1)
    h = torch.randn(block, hidden, generator=g).to(DEV, dtype)
    prev = torch.randint(0, vocab, (block,), generator=g).to(DEV)
    return head, head.block_cache(h), prev


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("folded", [True, False])
@pytest.mark.parametrize("block,rank,mlp", [(16, 80, 160), (8, 16, 32), (5, 24, 40), (32, 256, 512),
                                            (16, 160, 320)])  # rank 160: smollm2-gpu-heads-xpress-r160
@pytest.mark.parametrize("mix_transposed", [False, True])
def test_the_fused_latent_is_the_heads_own(dtype, folded, block, rank, mlp, mix_transposed):
    """The serving form (folded M) and training's (raw L, masked to the lower triangle, x added); the mix as the
    GPU-measured path computes it and transposed (kernels.xpress.latent's mix_transposed, which
    harness/lab/probe_latent_speed.py times against it). Power (transposed): a mask of j < k instead of j <= k, or M[c, j, k]
    for M[c, k, j], moves outputs by far more than the tolerance (the random mixer's entries are 0.3)."""
    head, cache, prev = _case(block, rank, mlp, dtype, folded=folded)
    want = head.latent(cache, prev)
    m = head.mlp
    args = (cache, prev, head.w1.weight, head.in_proj.weight[:, 2 * rank:], head.mix.L, m.gate_proj.weight,
            m.up_proj.weight, m.down_proj.weight)
    if kernels.xpress_refused(dtype, DEV) is not None:  # fp32 on a GPU: refused, never a wrong latent
        with pytest.raises(ValueError, match="fp32 on a GPU is not taken"):
            kernels.xpress_latent(*args, folded=folded, mix_transposed=mix_transposed)
        return
    got = kernels.xpress_latent(*args, folded=folded, mix_transposed=mix_transposed)
    assert got.shape == (block - 1, rank) and got.dtype == dtype
    assert_close(got, want, steps=steps(dtype))


def test_fp32_heads_on_a_gpu_run_on_the_torch_ops(monkeypatch):
    """The compiled kernel gave wrong fp32 latents on an H100 (kernels.xpress.refused): TritonOps hands an fp32
    head on a GPU to the torch modules, counted, and takes it wherever the kernel is trusted (the interpreter
    here; half precision everywhere). Power: without the refusal the GPU case calls the kernel and has no
    fallback; a refusal of every fp32 head fails the CPU case."""
    from core.ops import triton_impl
    assert kernels.xpress_refused(torch.float32, torch.device("cuda")) == "fp32 on a GPU"
    assert kernels.xpress_refused(torch.float32, torch.device("cpu")) is None
    assert kernels.xpress_refused(torch.bfloat16, torch.device("cuda")) is None
    head, cache, prev = _case(16, 80, 160, torch.float32)
    monkeypatch.setattr(triton_impl.kernels, "xpress_refused", lambda dtype, device: "fp32 on a GPU")
    ops = triton_ops(DEV)
    calls = []
    monkeypatch.setattr(kernels, "xpress_latent", lambda *a, **k: calls.append(1))
    assert torch.equal(ops.xpress_latent(head, cache, prev), head.latent(cache, prev))
    assert not calls and dict(ops.fallbacks) == {("xpress latent", "fp32 on a GPU"): 1}


def test_a_slot_reads_only_its_predecessors():
    """Causality survives the fusion: changing slot k's predecessor changes no slot before k."""
    head, cache, prev = _case(16, 80, 160, KDT)
    ops = triton_ops(DEV)
    a = ops.xpress_latent(head, cache, prev)
    prev2 = prev.clone()
    prev2[9] = (prev2[9] + 1) % head.vocab
    b = ops.xpress_latent(head, cache, prev2)
    # z row i is slot i + 1, which reads prev[0..i + 1]: rows before 8 are slots 1..8, untouched by prev[9]
    assert torch.equal(a[:8], b[:8]) and not torch.equal(a[8:], b[8:])


def test_triton_ops_fuse_the_latent_and_hand_a_head_too_large_to_torch(monkeypatch):
    calls = []
    real = kernels.xpress_latent
    monkeypatch.setattr(kernels, "xpress_latent", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    head, cache, prev = _case(16, 80, 160, KDT)
    ops = triton_ops(DEV)
    assert_close(ops.xpress_latent(head, cache, prev), head.latent(cache, prev), steps=steps(KDT))
    assert len(calls) == 1 and not ops.fallbacks
    big, cache, prev = _case(16, 512, 64, KDT)  # rank over one program's registers
    assert_close(ops.xpress_latent(big, cache, prev), big.latent(cache, prev), steps=steps(KDT))
    assert len(calls) == 1 and dict(ops.fallbacks) == {("xpress latent", "block 16, rank 512, MLP hidden 64"): 1}


@pytest.mark.parametrize("passes", [1, 3])
def test_the_refiners_drafts_on_the_triton_ops_are_the_torch_ops(monkeypatch, passes):
    """Greedy K passes: the same tokens, one fused latent launch a pass, refined logits within rounding."""
    calls = []
    real = kernels.xpress_latent
    monkeypatch.setattr(kernels, "xpress_latent", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    head, _, _ = _case(16, 80, 160, KDT)
    g = torch.Generator().manual_seed(5)
    prop = Proposal(tokens=torch.randint(0, head.vocab, (15,), generator=g).to(DEV),
                    logits=torch.randn(15, head.vocab, generator=g).to(DEV, KDT),
                    hidden=torch.randn(16, 48, generator=g).to(DEV, KDT))
    ctx = RefineContext(anchor=torch.tensor(3, device=DEV), prev_token=torch.tensor(7, device=DEV))
    want = XPressRefiner(head, passes, ops=TorchOps()).refine(prop, ctx)
    got = XPressRefiner(head, passes, ops=triton_ops(DEV)).refine(prop, ctx)
    assert torch.equal(got.tokens, want.tokens) and len(calls) == passes
    assert_close(got.logits, want.logits, steps=steps(KDT) + 1)


def test_a_strided_prev_reads_its_own_elements():
    """prev as a view with stride 2 (the kernel read prev[i] at offset i: other tokens, silently)."""
    head, cache, prev = _case(16, 80, 160, KDT)
    m = head.mlp
    args = (head.w1.weight, head.in_proj.weight[:, 2 * 80:], head.mix.L, m.gate_proj.weight, m.up_proj.weight,
            m.down_proj.weight)
    strided = torch.stack((prev, torch.zeros_like(prev)), 1)[:, 0]
    assert strided.stride(0) == 2
    assert torch.equal(kernels.xpress_latent(cache, strided, *args), kernels.xpress_latent(cache, prev, *args))


@pytest.mark.parametrize("folded", [True, False])
def test_the_transposed_mix_keeps_a_requests_latent_its_own(folded):
    """Several requests' blocks in one launch, the mix transposed: each request's latent is bit for bit its
    one-block latent (the batched decode's contract), and within rounding of the other mix path's."""
    head, cache, prev = _case(16, 80, 160, KDT, folded=folded)
    _, cache2, prev2 = _case(16, 80, 160, KDT, seed=3, folded=folded)
    m = head.mlp
    w = (head.w1.weight, head.in_proj.weight[:, 2 * 80:], head.mix.L, m.gate_proj.weight, m.up_proj.weight,
         m.down_proj.weight)
    both = kernels.xpress_latent(torch.stack((cache, cache2)), torch.stack((prev, prev2)), *w, folded=folded,
                                 mix_transposed=True)
    for i, (c, p) in enumerate(((cache, prev), (cache2, prev2))):
        one = kernels.xpress_latent(c, p, *w, folded=folded, mix_transposed=True)
        assert torch.equal(both[i], one)
        assert_close(one, kernels.xpress_latent(c, p, *w, folded=folded), steps=steps(KDT) + 1)


def test_the_speed_probe_launches_every_setting_it_times_correctly():
    """harness.lab.probe_latent_speed calls the kernel directly (past the launcher) for each setting it times: in
    the interpreter, with a null timer, every setting's latent is the launcher's within rounding and none fails to
    launch, so a GPU session spends its time timing, not finding a wrong argument, and each record's launch is the
    setting it is filed under. Power: a swapped argument gives an error or a difference at the outputs' scale; a
    setting not passed on (BK, BH, warps or the mix path fixed) files a launch under the wrong setting."""
    from harness.lab import probe_latent_speed as probe
    dt = KDT
    only = [(mixt, 4, bk, bh) for mixt in (False, True) for bk, bh in ((16, 32), (64, 64))]
    for folded in (False, True):
        rows = probe.probe(16, 80, 160, folded, DEV, dtype=dt, timer=lambda go: 0.0, only=only, vocab=300,
                           hidden=48)
        assert [(r["mix_transposed"], r["BK"], r["BH"]) for r in rows] == [(m, k, h) for m, _, k, h in only]
        for r in rows:
            assert "error" not in r, r
            assert r["launched"] == {"MIXT": r["mix_transposed"], "num_warps": r["num_warps"], "BK": r["BK"],
                                     "BH": r["BH"], "RAW": not folded,
                                     "PDL": kernels.common.pdl_supported(DEV)}  # the decode's launch: on from Hopper
            # STEPS ulps of the largest output: the sums in another order (tile sizes, the mix's reduction)
            assert r["max_diff"] <= 2 * STEPS * torch.finfo(dt).eps * r["scale"], r
    assert len(probe.settings(80)) == 2 * 4 * 3 * 2 and len(probe.settings(160)) == 2 * 4 * 3 * 2


def test_the_launcher_takes_the_transposed_mix_with_8_warps_below_rank_256():
    """The launch default measured faster on an H100 (results/perf/latent_probe_h100/: about 3 us a pass) and run
    under this file compiled there: the transposed mix, 8 warps, at the shipped geometry; rank 256 keeps 8 warps and
    its own tile. Fails if the constants go back to the column mix or 4 warps unmeasured."""
    from core.kernels import xpress
    s = xpress.settings(16, 80, torch.bfloat16, torch.device("cpu"))
    assert (s["MIXT"], s["num_warps"], s["BK"], s["BH"]) == (True, 8, 64, 64)
    assert xpress.settings(16, 256, torch.bfloat16, torch.device("cpu"))["BH"] == 32
