"""generate_batch at T > 0: a request's draws are its own (its generator, its draft noise), so with the same
per-request generator it emits exactly what it emits at B=1 beside neighbours of other lengths; in a batch its
first tokens pass test_sampling's goodness-of-fit test against the target's exact distribution."""
import pytest
import torch

from drafters.dflash import DFlashDrafter
from drafters.dflash_batch import DFlashGroup
from harness.decode.batch_loop import generate_batch
from harness.decode.loop import DecodeSettings, generate
from refiners.markov import MarkovRefiner, random_markov_head
from refiners.xpress import XPressRefiner, random_xpress_head
from test_sampling import N, N_TOKENS, PROMPT, chi_square_pvalue, exact_distribution, model, refiner_for  # noqa: F401
from tiny import CPU32, VOCAB, tiny_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4


@pytest.fixture(scope="module")
def case():
    t = tiny_target("qwen3", capacity=128, layers=2)  # 2 layers: each layer is the same code; 6 cost 3x
    base = tiny_drafter(t, block=BLOCK, target_layer_ids=[0, 1])
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(8, 104, (n,), generator=g).tolist() for n in (6, 19, 2)]
    refiners = {"markov": MarkovRefiner(random_markov_head("vanilla", VOCAB, 64, 8, seed=3, std=0.3)),
                "xpress3": XPressRefiner(random_xpress_head(VOCAB, 64, 16, BLOCK, seed=7, std=0.3), 3)}
    return t, base, prompts, refiners


SAMPLED = {"T1": dict(temperature=1.0), "topp": dict(temperature=0.8, top_p=0.9),
           "Td0": dict(temperature=1.0, draft_temperature=0.0)}


@pytest.mark.parametrize("setting", list(SAMPLED))
@pytest.mark.parametrize("arm", ["ar", "drafter-only", "markov", "xpress3", "drafter-only grouped", "xpress3 grouped"])
def test_sampled_requests_draw_what_they_draw_alone(case, arm, setting):
    """Guards a request's randomness against its neighbours: with its own seeded generator, each request of a batch
    of 2 or 3 (other lengths, other seeds) emits the tokens, accepted counts and stop of its B=1 decode with the
    same seed (target samples, frozen draft noise, rejection or exact-match verdicts alike); "grouped": the batch
    drafts in one forward (drafters.dflash_batch.DFlashGroup)."""
    t, base, prompts, refiners = case
    s = DecodeSettings(16, 512, (3, 5), **SAMPLED[setting])
    arm, grouped = arm.split()[0], arm.endswith("grouped")

    def drafter():
        return None if arm == "ar" else DFlashDrafter(base.model, t.embed, t.lm_head, CPU32)

    def drafters(b):
        if arm == "ar":
            return None
        return DFlashGroup(drafter(), b).members if grouped else [drafter() for _ in range(b)]

    # one seed per prompt for both batch sizes: each request's B=1 decode is run once and compared with its draws
    # at B=2 and at B=3 (its neighbours differ: one request of another length, or two)
    seeds = [11, 12, 13]
    alone = [generate(t, prompts[i], s, CPU32, drafter=drafter(), refiner=refiners.get(arm),
                      generator=CPU32.generator(seeds[i])) for i in range(3)]
    for b in (2, 3):
        gens = generate_batch(t, prompts[:b], s, CPU32, drafters=drafters(b),
                              refiner=refiners.get(arm), generators=[CPU32.generator(x) for x in seeds[:b]])
        for i, g in enumerate(gens):
            want = (alone[i].tokens, alone[i].accepted, alone[i].stop_reason)
            assert (g.tokens, g.accepted, g.stop_reason) == want, (arm, setting, b, i)
    # the draws do depend on the seeds (so the equalities above compare sampled draws): another seed, other tokens
    other = generate(t, prompts[0], s, CPU32, drafter=drafter(), refiner=refiners.get(arm),
                     generator=CPU32.generator(1))
    assert other.tokens != alone[0].tokens


@pytest.mark.parametrize("method", ["ar", "markov", "xpress4"])
def test_first_tokens_follow_the_target_distribution_in_a_batch(model, method):
    """Guards losslessness in a batch (test_sampling's test, beside a neighbour of another length and seed): the
    first tokens of a request follow the target's exact distribution. N = 600 draws (test_sampling's N), two a
    batch: [PROMPT, neighbour, PROMPT] at B=3, each PROMPT request with its own generator, so its two draws are
    independent ones of the request's law, and each sits beside the 5-token neighbour (300 batches; 600 at B=2
    before, one draw each: about 45% of the CPU time, as a batch's cost barely grows with B here; the exactness
    test above holds every arm to its B=1 draws at B=2 and at B=3). A request's law in a batch is its law at B=1,
    so test_sampling's power table holds here for the same bugs (every draft accepted: 1.0; AR at a wrong
    temperature: >= 0.975; the residual replaced by p: Markov 0.93, xPress 0.98). The drafters (one a row) are
    built once and serve every batch, as a server's rows do."""
    t, drafter = model
    settings = DecodeSettings(N_TOKENS, 64, (), temperature=1.0)
    exact = exact_distribution(t, settings.target_params)
    refiner = refiner_for(method)
    neighbour = [2, 5, 1, 0, 3]
    drafters = None if method == "ar" else [DFlashDrafter(drafter.model, t.embed, t.lm_head, CPU32)
                                            for _ in range(3)]
    counts = {}
    for i in range(N // 2):
        gens = generate_batch(t, [PROMPT, neighbour, PROMPT], settings, CPU32, drafters=drafters, refiner=refiner,
                              generators=[CPU32.generator(7 * 100003 + 2 * i), CPU32.generator(i),
                                          CPU32.generator(7 * 100003 + 2 * i + 1)])
        for g in (gens[0], gens[2]):
            counts[tuple(g.tokens)] = counts.get(tuple(g.tokens), 0) + 1
    pvalue = chi_square_pvalue(counts, {k: p * N for k, p in exact.items()})
    assert pvalue > 1e-3, f"{method} in a batch: p = {pvalue:.2e}"
