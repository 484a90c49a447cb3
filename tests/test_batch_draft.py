"""drafters.dflash_batch.DFlashGroup: B requests' dFlash drafts in one forward over a batched context cache. In
fp32 each request proposes what its own drafter proposes alone, so its tokens are its B=1 AR tokens and its accepted
counts its B=1 ones, with and without a refiner, at B in {1, 2, 3, 5}; and what the group refuses."""
import dataclasses

import pytest
import torch

from core.errors import UsageError
from drafters.dflash import DFlashDrafter
from drafters.dflash_batch import DFlashGroup
from harness.decode.batch_loop import generate_batch
from core.protocols import Proposal
from harness.decode.loop import DecodeSettings, generate
from harness.decode.state import DecodeState
from refiners.xpress import XPressRefiner, random_xpress_head
from tiny import CPU32, VOCAB, tiny_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4
LENGTHS = (7, 19, 2, 30, 11)
BUDGETS = (13, 8, 16, 10, 12)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def case(request):
    t = tiny_target(request.param, capacity=128)
    base = tiny_drafter(t, block=BLOCK)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(8, 104, (n,), generator=g).tolist() for n in LENGTHS]
    xpress = XPressRefiner(random_xpress_head(VOCAB, 64, 16, BLOCK, seed=7, std=0.15), 2)
    return t, base, prompts, xpress


def fresh(t, base):
    return DFlashDrafter(base.model, t.embed, t.lm_head, CPU32)


def settings(**kw):
    return DecodeSettings(**{"max_new_tokens": max(BUDGETS), "max_model_len": 512, "stop_ids": (3,), **kw})


@pytest.mark.parametrize("refined", [False, True])
def test_each_request_drafts_in_the_group_what_it_drafts_alone(case, refined):
    """Guards the batched draft against mixing requests (a neighbour's context, position or anchor): every request's
    proposals (logits, at fp32 rounding) are its B=1 drafter's, so its tokens, accepted counts and steps are too."""
    t, base, prompts, xpress = case
    refiner = xpress if refined else None
    alone = {}
    for i, p in enumerate(prompts):
        d, log = fresh(t, base), []
        real = d.propose
        d.propose = lambda *a, real=real, log=log: log.append(real(*a)) or log[-1]
        alone[i] = generate(t, p, settings(max_new_tokens=BUDGETS[i]), CPU32, drafter=d, refiner=refiner), log
    for b in (1, 2, 3, 5):
        idx = [(b + j) % len(prompts) for j in range(b)]
        group = DFlashGroup(fresh(t, base), b)
        logs = {j: [] for j in range(b)}
        real = group.proposals

        def proposals(real=real, b=b):  # the batched step reads every row; log those of the requests drafting
            got = real()
            bt = DecodeState.batched(t, b).rows_target  # generate_batch's default state
            for j, on in enumerate((bt.live & bt.spec).tolist()):
                if on:
                    logs[j].append(Proposal(got[0][j].clone(), got[1][j].clone(), got[2][j].clone()))
            return got
        group.proposals = proposals
        gens = generate_batch(t, [prompts[i] for i in idx], settings(), CPU32, drafters=group.members,
                              refiner=refiner, max_new_tokens=[BUDGETS[i] for i in idx])
        for j, (i, g) in enumerate(zip(idx, gens)):
            single, log = alone[i]
            assert g.tokens == single.tokens, (b, i)
            assert (g.accepted, g.accept_lengths, g.spec_steps) == \
                (single.accepted, single.accept_lengths, single.spec_steps), (b, i)
            assert len(logs[j]) == len(log)
            for x, y in zip(logs[j], log):
                assert torch.equal(x.tokens, y.tokens)
                torch.testing.assert_close(x.logits, y.logits, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(x.hidden, y.hidden, atol=1e-5, rtol=1e-5)



def test_observed_blocks_advance_each_row_by_its_own_count(case):
    """A random drafter accepts nothing above (every count 1), so the counts are checked here: two rows begun with
    prompts of different lengths observe a block each with counts 1 and 3; each row's context then holds what its
    own drafter holds after the same begin and observe, and its next proposal is that drafter's."""
    t, base, _, _ = case
    f = base.model.fc.in_features
    g = torch.Generator().manual_seed(4)
    prompt_feats = [torch.randn(n, f, generator=g) for n in (5, 9)]
    block_feats = torch.randn(2, BLOCK, f, generator=g)
    counts = torch.tensor([1, 3])
    group, alone = DFlashGroup(fresh(t, base), 2), [fresh(t, base), fresh(t, base)]
    group.ensure_capacity(64)
    for b, d in enumerate(alone):
        d.ensure_capacity(64)
        group.members[b].begin(prompt_feats[b])
        d.begin(prompt_feats[b])
        d.observe(block_feats[b], counts[b])
    group.observe(block_feats, counts)
    assert group.ctx.tolist() == [d.ctx.item() for d in alone] == [6, 12]
    anchors = torch.tensor([17, 40])
    group.prefetch(anchors, group.ctx.clone(), 32)
    for b, d in enumerate(alone):
        n = d.ctx.item()
        torch.testing.assert_close(group.kv.k[:, b, :, :n], d.kv.k[:, 0, :, :n], atol=1e-6, rtol=1e-6)
        mine, theirs = group.proposal(b), d.propose(anchors[b], d.ctx.clone(), 32)
        torch.testing.assert_close(mine.logits, theirs.logits, atol=1e-5, rtol=1e-5)


def test_a_group_is_passed_whole_and_in_order(case):
    t, base, prompts, _ = case
    group = DFlashGroup(fresh(t, base), 3)
    for members in (group.members[::-1], group.members[:2] + [fresh(t, base)]):
        with pytest.raises(UsageError, match="members in order"):
            generate_batch(t, prompts[:3], settings(), CPU32, drafters=members)
    with pytest.raises(RuntimeError, match="observed together"):
        group.members[0].observe(torch.zeros(BLOCK, 8), torch.tensor(1))


def test_sliding_window_drafters_are_refused():
    t = tiny_target("qwen3", capacity=64)
    d = tiny_drafter(t, block=BLOCK)
    c = d.model.config
    d.model.config = dataclasses.replace(c, layer_types=("sliding_attention",) + tuple(c.layer_types[1:]),
                                         sliding_window=8)
    with pytest.raises(UsageError, match="sliding-window"):
        DFlashGroup(d, 2)
