"""Whole-step CUDA graphs of the batched loop (harness.decode.batch_loop, use_graph) on a real GPU, fp32, a tiny
model: each request's output equals the eager batch's and its own B=1 decode, for AR, drafter-only over a
DFlashGroup, xPress (batched refinement) and Markov, at B in {1, 3, 8}; every step is a replay, the graphs are
captured before the clock (none inside), and a second batch of the same size captures none. The CPU side (the
batched step and the capture plan against a stand-in) is tests/test_batch_graphs.py."""
import pytest
import torch

from core.devices import Backend
from drafters.dflash import DFlashDrafter
from drafters.dflash_batch import DFlashGroup
from harness.decode.batch_loop import generate_batch
from harness.decode.loop import DecodeSettings, generate
from refiners.batch import batch_refiner
from refiners.markov import MarkovRefiner, random_markov_head
from refiners.xpress import XPressRefiner, random_xpress_head
from tiny import VOCAB, tiny_drafter, tiny_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
GPU32 = Backend(torch.device("cuda"), torch.float32) if torch.cuda.is_available() else None
BLOCK, LENGTHS, BUDGETS = 4, (5, 23, 1, 37, 12, 2, 30, 8), (14, 9, 17, 12, 6, 15, 11, 13)


@pytest.fixture(scope="module")
def case():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t = tiny_target("qwen3", capacity=128, backend=GPU32)
    base = tiny_drafter(t, block=BLOCK, backend=GPU32)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(8, 104, (n,), generator=g).tolist() for n in LENGTHS]
    hidden = t.hidden_size
    refiners = {"ar": None, "drafter-only": None,
                "xpress": XPressRefiner(random_xpress_head(VOCAB, hidden, 16, BLOCK, seed=7, std=0.15).cuda(), 2),
                "markov": MarkovRefiner(random_markov_head("gated", VOCAB, hidden, 8, seed=3, std=0.3).cuda())}
    return t, base, prompts, refiners


@pytest.mark.parametrize("arm", ["ar", "drafter-only", "xpress", "markov"])
def test_graphed_batches_equal_eager_and_b1_and_capture_before_the_clock(case, arm):
    t, base, prompts, refiners = case
    r = refiners[arm]
    rb = None if r is None else batch_refiner(r)
    fresh = lambda: DFlashDrafter(base.model, t.embed, t.lm_head, GPU32)
    for b in (1, 3, 8):
        idx = [(b + j) % len(prompts) for j in range(b)]
        group = None if arm == "ar" else DFlashGroup(fresh(), b)

        def run(use_graph):
            return generate_batch(t, [prompts[i] for i in idx], DecodeSettings(
                max(BUDGETS), 512, (3,), use_graph=use_graph, graph_bucket=16), GPU32,
                drafters=None if group is None else group.members, refiner=r, refine_batch=rb,
                max_new_tokens=[BUDGETS[i] for i in idx])
        eager, graphed, again = run(False), run(True), run(True)
        for i, e, g, a in zip(idx, eager, graphed, again):
            one = generate(t, prompts[i], DecodeSettings(BUDGETS[i], 512, (3,)), GPU32,
                           drafter=None if arm == "ar" else fresh(), refiner=r)
            assert g.tokens == e.tokens == a.tokens == one.tokens, (arm, b, i)
            assert g.accepted == e.accepted == one.accepted, (arm, b, i)
            assert g.graph_steps == g.host_syncs > 0 and g.graph_captures == 0 and not g.graph_note
        assert graphed[0].setup_captures >= 2 and again[0].setup_captures == 0, (arm, b)


@pytest.mark.parametrize("arm", ["ar", "drafter-only", "xpress"])
def test_refilled_graphed_batches_equal_b1_and_capture_before_the_clock(case, arm):
    """Continuous batching under the graphs (rows=3 over the 8 prompts): each refill's prefill lands in a row the
    captured step reads by address; every request equals its B=1 decode and no graph is captured inside a clock."""
    t, base, prompts, refiners = case
    r = refiners[arm]
    fresh = lambda: DFlashDrafter(base.model, t.embed, t.lm_head, GPU32)
    group = None if arm == "ar" else DFlashGroup(fresh(), 3)
    gens = generate_batch(t, prompts, DecodeSettings(max(BUDGETS), 512, (3,), use_graph=True, graph_bucket=16), GPU32,
                          drafters=None if group is None else group.members, refiner=r,
                          refine_batch=None if r is None else batch_refiner(r), max_new_tokens=list(BUDGETS), rows=3)
    for i, g in enumerate(gens):
        one = generate(t, prompts[i], DecodeSettings(BUDGETS[i], 512, (3,)), GPU32,
                       drafter=None if arm == "ar" else fresh(), refiner=r)
        assert (g.tokens, g.accepted) == (one.tokens, one.accepted), (arm, i)
        assert g.graph_steps > 0 and g.graph_captures == 0 and not g.graph_note, (arm, i)
