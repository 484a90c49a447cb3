"""core.kernels.markov_gated_latent: the gated Markov head's per-slot latent in one launch equals the head's torch
modules (MarkovHead.latent) within the dtype's rounding, at the shipped geometry (rank 80, hidden 576) and odd ones;
TritonOps runs it for the gated head (one launch a slot), leaves the vanilla head's embedding row as it is and hands
the rnn head to the torch modules, counted; the refiner's greedy drafts on the Triton ops are the torch ops'.
Triton's CPU interpreter here (fp32 and fp16), compiled kernels on a GPU (bf16 too); in half precision the
tolerance is 8 ulps of the largest output (steps=1), far below what a wrong column offset or sigmoid moves."""
import pytest
import torch

from kernel_env import DEV, pytestmark  # noqa: F401  (sets TRITON_INTERPRET first; skips without Triton)
from core import kernels
from core.ops import TorchOps, triton_ops
from core.protocols import Proposal, RefineContext
from refiners.markov import MarkovRefiner, random_markov_head
from tolerance import assert_close

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV.type == "cuda" else [])
STEPS = 4  # roundings in series: the gate's output, the sigmoid, the product (and e itself, exact)


def _head(variant, rank, hidden, dtype, vocab=300, seed=0):
    return random_markov_head(variant, vocab, hidden, rank, seed=seed, std=0.3).to(DEV, dtype).requires_grad_(False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank,hidden", [(80, 576), (8, 16), (7, 33), (100, 48)])
def test_the_fused_gated_latent_is_the_heads_own(dtype, rank, hidden):
    head = _head("gated", rank, hidden, dtype)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(hidden, generator=g).to(DEV, dtype)
    state = head.initial_state(h)
    for prev in (0, 17, head.vocab - 1):
        p = torch.tensor(prev, device=DEV)
        want, _ = head.latent(p, h, state)
        got = kernels.markov_gated_latent(p, h, head.w1.weight, head.gate.weight, head.gate.bias)
        assert got.shape == (rank,) and got.dtype == dtype
        assert_close(got, want, steps=STEPS if dtype == torch.float32 else 1)


def test_triton_ops_fuse_the_gated_head_only(monkeypatch):
    calls = []
    real = kernels.markov_gated_latent
    monkeypatch.setattr(kernels, "markov_gated_latent", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    ops = triton_ops(DEV)
    h, p = torch.randn(48, device=DEV), torch.tensor(5, device=DEV)
    for variant in ("gated", "vanilla", "rnn"):
        head = _head(variant, 16, 48, torch.float32)
        state = head.initial_state(h)
        got, want = ops.markov_latent(head, p, h, state), head.latent(p, h, state)
        assert_close(got[0], want[0], steps=STEPS)
        assert torch.equal(got[1], want[1])  # the state (the rnn variant's; the others pass it through)
    assert len(calls) == 1 and dict(ops.fallbacks) == {("markov latent", "the rnn variant"): 1}


def test_the_refiners_drafts_on_the_triton_ops_are_the_torch_ops(monkeypatch):
    """Greedy, 6 slots (each slot's token feeds the next: the chain, at a third of a 16-block's interpreter
    launches): the same tokens, one fused latent launch a slot, each step's logits within rounding."""
    calls = []
    real = kernels.markov_gated_latent
    monkeypatch.setattr(kernels, "markov_gated_latent", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    head = _head("gated", 16, 48, torch.float32)
    g = torch.Generator().manual_seed(5)
    prop = Proposal(tokens=torch.randint(0, head.vocab, (6,), generator=g).to(DEV),
                    logits=torch.randn(6, head.vocab, generator=g).to(DEV),
                    hidden=torch.randn(7, 48, generator=g).to(DEV))
    ctx = RefineContext(anchor=torch.tensor(3, device=DEV), prev_token=torch.tensor(7, device=DEV))
    want = MarkovRefiner(head, ops=TorchOps()).refine(prop, ctx)
    got = MarkovRefiner(head, ops=triton_ops(DEV)).refine(prop, ctx)
    assert torch.equal(got.tokens, want.tokens) and len(calls) == 6
    assert_close(got.logits, want.logits, steps=STEPS + 1)
