"""The refiner contract at T > 0 (core.protocols.Refiner): slot k's returned scores and token do not depend on the
frozen draft noise of any later slot.

Rejection verification treats slot k's token as a draw from q_k (the returned logits row k) given the slots
before it; that is lossless only when q_k and the token are functions of the noise of slots 0..k. The check runs
as the decode loop does (harness.decode.loop): one frozen noise draw per block, the seed draft drawn from the
drafter's logits with it, then `refine` with the sampler in the context. For each k, the noise of slots > k is
redrawn and slot k's row of the returned logits and its token must be bit-identical.

Every registered refiner is covered: xPress at several K, full vocabulary and top-C, both slot-0 conventions;
Markov in every variant (and DeepSpec's low-precision sampling); the identity refiner. The Spyre-numerics xPress
is exempt because it drafts greedily only and refuses a sampler (asserted below). A deliberately broken refiner
(right to left: slot k conditioned on slot k+1's sampled token) is caught by the same check, so it can fail.
"""
import pytest
import torch

from core.protocols import IdentityRefiner, Proposal, RefineContext
from harness.decode.sampling import NOISE_KINDS, DraftSampler, SamplingParams
from refiners.markov import VARIANTS, MarkovRefiner, random_markov_head
from refiners.spyre_numerics import SpyreXPressRefiner
from refiners.xpress import XPressRefiner, random_xpress_head

V, H, R, B = 40, 16, 6, 6   # B - 1 = 5 draft slots
SLOTS = B - 1
PERTURBATIONS = 4
CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


def block(seed: int):
    """A drafter's block output (logits [B-1, V], hidden [B, H]) and the context's two tokens."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(SLOTS, V, generator=g) * 2
    hidden = torch.randn(B, H, generator=g)
    anchor, prev = torch.randint(0, V, (2,), generator=g)
    return logits, hidden, anchor, prev


def run(refiner, case, sampler: DraftSampler):
    """One block as the loop runs it, with the sampler's current (frozen) noise: seed draft, then refine."""
    logits, hidden, anchor, prev = case
    seed = Proposal(sampler.select(logits), logits, hidden)
    out = refiner.refine(seed, RefineContext(anchor=anchor, prev_token=prev, sampler=sampler))
    return out.tokens, out.logits


def later_noise_leaks(refiner, noise: str, temperature: float = 1.0, top_k: int = 0, cases=(0, 1)) -> list[str]:
    """Where slot k's scores or token changed when only the noise of slots > k was redrawn (empty: contract kept).

    Also asserts the perturbations reach the refiner at all (some later slot's token moves), so that a pass here
    is not a sampler that was never read."""
    params = SamplingParams(temperature=temperature, top_k=top_k)
    sampler = DraftSampler(params, noise, SLOTS, V, CPU)
    leaks, moved = [], False
    for c in cases:
        case = block(c)
        sampler.new_block(torch.Generator().manual_seed(1000 + c))
        frozen = sampler.frozen.clone()
        tokens, scores = run(refiner, case, sampler)
        for k in range(SLOTS - 1):
            for p in range(PERTURBATIONS):
                sampler.new_block(torch.Generator().manual_seed(7 + 31 * p + 97 * k + 1009 * c))
                sampler.frozen[: k + 1] = frozen[: k + 1]          # slots 0..k keep their noise
                t2, s2 = run(refiner, case, sampler)
                moved |= not torch.equal(t2[k + 1:], tokens[k + 1:])
                if not torch.equal(s2[k], scores[k]) or t2[k] != tokens[k]:
                    leaks.append(f"case {c}, slot {k}, perturbation {p}")
            sampler.frozen.copy_(frozen)
    assert moved, "redrawing the later slots' noise never changed a later token: the check exercised nothing"
    return leaks


def xpress(passes, topc=0, prev_anchor=False, seed=3):
    return XPressRefiner(random_xpress_head(V, H, R, B, seed, std=0.3, mix_std=0.5), passes,
                         prev_anchor=prev_anchor, topc=topc)


REFINERS = {
    "identity": lambda: IdentityRefiner(),
    **{f"xpress-K{k}": (lambda k=k: xpress(k)) for k in (1, 2, 3, SLOTS)},
    **{f"xpress-K{k}-top{c}": (lambda k=k, c=c: xpress(k, topc=c)) for k, c in ((1, 8), (2, 2), (3, 8), (SLOTS, 20))},
    "xpress-K2-prev-anchor": lambda: xpress(2, prev_anchor=True),
    **{f"markov-{v}": (lambda v=v: MarkovRefiner(random_markov_head(v, V, H, R, 5, std=0.5))) for v in VARIANTS},
    **{f"markov-{v}-lowp": (lambda v=v: MarkovRefiner(random_markov_head(v, V, H, R, 5, std=0.5),
                                                      low_precision_sampling=True)) for v in VARIANTS},
}


@pytest.mark.parametrize("noise", NOISE_KINDS)
@pytest.mark.parametrize("name", sorted(REFINERS))
def test_slot_k_ignores_the_noise_of_later_slots(name, noise):
    assert later_noise_leaks(REFINERS[name](), noise) == []


@pytest.mark.parametrize("noise", NOISE_KINDS)
def test_the_contract_holds_with_filtered_sampling(noise):
    """Top-k filtering and a low temperature change which tokens the noise can reach, not the contract."""
    assert later_noise_leaks(xpress(3, topc=8), noise, temperature=0.7, top_k=5) == []
    assert later_noise_leaks(MarkovRefiner(random_markov_head("rnn", V, H, R, 5, std=0.5)), noise,
                             temperature=0.7, top_k=5) == []


def test_spyre_numerics_is_exempt_because_it_refuses_a_sampler():
    """Spyre numerics draft greedily (no noise is read), so the contract has nothing to check; it must refuse
    sampled drafting rather than ignore the sampler."""
    refiner = SpyreXPressRefiner(random_xpress_head(V, H, R, B, 3), 2, 8)
    sampler = DraftSampler(SamplingParams(1.0), "gumbel", SLOTS, V, CPU)
    sampler.new_block(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="greedily"):
        run(refiner, block(0), sampler)


class RightToLeft:
    """A broken refiner: slot k is re-drawn after slot k+1, conditioned on slot k+1's sampled token, so slot k's
    scores read the noise of slot k+1 (and through it every later slot)."""
    name, passes = "right-to-left", 1

    def __init__(self, seed=0):
        self.table = torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * 3

    def refine(self, proposal, ctx):
        tokens, rows = [None] * SLOTS, [None] * SLOTS
        nxt = None
        for k in reversed(range(SLOTS)):
            rows[k] = proposal.logits[k] + (0 if nxt is None else self.table[nxt])
            nxt = tokens[k] = ctx.sampler.select(rows[k], slot=k)
        return proposal.with_tokens(torch.stack(tokens), torch.stack(rows))


@pytest.mark.parametrize("noise", NOISE_KINDS)
def test_a_refiner_that_reads_later_noise_is_caught(noise):
    """The check above can fail: a refiner whose slot k depends on slot k+1's draw is reported at every slot."""
    leaks = later_noise_leaks(RightToLeft(), noise)
    assert {s.split(", perturbation")[0] for s in leaks} == {f"case {c}, slot {k}" for c in (0, 1)
                                                               for k in range(SLOTS - 1)}
