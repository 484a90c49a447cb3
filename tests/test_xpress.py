"""xPress head and K-pass Jacobi rollout: sequential equivalence, folding, causality, shortlist, losslessness."""
import copy

import pytest
import torch

from core.protocols import Proposal, RefineContext
from harness.decode.loop import DecodeSettings, generate
from refiners.xpress import (MAX_TOPC, XPressHead, XPressRefiner, random_xpress_head, sequential_decode, shortlist,
                             xpress_head_from_state)
from tiny import CPU32, VOCAB, tiny_drafter, tiny_target
from tolerance import assert_close

V, H, R, B = 64, 24, 16, 8
SEEDS = range(6)


pytestmark = pytest.mark.usefixtures("one_thread")


def case(seed, folded=False, v=V, block=B, std=0.2):
    """A random head and block whose base logits are on the scale of the head's token-dependent bias, so that
    refinement really changes tokens."""
    head = random_xpress_head(v, H, R, block, seed, std=std)
    if folded:
        head.fold()
    g = torch.Generator().manual_seed(1000 + seed)
    hidden = torch.randn(block, H, generator=g)
    with torch.no_grad():
        spread = head(hidden, torch.randint(0, v, (block,), generator=g)).std()
    base = torch.randn(block - 1, v, generator=g) * spread
    anchor, prev = torch.randint(0, v, (2,), generator=g)
    return head, Proposal(base.argmax(-1), base, hidden), RefineContext(anchor=anchor, prev_token=prev)


def refine(head, p, ctx, k, **kw):
    with torch.no_grad():
        return XPressRefiner(head, k, **kw).refine(p, ctx)


@pytest.mark.parametrize("folded", [False, True])
def test_jacobi_settles_the_prefix_like_a_sequential_decode(folded):
    changed = 0
    for seed in SEEDS:
        head, p, ctx = case(seed, folded)
        seq, seq_q = sequential_decode(head, p.hidden, p.logits, ctx.anchor, ctx.prev_token)
        for k in range(0, B + 2):
            out = refine(head, p, ctx, k)
            m = min(k, B - 1)
            assert torch.equal(out.tokens[:m], seq[:m]), (seed, k)
            if k >= B - 1:
                assert torch.equal(out.tokens, seq)
                assert torch.equal(out.logits, seq_q)  # the same prefix gives bit-identical refined logits
        changed += int((seq != p.tokens).sum())
    assert changed > 0, "refinement never changed a token: the test would prove nothing"


def test_each_pass_feeds_the_previous_pass_tokens():
    """One pass by hand from the training-form head: prev = [tok_am1, anchor, t_1..t_{B-2}], all slots at once."""
    head, p, ctx = case(0)
    t = p.tokens
    for _ in range(3):
        prev = torch.cat((ctx.prev_token.view(1), ctx.anchor.view(1), t[:-1]))
        with torch.no_grad():
            refined = p.logits + head(p.hidden, prev)[1:]
        t = refined.argmax(-1)
    out = refine(head, p, ctx, 3)
    assert torch.equal(out.tokens, t)
    assert_close(out.logits, refined, steps=4)
    assert torch.equal(out.drafted, p.tokens)


def test_hoisted_pass_equals_the_training_form():
    head, p, _ = case(1)
    prev = torch.randint(0, V, (B,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hoisted = head.w2(head.latent(head.block_cache(p.hidden), prev))
        full = head(p.hidden, prev)[1:]
    assert_close(hoisted, full, steps=4)


def test_fold_agrees_with_the_raw_mixer():
    """Tokens agree exactly; logits only to rounding: the folded sum includes (1 + L_kk) x_k where the raw form adds
    x_k after the sum, and 1 + L_kk itself is rounded, so bit equality is not achievable (not even in fp64)."""
    g = torch.Generator().manual_seed(9)
    worst = 0.0
    for seed in SEEDS:
        head, p, ctx = case(seed)
        folded = copy.deepcopy(head).fold()
        prev = torch.randint(0, V, (B,), generator=g)
        with torch.no_grad():
            a, b = head(p.hidden, prev), folded(p.hidden, prev)
        worst = max(worst, float((a - b).abs().max() / a.abs().max()))
        for k in (1, 3, B - 1):
            x, y = refine(head, p, ctx, k), refine(folded, p, ctx, k)
            assert torch.equal(x.tokens, y.tokens), (seed, k)
            assert_close(x.logits, y.logits, steps=4)
    assert 0 < worst <= 1e-6  # relative to the largest bias: a few fp32 ulps


def test_fold_once_in_the_current_dtype():
    head = random_xpress_head(V, H, R, B, 0).to(torch.bfloat16)
    raw = head.mix.L.detach().clone()
    head.fold()
    tril = torch.ones(B, B).tril().to(torch.bfloat16)
    assert head.mix.L.dtype == torch.bfloat16
    assert torch.equal(head.mix.L, raw * tril + torch.eye(B, dtype=torch.bfloat16))
    assert head.folded
    with pytest.raises(RuntimeError, match="already folded"):
        head.fold()
    # Folding in fp32 then casting rounds differently (the reference's quirk): the order is visible.
    other = random_xpress_head(V, H, R, B, 0).fold().to(torch.bfloat16)
    assert not torch.equal(other.mix.L, head.mix.L)


def test_state_dict_names_tril_and_serving_mixer():
    head = random_xpress_head(V, H, R, B, 3)
    keys = set(head.state_dict())
    assert keys == {"w1.weight", "down_h.weight", "down_g.weight", "in_proj.weight", "mix.L",
                    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "w2.weight"}
    sd = head.state_dict()
    fresh = XPressHead(V, H, R, B)
    fresh.load_state_dict(sd)
    fresh.load_state_dict({**sd, "mix.tril": torch.ones(B, B).tril()})
    assert torch.equal(fresh.mix.L, head.mix.L)
    with pytest.raises(RuntimeError, match="tril"):
        fresh.load_state_dict({**sd, "mix.tril": torch.ones(B + 1, B + 1).tril()})

    _, p, ctx = case(3)
    folded = copy.deepcopy(head).fold()
    served = folded.state_dict()
    assert "mix.M" in served and "mix.L" not in served
    rebuilt = XPressHead(V, H, R, B, folded=True)
    rebuilt.load_state_dict(served)
    via_matrix = XPressHead(V, H, R, B)
    via_matrix.load_state_dict(sd)
    via_matrix.load_serving_mixer(folded.mix.L.detach())
    for h in (rebuilt, via_matrix):
        assert h.folded
        assert torch.equal(refine(h, p, ctx, 4).logits, refine(folded, p, ctx, 4).logits)
    with pytest.raises(RuntimeError, match="already folded"):
        XPressHead(V, H, R, B).load_state_dict(served)       # a folded matrix into a raw head: refused
    with pytest.raises(RuntimeError, match="raw mixer"):
        XPressHead(V, H, R, B, folded=True).load_state_dict(sd)  # a raw matrix into a folded head: refused


def test_head_from_training_state_casts_then_folds():
    head = random_xpress_head(V, H, R, B, 6)
    sd = {**head.state_dict(), "mix.tril": torch.ones(B, B).tril()}
    built = xpress_head_from_state(sd, dtype=torch.bfloat16)
    assert built.folded and built.w2.weight.dtype == torch.bfloat16 and not built.training
    by_hand = copy.deepcopy(head).to(torch.bfloat16).fold()
    assert torch.equal(built.mix.L, by_hand.mix.L)
    served = {**head.state_dict(), "mix.L": copy.deepcopy(head).fold().mix.L.detach()}
    pre = xpress_head_from_state(served, mixer="folded")
    assert torch.equal(pre.mix.L, served["mix.L"])  # installed, not folded again
    assert not xpress_head_from_state(head.state_dict(), fold=False).folded
    with pytest.raises(ValueError, match="mixer"):
        xpress_head_from_state(sd, mixer="half")


@pytest.mark.parametrize("folded", [False, True])
def test_bias_is_causal_across_the_block(folded):
    head, p, _ = case(2, folded)
    g = torch.Generator().manual_seed(5)
    prev = torch.randint(0, V, (B,), generator=g)
    with torch.no_grad():
        cache = head.block_cache(p.hidden)
        full, hoisted = head(p.hidden, prev), head.w2(head.latent(cache, prev))
        for j in range(B):
            other = prev.clone()
            other[j:] = (prev[j:] + 1 + torch.randint(0, V - 1, (B - j,), generator=g)) % V
            f, h = head(p.hidden, other), head.w2(head.latent(cache, other))
            assert torch.equal(f[:j], full[:j]), j
            assert torch.equal(h[: max(j - 1, 0)], hoisted[: max(j - 1, 0)]), j  # hoisted rows are slots 1..B-1
            assert not torch.equal(f[j], full[j]), j


def test_shortlist_is_the_top_c_with_lowest_id_ties():
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 4, (6, 40), generator=g).float()  # many ties, straddling every cut
    base[0] = 1.0
    for c in (1, 3, 7, 17, 40):
        ids = shortlist(base, c)
        order = torch.sort(-base, dim=-1, stable=True).indices[:, :c]  # by (-value, index)
        assert torch.equal(ids, order.sort(-1).values), c
    assert torch.equal(shortlist(base, 5)[0], torch.arange(5))


def test_full_size_shortlist_is_the_full_vocabulary():
    for seed in SEEDS:
        head, p, ctx = case(seed)
        for k in (1, 3, B - 1):
            a, b = refine(head, p, ctx, k), refine(head, p, ctx, k, topc=V)
            assert torch.equal(a.tokens, b.tokens), (seed, k)
            assert_close(a.logits, b.logits, steps=4)


@pytest.mark.parametrize("c", [1, 3, 7])
def test_shortlist_proposals_are_full_scores_restricted_to_the_candidates(c):
    for seed in SEEDS:
        head, p, ctx = case(seed)
        cand = torch.zeros_like(p.logits, dtype=torch.bool).scatter(-1, shortlist(p.logits, c), True)
        assert torch.equal(cand.sum(-1), torch.full((B - 1,), c))
        for k in (1, 2, B - 1):
            out = refine(head, p, ctx, k, topc=c)
            assert cand.gather(-1, out.tokens[:, None]).all(), (seed, k)
            assert torch.equal(torch.isinf(out.logits), ~cand)
            assert torch.equal(out.logits.argmax(-1), out.tokens)
        # One pass from the seed: exactly the full-vocabulary refined scores, masked to the fixed candidates.
        full = refine(head, p, ctx, 1).logits
        short = refine(head, p, ctx, 1, topc=c)
        assert_close(short.logits, full.masked_fill(~cand, float("-inf")), steps=4)
        assert torch.equal(short.tokens, full.masked_fill(~cand, float("-inf")).argmax(-1))
        # Enough passes: the sequential decode over the same candidate sets.
        seq, _ = sequential_decode(head, p.hidden, p.logits, ctx.anchor, ctx.prev_token, topc=c)
        assert torch.equal(refine(head, p, ctx, B - 1, topc=c).tokens, seq)
    head, p, ctx = case(0)
    assert torch.equal(refine(head, p, ctx, 4, topc=1).tokens, p.tokens)  # C = 1 can only return the seed


@pytest.mark.parametrize("topc", [0, 5])
def test_ties_go_to_the_lowest_token_id(topc):
    head = random_xpress_head(V, H, R, B, 0)
    with torch.no_grad():
        head.w2.weight.zero_()  # refined = base exactly
    base = torch.zeros(B - 1, V)
    for k in range(B - 1):
        base[k, [60 - k, 9 + k, 40]] = 2.0
    hidden = torch.randn(B, H, generator=torch.Generator().manual_seed(3))
    p = Proposal(torch.zeros(B - 1, dtype=torch.long), base, hidden)
    out = refine(head, p, RefineContext(torch.tensor(1), torch.tensor(2)), 2, topc=topc)
    assert torch.equal(out.tokens, 9 + torch.arange(B - 1))


def test_prev_anchor_switch_changes_slot_zero_predecessor():
    head, p, ctx = case(4)
    assert ctx.prev_token != ctx.anchor
    hf = refine(head, p, ctx, 1)
    vllm = refine(head, p, ctx, 1, prev_anchor=True)
    as_anchor = refine(head, p, RefineContext(ctx.anchor, ctx.anchor.clone()), 1)
    assert torch.equal(vllm.logits, as_anchor.logits)
    assert not torch.equal(vllm.logits[0], hf.logits[0])  # slot 1 reads x_0 through the mixer
    ignored = refine(head, p, RefineContext(ctx.anchor, (ctx.prev_token + 1) % V), 1, prev_anchor=True)
    assert torch.equal(ignored.logits, vllm.logits)


def test_zero_passes_is_the_drafter_seed():
    head, p, ctx = case(0)
    assert XPressRefiner(head, 0).refine(p, ctx) is p
    assert XPressRefiner(head, 0, topc=4).refine(p, ctx) is p


def test_shapes_dtypes_and_determinism():
    head, p, ctx = case(1)
    a, b = refine(head, p, ctx, 3, topc=4), refine(head, p, ctx, 3, topc=4)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logits, b.logits)
    assert a.tokens.shape == p.tokens.shape and a.tokens.dtype == torch.long
    assert a.logits.shape == p.logits.shape and a.hidden is p.hidden
    bf = copy.deepcopy(head).to(torch.bfloat16).fold()
    pb = Proposal(p.tokens, p.logits.bfloat16(), p.hidden.bfloat16())
    for c in (0, 4):
        out = refine(bf, pb, ctx, 3, topc=c)
        assert out.logits.dtype == torch.bfloat16 and out.tokens.shape == (B - 1,)
    mixed = refine(head, pb, ctx, 2)  # an fp32 head over bf16 drafter outputs keeps the proposal's dtype
    assert mixed.logits.dtype == torch.bfloat16


def test_topc_and_passes_validation():
    head = random_xpress_head(V, H, R, B, 0)
    for bad in (-1, V + 1, 2.0, True, None):
        with pytest.raises(ValueError, match="top-C"):
            XPressRefiner(head, 1, topc=bad)
    big = XPressHead(2000, 8, 4, 4)
    XPressRefiner(big, 1, topc=MAX_TOPC)
    with pytest.raises(ValueError, match="1..1024"):
        XPressRefiner(big, 1, topc=MAX_TOPC + 1)
    for bad in (-1, 1.0):
        with pytest.raises(ValueError, match="passes"):
            XPressRefiner(head, bad)
    _, p, ctx = case(0, block=B + 1)
    with pytest.raises(ValueError, match="block 8"):
        XPressRefiner(head, 2).refine(p, ctx)


# --- end to end: greedy speculative decoding with xPress equals AR -------------------------------------------------

STOPS = (3, 5)


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, 104, (int(k),), generator=g).tolist() for k in torch.randint(2, 30, (n,), generator=g)]


class Softened:
    """The oracle drafter with weaker logits and random hidden rows, so that a refiner flips some of its (correct)
    tokens and verification sees every acceptance length, not just all-or-nothing."""

    def __init__(self, inner, scale=0.3):
        self.inner, self.scale = inner, scale
        self.block_size, self.target_layer_ids, self.mask_token_id = inner.block_size, (), inner.mask_token_id
        self.g = torch.Generator().manual_seed(0)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, anchor, position, length):
        p = self.inner.propose(anchor, position, length)
        hidden = torch.randn(self.block_size, self.inner.hidden, generator=self.g)
        return Proposal(p.tokens, p.logits * self.scale, hidden)


def changed_log():
    seen = []
    def log(step):
        if step["proposal"] is not None:
            seen.append(bool((step["proposal"].tokens != step["proposal"].drafted).any()))
    return seen, log


def test_greedy_xpress_is_lossless_with_the_tiny_drafter():
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block=8)  # K in {1, 3, 6, 7 = B-1}
    head = random_xpress_head(VOCAB, 64, 16, d.block_size, seed=7, std=0.3)
    s = DecodeSettings(max_new_tokens=10, max_model_len=512, stop_ids=STOPS)
    refs = [generate(t, pr, s, CPU32).tokens for pr in prompts(6)]
    for k in (1, 3, 6, d.block_size - 1):
        for c in (0, 8):
            seen, log = changed_log()
            ref = XPressRefiner(head, k, topc=c)
            for i, pr in enumerate(prompts(6)):
                assert generate(t, pr, s, CPU32, drafter=d, refiner=ref, on_step=log).tokens == refs[i], (k, c, i)
            assert any(seen), (k, c)


def test_greedy_xpress_is_lossless_under_partial_acceptance():
    from doubles import ScriptedDrafter
    t = tiny_target("qwen3")
    b, m = 6, 20
    head = random_xpress_head(VOCAB, 64, 16, b, seed=3, std=0.2)
    lengths = set()
    for pr in prompts(4, seed=2):
        ref = generate(t, pr, DecodeSettings(m + b, 512, ()), CPU32).tokens
        s = DecodeSettings(m, 512, ())
        for k, c in ((1, 0), (3, 8), (b - 1, 0)):
            d = Softened(ScriptedDrafter(pr + ref, b, VOCAB, hidden=64))
            out = generate(t, pr, s, CPU32, drafter=d, refiner=XPressRefiner(head, k, topc=c))
            assert out.tokens == ref[:m], (pr, k, c)
            lengths.update(out.accepted)
    assert len(lengths) >= 3 and max(lengths) == b - 1, lengths
