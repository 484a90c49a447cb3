"""The batched step (harness.decode.batch_step.RowsStep, run by harness.decode.batch_loop: every row of a greedy
batch in one fixed-shape function, finished rows masked) and the plan that captures it as CUDA graphs before a
batch's clock starts.

CPU, fp32: each request's tokens, accepted counts, tau entries and stop reason equal its own B=1 decode, for AR,
drafter-only, xPress (batched and per row) and Markov over a DFlashGroup and over a scripted group (whose drafts
are often accepted), with scripted acceptance, and at the context limit. The capture plan runs against a stand-in
for StepGraphs that warms a step up twice (restoring what the plan says it restores, as StepGraphs does) and
refuses to replay a key it was not given before the clock: so every step's KV bucket was captured ahead, the
warmups leave no trace in any request's output, and a second batch of the same size captures nothing. The real
graphs on CUDA: test_batch_graphs_gpu.py."""
import dataclasses
import gc
import weakref

import pytest
import torch

from core.ops.torch_impl import TorchOps
from drafters.dflash import DFlashDrafter
from drafters.dflash_batch import DFlashGroup
from harness.decode import batch_loop
from harness.decode.batch_loop import generate_batch
from harness.decode.graphs import StepGraphs
from harness.decode.loop import DecodeSettings, generate
from harness.decode.state import DecodeState
from refiners.batch import batch_refiner
from refiners.markov import MarkovRefiner, random_markov_head
from refiners.xpress import XPressRefiner, random_xpress_head
from test_batch_refine import ScriptedGroup, SoftScripted
from tiny import CPU32, VOCAB, tiny_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK, HIDDEN = 4, 64
LENGTHS = (5, 23, 1, 37, 12)  # neighbours differ in length
BUDGETS = (14, 9, 17, 12, 6)  # and in output limit


class OtherOps(TorchOps):
    """Not TorchOps itself: batch_refiner refuses it, so the batched step refines row by row."""


def _refiners():
    head = random_xpress_head(VOCAB, HIDDEN, 16, BLOCK, seed=7, std=0.15)
    return {"drafter-only": None, "xpress1": XPressRefiner(head, 1),
            "xpress2-per-row": XPressRefiner(head, 2, ops=OtherOps()),
            "markov": MarkovRefiner(random_markov_head("gated", VOCAB, HIDDEN, 8, seed=3, std=0.3))}


REFINERS = _refiners()
# each refiner's BatchRefiner, made once (a step graph is keyed by the objects it runs, as the sweep pools them)
BATCHED = {k: None if r is None else batch_refiner(r) for k, r in REFINERS.items()}


@pytest.fixture(scope="module")
def case():
    t = tiny_target("qwen3", capacity=128)
    base = tiny_drafter(t, block=BLOCK)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(8, 104, (n,), generator=g).tolist() for n in LENGTHS]
    refs = [generate(t, p, DecodeSettings(40, 512, ()), CPU32).tokens for p in prompts]
    return t, base, prompts, refs, (3, refs[1][5])  # an EOS planted in request 1's continuation


def settings(case, m=max(BUDGETS), **kw):
    return DecodeSettings(max_new_tokens=m, max_model_len=512, stop_ids=case[4], **kw)


def scripted(case, i):
    _, _, prompts, refs, _ = case
    wrong = [None if (c + i) % 3 == 0 else (c * 5 + i) % (BLOCK - 1) for c in range(60)]
    return SoftScripted(prompts[i] + refs[i], BLOCK, VOCAB, wrong_at=wrong, hidden=HIDDEN)


def alone(case, kind, i):
    t, base, _, _, _ = case
    return DFlashDrafter(base.model, t.embed, t.lm_head, CPU32) if kind == "dflash" else scripted(case, i)


def group(case, kind, idx):
    t, base, _, _, _ = case
    if kind == "dflash":
        return DFlashGroup(DFlashDrafter(base.model, t.embed, t.lm_head, CPU32), len(idx))
    return ScriptedGroup([scripted(case, i) for i in idx])


def no_per_request_step(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a greedy group batch took the per-request step")
    monkeypatch.setattr(batch_loop._Batch, "step", refuse)


# each request's own B=1 decode, made once per (target, drafter kind, arm, request, settings) in a process (this
# module's and test_batch_refill's, which imports assert_b1): the single-request loop is deterministic here (CPU
# fp32, greedy), so a request in several batches (B = 1, 3, 5, and the capture test's) is compared with one
# reference. The key holds the target itself, so a freed target's id is never taken for another's
B1 = {}


def b1(case, kind, arm, i, s):
    t, _, prompts, _, _ = case
    s = dataclasses.replace(s, max_new_tokens=BUDGETS[i])
    key = (t, kind, arm, i, repr(s))
    if key not in B1:
        B1[key] = generate(t, prompts[i], s, CPU32, drafter=None if arm == "ar" else alone(case, kind, i),
                           refiner=REFINERS.get(arm))
    return B1[key]


def assert_b1(case, kind, arm, idx, gens, s, what):
    for i, g in zip(idx, gens):
        one = b1(case, kind, arm, i, s)
        assert g.tokens == one.tokens, (what, i)
        assert (g.accepted, g.accept_lengths, g.stop_reason, g.spec_steps, g.tail_steps) == \
            (one.accepted, one.accept_lengths, one.stop_reason, one.spec_steps, one.tail_steps), (what, i)


def decode(case, kind, arm, idx, s, grp=None):
    t, _, prompts, _, _ = case
    r = REFINERS.get(arm)
    members = None if arm == "ar" else (grp or group(case, kind, idx)).members
    return generate_batch(t, [prompts[i] for i in idx], s, CPU32, drafters=members, refiner=r,
                          max_new_tokens=[BUDGETS[i] for i in idx],
                          refine_batch=BATCHED.get(arm))


@pytest.mark.parametrize("kind,arm", [("dflash", "ar")] + [(k, a) for k in ("dflash", "scripted") for a in REFINERS])
def test_the_batched_step_gives_each_request_its_b1_decode(case, monkeypatch, kind, arm):
    """Guards the batched step's verdict, writes, stops and masked commit against mixing rows or moving a finished
    row: at B in {1, 3, 5} every request is its own B=1 decode."""
    no_per_request_step(monkeypatch)
    accepted, reasons = set(), set()
    for b in (1, 3, 5):
        idx = [(b + j) % len(LENGTHS) for j in range(b)]
        gens = decode(case, kind, arm, idx, settings(case))
        assert_b1(case, kind, arm, idx, gens, settings(case), (kind, arm, b))
        accepted.update(x for g in gens for x in g.accepted)
        reasons.update(g.stop_reason for g in gens)
    assert reasons == {"eos", "max_new_tokens"}, reasons
    if kind == "scripted":
        assert len(accepted) >= 3, accepted  # the verdict has something to get wrong


@pytest.mark.parametrize("arm", ["drafter-only", "xpress1"])
def test_scripted_acceptance_in_the_batched_step(case, monkeypatch, arm):
    """--scripted-accept N: every row accepts min(N, W-1) drafts and takes the target's token after them, as B=1."""
    no_per_request_step(monkeypatch)
    s = settings(case, scripted_accept=2)
    idx = [0, 1, 2, 3]
    gens = decode(case, "dflash", arm, idx, s)
    assert_b1(case, "dflash", arm, idx, gens, s, arm)
    assert {x for g in gens for x in g.accepted} == {2}


@pytest.mark.parametrize("kind", ["dflash", "scripted"])
def test_rows_at_the_context_limit_in_the_batched_step(case, monkeypatch, kind):
    """A row too close to max_model_len for a block takes row 0 of its block only (a plain target step) while its
    neighbours speculate, and finished rows' blocks stay inside the cache (a write past it raises on CPU)."""
    no_per_request_step(monkeypatch)
    t, base, _, _, _ = case
    limit = 48
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(8, 104, (n,), generator=g).tolist() for n in (limit - BLOCK - 2, 3, limit - 2, 40)]
    refs = [generate(t, p, DecodeSettings(60, limit, ()), CPU32).tokens for p in prompts]
    s = DecodeSettings(60, limit, ())

    def one(i):
        return (DFlashDrafter(base.model, t.embed, t.lm_head, CPU32) if kind == "dflash" else
                SoftScripted(prompts[i] + refs[i], BLOCK, VOCAB, hidden=HIDDEN))
    grp = (DFlashGroup(one(0), 4) if kind == "dflash" else ScriptedGroup([one(i) for i in range(4)]))
    gens = generate_batch(t, prompts, s, CPU32, drafters=grp.members, refiner=REFINERS["xpress1"],
                          refine_batch=batch_refiner(REFINERS["xpress1"]))
    for i, gb in enumerate(gens):
        single = generate(t, prompts[i], s, CPU32, drafter=one(i), refiner=REFINERS["xpress1"])
        assert gb.tokens == refs[i] == single.tokens and gb.stop_reason == "max_model_len"
        assert (gb.accepted, gb.tail_steps, gb.spec_steps) == (single.accepted, single.tail_steps, single.spec_steps)
    assert any(x.tail_steps for x in gens) and any(x.spec_steps for x in gens)


class CaptureAhead:
    """StepGraphs' capture plan without CUDA: `ensure` warms the step up twice and restores what the batch says a
    step changes (as StepGraphs._capture does), then keeps the step it captured and the entry's refs; `replay`
    refuses a key not ensured with this layout and runs the step CAPTURED, not the one it is handed (a graph
    replays what it recorded: a later batch of the same size replays the first batch's step)."""
    length = staticmethod(StepGraphs.length)
    capacity_for = staticmethod(StepGraphs.capacity_for)

    def __init__(self):
        self.held, self.steps, self.captures, self.capture_s, self.replayed = {}, {}, 0, 0.0, []

    def ensure(self, key, layout, step, live, uses_rng=False, refs=()):
        if self.held.get(key) == layout:
            return None, False
        saved = [x.clone() for x in live]
        for _ in range(2):
            step()
            for x, y in zip(live, saved):
                x.copy_(y)
        self.held[key], self.steps[key] = layout, (step, refs)
        self.captures += 1
        return None, True

    def replay(self, key, layout, step, live, uses_rng=False, refs=()):
        assert self.held.get(key) == layout, f"step graph {key} was not captured before the clock"
        self.replayed.append(key[-1])
        return self.steps[key][0]()


@pytest.mark.parametrize("arm", ["ar", "drafter-only", "xpress1", "markov"])
def test_every_bucket_is_captured_before_the_clock_and_once_per_batch_size(case, monkeypatch, arm):
    """Guards the capture plan: with 8-slot KV buckets a batch crosses several; every bucket a step uses was
    captured before the batch's clock (setup_captures, none inside: graph_captures 0), the warmups change no
    request's output, and a second batch of the same size (the same state, buffers and arm) captures nothing."""
    no_per_request_step(monkeypatch)
    graphs, made, init = {}, [], batch_loop._Batch.__init__
    monkeypatch.setattr(batch_loop._Batch, "__init__", lambda self, *a, **k: (made.append(weakref.ref(self)),
                                                                               init(self, *a, **k))[1])
    monkeypatch.setattr(batch_loop, "_check", lambda s, b: None)  # use_graph on the CPU: the stand-in captures
    monkeypatch.setattr(DecodeState, "step_graphs", lambda self: graphs.setdefault(id(self), CaptureAhead()))
    s = settings(case, use_graph=True, graph_bucket=8)
    idx = [1, 3, 0]
    t = case[0]
    grp = group(case, "dflash", idx)
    first = decode(case, "dflash", arm, idx, s, grp)
    assert_b1(case, "dflash", arm, idx, first, settings(case), arm)
    g = graphs[id(DecodeState.batched(t, 3))]
    assert len(set(g.replayed)) >= 2  # the batch crossed buckets
    assert all(x.setup_captures == g.captures == len(g.held) for x in first)
    assert all(x.graph_captures == 0 and x.graph_steps > 0 and not x.graph_note for x in first)
    again = decode(case, "dflash", arm, idx, s, grp)
    assert [x.tokens for x in again] == [x.tokens for x in first]
    assert all(x.setup_captures == 0 for x in again)
    # what a captured step reads outlives the batch that captured it: a real graph keeps nothing of that batch,
    # whose own tensors are freed with it (on the H200 a freed block-offset tensor became an out-of-range scatter
    # index), so the step a graph records may hold no _Batch
    gc.collect()
    assert not [b for b in made if b() is not None], "a captured step holds the batch that captured it"


def test_a_sampled_batch_under_use_graph_runs_eagerly_and_says_so(case, monkeypatch):
    graphs = {}
    monkeypatch.setattr(batch_loop, "_check", lambda s, b: None)
    monkeypatch.setattr(DecodeState, "step_graphs", lambda self: graphs.setdefault(id(self), CaptureAhead()))
    t, _, prompts, _, _ = case
    s = settings(case, m=4, use_graph=True, temperature=1.0)
    gens = generate_batch(t, prompts[:2], s, CPU32, drafters=group(case, "dflash", [0, 1]).members,
                          generators=[torch.Generator().manual_seed(k) for k in (1, 2)])
    assert not graphs and all("ran eagerly" in g.graph_note and "sampled" in g.graph_note for g in gens)
    assert all(g.graph_steps == 0 for g in gens)


def test_one_request_runs_on_the_single_request_kernels(case, monkeypatch):
    """At B = 1 the batched loop's verify is the target's own single-request forward (its ops, whose fused attention
    the Triton path has) over the batch's cache row, and the drafter group's block is the base drafter's own, so
    B = 1 costs what the single-request loop costs (the H200 sweeps measured the rows' ops at B = 1 at about twice
    the single-request step); from B = 2 the rows' ops (core.ops.batch.BatchOps). AR and drafter-only."""
    from core.ops.batch import BatchOps
    no_per_request_step(monkeypatch)
    calls = []
    attention, write_kv = BatchOps.attention, BatchOps.write_kv
    monkeypatch.setattr(BatchOps, "attention", lambda self, *a, **k: (calls.append(1), attention(self, *a, **k))[1])
    monkeypatch.setattr(BatchOps, "write_kv", lambda self, *a, **k: (calls.append(1), write_kv(self, *a, **k))[1])
    t, _, prompts, refs, _ = case
    for arm in ("ar", "drafter-only"):
        for b in (1, 2):
            calls.clear()
            members = None if arm == "ar" else group(case, "dflash", list(range(b))).members
            gens = generate_batch(t, prompts[:b], DecodeSettings(8, 512, ()), CPU32, drafters=members)
            assert [g.tokens for g in gens] == [r[:8] for r in refs[:b]]
            assert (len(calls) > 0) == (b > 1), (arm, b, len(calls))
