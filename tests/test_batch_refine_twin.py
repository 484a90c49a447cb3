"""Batched refinement on the Triton kernels (harness.protocol.algorithms.batch_refiner over refiners.batch): a refiner
whose ops are TritonOps is batched through its twin on core.ops.stacked's StackedTritonOps over the same head and
kernels (Triton's CPU interpreter here, CUDA where there is one), whose kernels vmap batches: each kernel launches
once a pass (xPress) or a slot (Markov) for the whole stack. Each row of one batched call gives the tokens the
refiner's own Triton refine() gives that request alone (its q to fp32 rounding), and in generate_batch the twin
runs from B = 2 only: at B = 1 the refiner's own kernels refine, as in a single-request decode. Rows differ from
each other, so a twin that handed a request another row's result fails."""
import pytest
import torch

from core.ops import triton_ops
from core.ops.stacked import StackedTritonOps
from core.protocols import Proposal, RefineContext
from kernel_env import DEV, pytestmark  # noqa: F401  (sets TRITON_INTERPRET first; skips without Triton)
from harness.protocol.algorithms import batch_refiner
from refiners import batch as own_ops
from refiners.batch import BatchRefiner
from refiners.markov import MarkovRefiner, random_markov_head
from refiners.xpress import XPressRefiner, random_xpress_head

VOCAB, HIDDEN, BLOCK = 128, 32, 4
# The decode tests' target: 2 layers (every layer runs the same ops), hidden 32 with 2 query heads and 1 K/V head
# of 16 (the tiny default's 64, 4 and 2 made twice the interpreter's programs a launch); HIDDEN is its hidden size
SMALL = dict(layers=2, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_attention_heads=2,
             num_key_value_heads=1)


def _refiners():
    ops = triton_ops(DEV)
    return {"xpress2": XPressRefiner(random_xpress_head(VOCAB, HIDDEN, 16, BLOCK, seed=7, std=0.15).to(DEV), 2,
                                     ops=ops),
            "markov-gated": MarkovRefiner(random_markov_head("gated", VOCAB, HIDDEN, 8, seed=3, std=0.3).to(DEV),
                                          ops=ops)}


@pytest.mark.parametrize("arm", ["xpress2", "markov-gated"])
def test_a_triton_refiner_batches_through_its_stacked_twin_row_for_row(arm):
    r = _refiners()[arm]
    assert own_ops.batch_refiner(r) is None  # vmap cannot batch the Triton kernels themselves
    b = batch_refiner(r)
    assert isinstance(b, BatchRefiner) and b.twin and b.refiner is r
    assert type(b.inner.ops) is StackedTritonOps and b.inner.head is r.head and r.ops.name == "triton"
    assert b.inner.ops.fallbacks is r.ops.fallbacks and b.inner.ops.launch == r.ops.launch
    g = torch.Generator().manual_seed(1)
    n = 3
    logits = torch.randn(n, BLOCK - 1, VOCAB, generator=g).to(DEV)
    hidden = torch.randn(n, BLOCK, HIDDEN, generator=g).to(DEV)
    drafts, anchors = logits.argmax(-1), torch.tensor([5, 17, 40], device=DEV)
    prev = torch.tensor([9, 3, 77], device=DEV)
    tokens, q = b.refine_stacked(drafts, logits, hidden, anchors, prev)
    own = [r.refine(Proposal(drafts[i], logits[i], hidden[i]), RefineContext(anchor=anchors[i], prev_token=prev[i]))
           for i in range(n)]
    assert len({tuple(p.tokens.tolist()) for p in own}) > 1 or arm == "markov-gated"
    for i, p in enumerate(own):
        assert torch.equal(tokens[i], p.tokens), (arm, i)
        torch.testing.assert_close(q[i], p.logits, atol=1e-4, rtol=1e-4)
    if DEV.type == "cpu":  # the kernels ran (on a GPU the fp32 xPress latent is refused: kernels.xpress.refused)
        assert not r.ops.fallbacks


def test_generate_batch_keeps_the_refiners_own_kernels_at_b1_and_the_twin_from_b2(monkeypatch):
    """Counts the twin's calls: none at B = 1 (the refiner's own Triton refine), every step's at B = 3; the
    tokens equal each request's single-request decode with the Triton refiner either way."""
    from drafters.dflash import DFlashDrafter
    from drafters.dflash_batch import DFlashGroup
    from harness.decode.batch_loop import generate_batch
    from harness.decode.loop import DecodeSettings, generate
    from tiny import CPU32, tiny_drafter, tiny_target
    if DEV.type != "cpu":
        pytest.skip("the decode half runs on the CPU's fp32 target; the GPU's is tests/test_batch_graphs_gpu.py")
    t = tiny_target("qwen3", capacity=128, **SMALL)
    base = tiny_drafter(t, block=BLOCK, target_layer_ids=[0, 1])
    r = _refiners()["xpress2"]
    b = batch_refiner(r)
    calls = []
    stacked = b.refine_stacked
    monkeypatch.setattr(b, "refine_stacked", lambda *a: (calls.append(1), stacked(*a))[1])
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(8, 104, (n,), generator=g).tolist() for n in (5, 23, 1)]
    s = DecodeSettings(6, 512, (3,))  # 6 tokens: several steps (the interpreter pays per launch)
    fresh = lambda: DFlashDrafter(base.model, t.embed, t.lm_head, CPU32)
    singles = [generate(t, p, s, CPU32, drafter=fresh(), refiner=r).tokens for p in prompts]
    for n in (1, 3):
        calls.clear()
        gens = generate_batch(t, prompts[:n], s, CPU32, drafters=DFlashGroup(fresh(), n).members, refiner=r,
                              refine_batch=b)
        assert [x.tokens for x in gens] == singles[:n], n
        assert (len(calls) > 0) == (n > 1), (n, len(calls))


def test_one_request_on_triton_kernels_decodes_what_the_single_request_loop_does():
    """A target on the Triton kernels (the interpreter here): at B = 1 the batched loop's verify runs the target's
    own single-request ops, split attention and its counters included, over the batch's one cache row; its tokens
    and accepted counts equal the single-request loop's with the same drafter and refiner. At B = 2 the rows' ops
    run and each request still decodes its B = 1 tokens (fp32)."""
    from drafters.dflash import DFlashDrafter
    from drafters.dflash_batch import DFlashGroup
    from harness.decode.batch_loop import generate_batch
    from harness.decode.loop import DecodeSettings, generate
    from tiny import CPU32, tiny_drafter, tiny_target
    if DEV.type != "cpu":
        pytest.skip("the CPU interpreter's check; the GPU's is tests/test_batch_graphs_gpu.py")
    # 2 target layers: every layer runs the same kernels, each a few seconds in the interpreter (6 took ~100 s)
    t = tiny_target("qwen3", capacity=128, **SMALL)
    base = tiny_drafter(t, block=BLOCK, target_layer_ids=[0, 1])
    t.use_ops(triton_ops(DEV))
    r = _refiners()["xpress2"]
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(8, 104, (n,), generator=g).tolist() for n in (7, 19)]
    s = DecodeSettings(6, 512, (3,))  # 6 tokens: several steps (the interpreter pays per launch)
    fresh = lambda: DFlashDrafter(base.model, t.embed, t.lm_head, CPU32)
    singles = [generate(t, p, s, CPU32, drafter=fresh(), refiner=r) for p in prompts]
    for n in (1, 2):
        gens = generate_batch(t, prompts[:n], s, CPU32, drafters=DFlashGroup(fresh(), n).members, refiner=r,
                              refine_batch=batch_refiner(r))
        assert [x.tokens for x in gens] == [x.tokens for x in singles[:n]], n
        assert [x.accepted for x in gens] == [x.accepted for x in singles[:n]], n
