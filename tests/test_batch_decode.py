"""generate_batch (harness.decode.batch_loop): at T=0 in fp32 each request of a batch emits its own B=1 AR tokens
and its own B=1 accepted counts (tau), for AR and every speculative arm, B in {1, 2, 3, 4, 8}, with prompts of
different lengths, output limits and stop times; near the context limit too; one host read per step."""
import dataclasses

import pytest
import torch

from core.protocols import Proposal
from doubles import ScriptedDrafter
from drafters.dflash import DFlashDrafter
from harness.decode import batch_loop
from harness.decode.batch_loop import generate_batch
from harness.decode.loop import DecodeSettings, generate
from refiners.markov import MarkovRefiner, random_markov_head
from refiners.xpress import XPressRefiner, random_xpress_head
from tiny import CPU32, VOCAB, tiny_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4
ARMS = ("ar", "drafter-only", "dflash", "markov", "xpress1", "xpress3")
LENGTHS = (5, 23, 1, 37, 12, 2, 30, 8)   # neighbours always differ in length
BUDGETS = (14, 9, 17, 12, 6, 15, 11, 13)  # and in output limit


class SoftScripted(ScriptedDrafter):
    """A scripted drafter (whole or partial blocks of the target's own continuation) with soft logits and hidden
    rows drawn from its position, so that a refiner can change its drafts, the same way at every B."""

    def propose(self, anchor, position, length):
        p = super().propose(anchor, position, length)
        hidden = torch.randn(self.block_size, self.hidden, generator=torch.Generator().manual_seed(int(position)))
        return Proposal(p.tokens, p.logits * 0.1, hidden)


@pytest.fixture(scope="module", params=["qwen3", "llama"])  # llama: no q/k norms in the batched attention
def case(request):
    t = tiny_target(request.param, capacity=128, layers=2)  # 2 layers: each layer is the same code; 6 cost 3x
    base = tiny_drafter(t, block=BLOCK, target_layer_ids=[0, 1])
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(8, 104, (n,), generator=g).tolist() for n in LENGTHS]
    refs = [generate(t, p, DecodeSettings(40, 512, ()), CPU32).tokens for p in prompts]
    planted = refs[1][5]  # an EOS planted in request 1's continuation: requests stop at different steps
    stops = (3, 5, planted)
    refiners = {"markov": MarkovRefiner(random_markov_head("vanilla", VOCAB, 64, 8, seed=3, std=0.3)),
                "xpress1": XPressRefiner(random_xpress_head(VOCAB, 64, 16, BLOCK, seed=7, std=0.15), 1),
                "xpress3": XPressRefiner(random_xpress_head(VOCAB, 64, 16, BLOCK, seed=7, std=0.15), 3)}
    return t, base, prompts, refs, stops, refiners


def drafter_for(arm, case, i, log=None):
    """A fresh drafter for request i (each request holds its own context); `log` records its proposals."""
    t, base, prompts, refs, _, _ = case
    if arm == "ar":
        return None
    if arm == "dflash":
        d = DFlashDrafter(base.model, t.embed, t.lm_head, CPU32)
        if log is not None:
            real = d.propose

            def propose(*a):
                p = real(*a)
                log.append(p.logits.clone())
                return p
            d.propose = propose
        return d
    wrong = [None if (c + i) % 3 == 0 else (c * 5 + i) % (BLOCK - 1) for c in range(60)]
    return SoftScripted(prompts[i] + refs[i], BLOCK, VOCAB, wrong_at=wrong, hidden=64)


def settings(case, **kw):
    return DecodeSettings(**{"max_new_tokens": max(BUDGETS), "max_model_len": 512, "stop_ids": case[4], **kw})


@pytest.fixture(scope="module")
def singles(case):
    """Per arm and prompt: its own B=1 generation, and (dflash) the drafter's proposals."""
    t, _, prompts, _, _, refiners = case
    out, changed = {}, set()

    def seen(step):  # the refiner changed a draft: its arm is not drafter-only in disguise
        p = step["proposal"]
        if p is not None and p.drafted is not None and bool((p.tokens != p.drafted).any()):
            changed.add(arm)

    for arm in ARMS:
        for i, p in enumerate(prompts):
            log = []
            s = settings(case, max_new_tokens=BUDGETS[i])
            g = generate(t, p, s, CPU32, drafter=drafter_for(arm, case, i, log), refiner=refiners.get(arm),
                         on_step=seen)
            out[arm, i] = g, log
    assert changed == set(refiners), changed
    return out


@pytest.mark.parametrize("arm", ARMS)
def test_each_request_equals_its_own_b1_decode(case, singles, arm):
    """Guards batching against mixing requests (one's K/V, position, drafter context, stops or budget leaking into
    a neighbour of another length): every request's tokens equal its B=1 AR tokens, its accepted counts and stop
    reason its B=1 ones of the same arm, and (dflash) its drafter proposes what it proposes at B=1."""
    t, _, prompts, _, _, refiners = case
    reasons, accepted = set(), set()
    for b in (1, 2, 3, 4, 8):
        idx = [(b + j) % len(prompts) for j in range(b)]
        logs = {i: [] for i in idx}
        drafters = None if arm == "ar" else [drafter_for(arm, case, i, logs[i]) for i in idx]
        gens = generate_batch(t, [prompts[i] for i in idx], settings(case), CPU32, drafters=drafters,
                              refiner=refiners.get(arm), max_new_tokens=[BUDGETS[i] for i in idx])
        for i, g in zip(idx, gens):
            single, log = singles[arm, i]
            assert g.tokens == singles["ar", i][0].tokens, (arm, b, i)
            assert (g.accepted, g.accept_lengths, g.stop_reason) == \
                (single.accepted, single.accept_lengths, single.stop_reason), (arm, b, i)
            assert g.spec_steps == single.spec_steps and g.host_syncs == single.host_syncs
            assert len(logs[i]) == len(log) and all(torch.allclose(x, y, atol=1e-5) for x, y in zip(logs[i], log))
            reasons.add(g.stop_reason)
            accepted.update(g.accepted)
    assert reasons == {"eos", "max_new_tokens"}, reasons
    if arm not in ("ar", "dflash"):
        assert len(accepted) >= 2, accepted  # tau varies: it has something to get wrong


@pytest.mark.parametrize("arm", ["ar", "drafter-only", "xpress1"])
def test_requests_at_the_context_limit(case, arm):
    """Guards the tail of a batch: a request too close to max_model_len for a block takes plain target steps beside
    neighbours that still speculate, and a finished request's masked blocks stay inside its own cache row (a write
    past the cache raises on CPU): every request still equals its B=1 decode."""
    t, _, _, _, _, refiners = case
    limit = 48
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(8, 104, (n,), generator=g).tolist() for n in (limit - BLOCK - 2, 3, limit - 2, 40)]
    refs = [generate(t, p, DecodeSettings(60, limit, ()), CPU32).tokens for p in prompts]
    s = DecodeSettings(60, limit, ())

    def drafter(i):
        return None if arm == "ar" else SoftScripted(prompts[i] + refs[i], BLOCK, VOCAB, hidden=64)

    gens = generate_batch(t, prompts, s, CPU32, drafters=None if arm == "ar" else [drafter(i) for i in range(4)],
                          refiner=refiners.get(arm))
    for i, gb in enumerate(gens):
        single = generate(t, prompts[i], s, CPU32, drafter=drafter(i), refiner=refiners.get(arm))
        assert gb.tokens == refs[i] == single.tokens and gb.stop_reason == "max_model_len"
        assert (gb.accepted, gb.tail_steps, gb.spec_steps) == (single.accepted, single.tail_steps, single.spec_steps)
    if arm != "ar":
        assert any(g.tail_steps for g in gens) and any(g.spec_steps for g in gens)


def test_one_host_read_per_step_for_the_whole_batch(case, monkeypatch):
    """Guards the one sync per step: a step reads every request's (accepted, first stop) as one [B, 2] tensor, and
    the batch takes as many reads as its longest request has steps."""
    t, _, prompts, _, _, refiners = case
    reads = []

    def read(packed):
        reads.append(tuple(packed.shape))
        return packed.tolist()

    monkeypatch.setattr(batch_loop, "_read", read)
    drafters = [drafter_for("xpress1", case, i) for i in range(4)]
    gens = generate_batch(t, prompts[:4], settings(case), CPU32, drafters=drafters, refiner=refiners["xpress1"],
                          max_new_tokens=list(BUDGETS[:4]))
    assert set(reads) == {(4, 2)}
    assert len(reads) == max(g.host_syncs for g in gens) > min(g.host_syncs for g in gens)


def test_reference_accounting_and_gaps_per_request(case):
    """Guards the per-request policy state in a batch: under --compat-reference a request whose EOS is a bonus
    token takes its extra step (counted, emitting nothing) while its neighbours go on, and the recorded top-2 gaps
    are each request's own; all as at B=1."""
    t, _, prompts, _, _, _ = case
    fixes = []  # request 0's correction/bonus tokens at B=1, each with the output length it ends
    out = generate(t, prompts[0], DecodeSettings(max(BUDGETS), 512, ()), CPU32,
                   drafter=drafter_for("drafter-only", case, 0),
                   on_step=lambda st: fixes.append((int(st["next_token"]), st["produced"]))).tokens
    # the first correction/bonus token new in request 0's output: as its EOS it takes the extra step
    stop = next(tok for tok, produced in fixes if tok not in out[:produced - 1])
    s = DecodeSettings(max(BUDGETS), 512, (stop,), compat_reference=True, record_gaps=True)
    idx = range(len(prompts))
    gens = generate_batch(t, prompts, s, CPU32, drafters=[drafter_for("drafter-only", case, i) for i in idx],
                          max_new_tokens=list(BUDGETS))
    for i, g in zip(idx, gens):
        alone = generate(t, prompts[i], dataclasses.replace(s, max_new_tokens=BUDGETS[i]), CPU32,
                         drafter=drafter_for("drafter-only", case, i))
        assert (g.tokens, g.accept_lengths, g.extra_steps) == (alone.tokens, alone.accept_lengths, alone.extra_steps)
        assert g.top2_gaps == pytest.approx(alone.top2_gaps, abs=1e-4)
    assert any(g.extra_steps for g in gens) and not all(g.extra_steps for g in gens)
