"""refiners.batch (issue 29, batched refiners): the B drafting requests' refinements of one step in one call.
Per row, the batched refine gives what the refiner's own refine() gives that request alone (tokens exactly, q to
fp32 rounding: see refiners.batch); in generate_batch over a drafter group, at T=0 in fp32 with B in {2, 3} and
prompts of different lengths, each request's tokens, accepted counts and tau entries equal its B=1 decode's, and
each step's refined proposal is the one its B=1 refine made. Every check compares rows that differ from each
other, so a batched path that handed a request another row's result fails it."""
import pytest
import torch

from core.errors import UsageError
from core.protocols import Proposal, RefineContext
from doubles import ScriptedDrafter
from drafters.dflash import DFlashDrafter
from drafters.dflash_batch import DFlashGroup
from harness.decode import batch_loop
from harness.decode.batch_loop import generate_batch
from harness.decode.loop import DecodeSettings, generate
from harness.decode.state import DecodeState
from refiners.batch import BatchRefiner, batch_refiner
from refiners.markov import MarkovRefiner, random_markov_head
from refiners.xpress import XPressRefiner, random_xpress_head
from tiny import CPU32, VOCAB, tiny_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK, HIDDEN = 4, 64
LENGTHS = (5, 23, 1)   # neighbours differ in length
BUDGETS = (12, 8, 14)  # and in output limit
STOPS = (3,)
ARMS = ("xpress1", "xpress3", "markov", "markov-gated")


def make_refiners():
    return {"xpress1": XPressRefiner(random_xpress_head(VOCAB, HIDDEN, 16, BLOCK, seed=7, std=0.15), 1),
            "xpress3": XPressRefiner(random_xpress_head(VOCAB, HIDDEN, 16, BLOCK, seed=7, std=0.15), 3),
            "markov": MarkovRefiner(random_markov_head("vanilla", VOCAB, HIDDEN, 8, seed=3, std=0.3)),
            "markov-gated": MarkovRefiner(random_markov_head("gated", VOCAB, HIDDEN, 8, seed=3, std=0.3)),
            "xpress2-top8": XPressRefiner(random_xpress_head(VOCAB, HIDDEN, 16, BLOCK, seed=7, std=0.15), 2, topc=8)}


REFINERS = make_refiners()


def assert_same_proposal(got: Proposal, want: Proposal, what):
    assert torch.equal(got.tokens, want.tokens), what
    assert got.drafted is not None and torch.equal(got.drafted, want.drafted), what
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")


def distinct_rows(rows: list[Proposal]) -> bool:
    """Every row's q differs from every other row's beyond the tolerance: a row swap cannot pass the checks."""
    return all(not torch.allclose(a.logits, b.logits, atol=1e-4) for i, a in enumerate(rows) for b in rows[i + 1:])


# --- the batched refine, one step ------------------------------------------------------------------------------

@pytest.mark.parametrize("arm", ARMS + ("xpress2-top8",))
@pytest.mark.parametrize("n", [2, 3])
def test_each_row_is_what_its_own_refine_returns(arm, n):
    """Row b of one batched call is refiner.refine(proposal b, its anchor and previous token): the same tokens,
    drafted and q; checked on rows that all differ, and a cyclic permutation of the rows is caught. One call per
    pass: the head's latent runs once per pass (xPress) or per slot (Markov) for all rows."""
    refiner = REFINERS[arm]
    g = torch.Generator().manual_seed(11 + n)
    logits = torch.randn(n, BLOCK - 1, VOCAB, generator=g)
    hidden = torch.randn(n, BLOCK, HIDDEN, generator=g)
    props = [Proposal(logits[b].argmax(-1), logits[b], hidden[b]) for b in range(n)]
    anchors = torch.randint(8, VOCAB - 1, (n,), generator=g)
    prev = torch.randint(8, VOCAB - 1, (n,), generator=g)
    want = [refiner.refine(p, RefineContext(anchor=anchors[b], prev_token=prev[b])) for b, p in enumerate(props)]
    batched = batch_refiner(refiner)
    assert isinstance(batched, BatchRefiner)
    head, calls = refiner.head, []
    real = head.latent
    head.latent = lambda *a: calls.append(1) or real(*a)
    try:
        got = batched.refine(props, anchors, prev)
    finally:
        del head.latent
    assert len(calls) == (refiner.passes if arm.startswith("xpress") else BLOCK - 1)
    assert len(got) == n and distinct_rows(want)
    assert any(not torch.equal(w.tokens, w.drafted) for w in want)  # the refiner changes drafts here
    for b in range(n):
        assert_same_proposal(got[b], want[b], (arm, b))
    rolled = got[1:] + got[:1]
    with pytest.raises(AssertionError):
        for b in range(n):
            assert_same_proposal(rolled[b], want[b], (arm, b))


def test_what_cannot_batch_is_refined_per_request():
    """batch_refiner is None (generate_batch then keeps each request's own refine) for xPress K = 0, a refiner it
    does not know (a wrapper) and other ops; and a sampled draft never takes the batched path."""
    x = REFINERS["xpress1"]
    assert batch_refiner(XPressRefiner(x.head, 0)) is None

    class Wrapped:
        name, passes = "xpress", 1

        def refine(self, proposal, ctx):
            return x.refine(proposal, ctx)
    assert batch_refiner(Wrapped()) is None

    class OtherOps(type(x.ops)):
        pass
    assert batch_refiner(XPressRefiner(x.head, 1, ops=OtherOps())) is None
    assert batch_refiner(REFINERS["markov"]) is not None


# --- generate_batch over a drafter group -------------------------------------------------------------------------

class SoftScripted(ScriptedDrafter):
    """The target's own continuation with scripted mistakes, soft logits and hidden rows drawn from its position:
    accepted counts vary step to step, and a refiner can change the drafts."""

    def propose(self, anchor, position, length):
        p = super().propose(anchor, position, length)
        hidden = torch.randn(self.block_size, self.hidden, generator=torch.Generator().manual_seed(int(position)))
        return Proposal(p.tokens, p.logits * 0.1, hidden)


class ScriptedGroup:
    """A DrafterGroup of scripted drafters (the batch loop's group path: prefetch, members' proposals, one
    observe), for accepted counts a random dFlash drafter never gives."""

    def __init__(self, drafters):
        self.drafters, self.block_size = drafters, drafters[0].block_size
        self.members = [_Member(self, b) for b in range(len(drafters))]

    def ensure_capacity(self, n):
        pass

    def prefetch(self, anchors, positions, length):
        self.positions = positions.clone()

    def observe(self, features, counts):
        for d, c in zip(self.drafters, counts):
            d.observe(None, c)


class _Member:
    def __init__(self, group, b):
        self.group, self.b, self.block_size = group, b, group.block_size
        self.target_layer_ids = group.drafters[b].target_layer_ids

    def ensure_capacity(self, n):
        pass

    def begin(self, features):
        self.group.drafters[self.b].begin(features)

    def propose(self, anchor, position, length):
        return self.group.drafters[self.b].propose(anchor, self.group.positions[self.b], length)


@pytest.fixture(scope="module")
def case():
    t = tiny_target("qwen3", capacity=128, layers=2)  # 2 layers: each layer is the same code; 6 cost 3x
    base = tiny_drafter(t, block=BLOCK, target_layer_ids=[0, 1])
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(8, 104, (n,), generator=g).tolist() for n in LENGTHS]
    refs = [generate(t, p, DecodeSettings(40, 512, ()), CPU32).tokens for p in prompts]
    return t, base, prompts, refs


def settings(m=max(BUDGETS)):
    return DecodeSettings(max_new_tokens=m, max_model_len=512, stop_ids=STOPS)


def drafters_for(kind, case, idx):
    t, base, prompts, refs = case
    if kind == "dflash":
        return [DFlashDrafter(base.model, t.embed, t.lm_head, CPU32) for _ in idx]
    wrong = [[None if (c + i) % 3 == 0 else (c * 5 + i) % (BLOCK - 1) for c in range(60)] for i in idx]
    return [SoftScripted(prompts[i] + refs[i], BLOCK, VOCAB, wrong_at=w, hidden=HIDDEN) for i, w in zip(idx, wrong)]


def group_of(kind, drafters):
    return DFlashGroup(drafters[0], len(drafters)) if kind == "dflash" else ScriptedGroup(drafters)


class Logged:
    """The refiner at B=1, its outputs recorded (generate() refines through it; it never batches)."""

    def __init__(self, inner):
        self.inner, self.name, self.passes, self.log = inner, inner.name, inner.passes, []

    def refine(self, proposal, ctx):
        self.log.append(self.inner.refine(proposal, ctx))
        return self.log[-1]


@pytest.fixture(scope="module")
def singles(case):
    t, _, prompts, _ = case
    out = {}
    for kind in ("dflash", "scripted"):
        for arm in ARMS:
            for i, p in enumerate(prompts):
                logged = Logged(REFINERS[arm])
                d = drafters_for(kind, case, [i])
                g = generate(t, p, settings(BUDGETS[i]), CPU32, drafter=d[0], refiner=logged)
                out[kind, arm, i] = g, logged.log
    return out


@pytest.mark.parametrize("kind", ["dflash", "scripted"])
@pytest.mark.parametrize("arm", ARMS)
def test_each_request_equals_its_own_b1_decode(case, singles, monkeypatch, kind, arm):
    """Guards the batched refinement against mixing requests: with one BatchRefiner call per step, every request's
    tokens, accepted counts, tau entries and stop reason equal its B=1 decode with the per-request refiner, and
    each step's refined proposal (tokens, drafted, q) is the one its own refine() made at B=1."""
    t, _, prompts, _ = case
    steps = []  # per batched step: the refined rows of the requests that drafted, by row
    real = BatchRefiner.refine_stacked

    def refine_stacked(self, tokens, q, hidden, anchors, prev):
        got = real(self, tokens, q, hidden, anchors, prev)
        bt = DecodeState.batched(t, tokens.shape[0]).rows_target  # generate_batch's default state
        drafting = (bt.live & bt.spec).tolist()
        steps.append({j: Proposal(got[0][j], got[1][j], hidden[j], drafted=tokens[j])
                      for j in range(tokens.shape[0]) if drafting[j]})
        return got
    monkeypatch.setattr(BatchRefiner, "refine_stacked", refine_stacked)
    accepted, swaps = set(), 0
    for b in (2, 3):
        idx = [(b + j) % len(prompts) for j in range(b)]
        steps.clear()
        group = group_of(kind, drafters_for(kind, case, idx))
        gens = generate_batch(t, [prompts[i] for i in idx], settings(), CPU32, drafters=group.members,
                              refiner=REFINERS[arm], max_new_tokens=[BUDGETS[i] for i in idx],
                              refine_batch=batch_refiner(REFINERS[arm]))
        # one call per step, over every row of the batch (the batched step's fixed shape)
        assert len(steps) == max(g.host_syncs for g in gens) and max(map(len, steps)) == b
        for j, (i, g) in enumerate(zip(idx, gens)):
            single, log = singles[kind, arm, i]
            assert g.tokens == single.tokens, (kind, arm, b, i)
            assert (g.accepted, g.accept_lengths, g.spec_steps, g.stop_reason) == \
                (single.accepted, single.accept_lengths, single.spec_steps, single.stop_reason), (kind, arm, b, i)
            mine = [s[j] for s in steps if j in s]
            assert len(mine) == len(log) == single.spec_steps
            for k, (x, y) in enumerate(zip(mine, log)):
                assert_same_proposal(x, y, (kind, arm, b, i, k))
            accepted.update(g.accepted)
        # the rows of a step differ, so a request handed a neighbour's row would fail the checks above
        swaps += sum(distinct_rows(list(s.values())) for s in steps if len(s) > 1)
    assert swaps > 0
    if kind == "scripted":
        assert len(accepted) >= 2, accepted  # tau varies: it has something to get wrong


def test_a_sampled_draft_refines_per_request(case, monkeypatch):
    """At Td > 0 each request's frozen noise is its own sampler's: the batched refinement is not used."""
    t, _, prompts, _ = case

    def refuse(*a):
        raise AssertionError("a sampled draft took the batched refinement")
    monkeypatch.setattr(BatchRefiner, "refine", refuse)
    monkeypatch.setattr(BatchRefiner, "refine_stacked", refuse)
    group = group_of("scripted", drafters_for("scripted", case, [0, 1]))
    s = DecodeSettings(max_new_tokens=4, max_model_len=512, stop_ids=STOPS, temperature=1.0)
    gens = generate_batch(t, prompts[:2], s, CPU32, drafters=group.members, refiner=REFINERS["xpress1"],
                          generators=[torch.Generator().manual_seed(k) for k in (1, 2)],
                          refine_batch=batch_refiner(REFINERS["xpress1"]))
    assert all(g.spec_steps >= 1 for g in gens)


def test_refine_batch_must_batch_the_run_refiner(case):
    """A BatchRefiner of another refiner than the run's is refused in one line before anything decodes."""
    t, _, prompts, _ = case
    group = group_of("scripted", drafters_for("scripted", case, [0, 1]))
    with pytest.raises(UsageError, match="batches another refiner"):
        generate_batch(t, prompts[:2], settings(), CPU32, drafters=group.members, refiner=REFINERS["xpress1"],
                       refine_batch=batch_refiner(REFINERS["markov"]))
