"""Markov-head baseline: each variant equals a hand-written sequential loop; greedy decoding with it is lossless."""
import pytest
import torch

from core.protocols import Proposal, RefineContext
from harness.decode.loop import DecodeSettings, generate
from refiners.markov import VARIANTS, MarkovHead, MarkovRefiner, markov_head_from_state, random_markov_head
from tiny import CPU32, VOCAB, tiny_drafter, tiny_target
from tolerance import assert_close

V, H, R, B = 48, 20, 12, 7


pytestmark = pytest.mark.usefixtures("one_thread")


def case(variant, seed, std=0.5):
    head = random_markov_head(variant, V, H, R, seed, std=std)
    g = torch.Generator().manual_seed(100 + seed)
    hidden = torch.randn(B, H, generator=g)
    base = torch.randn(B - 1, V, generator=g)
    return head, Proposal(base.argmax(-1), base, hidden), RefineContext(*torch.randint(0, V, (2,), generator=g))


def by_hand(head, p, anchor):
    """The recurrence written out from the raw weight matrices."""
    e1, w2 = head.w1.weight, head.w2.weight
    prev, s = int(anchor), torch.zeros(R)
    tokens, rows = [], []
    for k in range(1, B):
        e = e1[prev]
        h = p.hidden[k]  # the row that predicts slot k
        if head.variant == "vanilla":
            u = e
        elif head.variant == "gated":
            u = torch.sigmoid(head.gate.weight @ torch.cat((h, e)) + head.gate.bias) * e
        else:
            pre = head.cell.weight @ torch.cat((s, e, h)) + head.cell.bias
            g, c, o = pre[:R], pre[R:2 * R], pre[2 * R:]
            s = torch.sigmoid(g) * s + (1 - torch.sigmoid(g)) * torch.tanh(c)
            u = torch.tanh(o)
        row = p.logits[k - 1] + w2 @ u
        prev = int(row.argmax())
        tokens.append(prev)
        rows.append(row)
    return torch.tensor(tokens), torch.stack(rows)


def run(head, p, ctx):
    with torch.no_grad():
        return MarkovRefiner(head).refine(p, ctx)


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_equals_the_loop_by_hand(variant):
    changed = 0
    for seed in range(5):
        head, p, ctx = case(variant, seed)
        out = run(head, p, ctx)
        with torch.no_grad():
            tokens, rows = by_hand(head, p, ctx.anchor)
        assert torch.equal(out.tokens, tokens), seed
        assert_close(out.logits, rows, steps=2)
        assert torch.equal(out.logits.argmax(-1), out.tokens)  # q is the distribution each token came from
        assert torch.equal(out.drafted, p.tokens) and out.hidden is p.hidden
        changed += int((out.tokens != p.tokens).sum())
    assert changed > 0, "the head never changed a token: the test would prove nothing"


def test_vanilla_with_zero_readout_is_the_drafter_seed():
    head, p, ctx = case("vanilla", 0)
    with torch.no_grad():
        head.w2.weight.zero_()
    out = run(head, p, ctx)
    assert torch.equal(out.tokens, p.tokens) and torch.equal(out.logits, p.logits)


def test_first_step_reads_the_anchor_and_hidden_rows_are_per_slot():
    head, p, ctx = case("gated", 1)
    other = RefineContext((ctx.anchor + 1) % V, ctx.prev_token)
    assert not torch.equal(run(head, p, other).logits[0], run(head, p, ctx).logits[0])
    ignored = RefineContext(ctx.anchor, (ctx.prev_token + 1) % V)  # the token before the anchor is not an input
    assert torch.equal(run(head, p, ignored).logits, run(head, p, ctx).logits)
    for variant in VARIANTS:
        head, p, ctx = case(variant, 2)
        ref = run(head, p, ctx)
        row0 = Proposal(p.tokens, p.logits, torch.cat((p.hidden[:1] + 1, p.hidden[1:])))
        assert torch.equal(run(head, row0, ctx).logits, ref.logits), variant  # the anchor row is never read
        row3 = Proposal(p.tokens, p.logits, torch.cat((p.hidden[:3], p.hidden[3:4] + 1, p.hidden[4:])))
        moved = run(head, row3, ctx).logits
        assert torch.equal(moved[:2], ref.logits[:2]), variant  # slots 1, 2 do not see row 3
        assert torch.equal(moved[2], ref.logits[2]) == (variant == "vanilla"), variant  # slot 3 reads row 3


def test_only_the_rnn_carries_state_across_slots():
    for variant in VARIANTS:
        head, p, _ = case(variant, 3)
        prev = torch.tensor(4)
        with torch.no_grad():
            s0 = head.initial_state(p.logits)
            _, s1 = head.step(prev, p.hidden[1], s0)
            _, s1b = head.step(prev, p.hidden[1] + 1, s0)
            b2, b2b = head.step(prev, p.hidden[2], s1)[0], head.step(prev, p.hidden[2], s1b)[0]
        assert torch.equal(b2, b2b) == (variant != "rnn"), variant


def test_shapes_dtypes_names_and_errors():
    head, p, ctx = case("rnn", 0)
    bf = Proposal(p.tokens, p.logits.bfloat16(), p.hidden.bfloat16())
    out = run(head.to(torch.bfloat16), bf, ctx)
    assert out.logits.dtype == torch.bfloat16 and out.tokens.shape == (B - 1,) and out.tokens.dtype == torch.long
    assert set(MarkovHead("vanilla", V, R).state_dict()) == {"w1.weight", "w2.weight"}
    assert set(MarkovHead("gated", V, R, H).state_dict()) == {"w1.weight", "w2.weight", "gate.weight", "gate.bias"}
    assert set(MarkovHead("rnn", V, R, H).state_dict()) == {"w1.weight", "w2.weight", "cell.weight", "cell.bias"}
    assert MarkovHead("rnn", V, R, H).cell.weight.shape == (3 * R, 2 * R + H)
    assert MarkovHead("gated", V, R, H).gate.weight.shape == (R, H + R)
    ref = MarkovRefiner(head)
    assert ref.name == "markov" and ref.passes == 0
    for variant in VARIANTS:
        src = random_markov_head(variant, V, H, R, 1)
        built = markov_head_from_state(src.state_dict(), variant, dtype=torch.bfloat16)
        assert built.w1.weight.dtype == torch.bfloat16 and not built.training
        assert all(torch.equal(a.bfloat16(), b) for a, b in zip(src.state_dict().values(), built.state_dict().values()))
    with pytest.raises(ValueError, match="variant"):
        MarkovHead("lstm", V, R, H)
    with pytest.raises(ValueError, match="hidden size"):
        MarkovHead("gated", V, R)


# --- end to end -------------------------------------------------------------------------------------------------

def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, 104, (int(k),), generator=g).tolist() for k in torch.randint(2, 30, (n,), generator=g)]


def test_greedy_markov_is_lossless():
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block=4)
    s = DecodeSettings(max_new_tokens=10, max_model_len=512, stop_ids=(3, 5))
    refs = [generate(t, pr, s, CPU32).tokens for pr in prompts(6)]
    for variant in VARIANTS:
        seen = []
        log = lambda st: seen.append(bool((st["proposal"].tokens != st["proposal"].drafted).any())) \
            if st["proposal"] is not None else None
        ref = MarkovRefiner(random_markov_head(variant, VOCAB, 64, 16, seed=5, std=0.5))
        for i, pr in enumerate(prompts(6)):
            assert generate(t, pr, s, CPU32, drafter=d, refiner=ref, on_step=log).tokens == refs[i], (variant, i)
        assert any(seen), variant
