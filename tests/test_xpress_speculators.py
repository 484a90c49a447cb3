"""The harness's xPress head computes what speculators 0.9.0 trains (issue 26: the tables measure the heads that
`python -m training` fits). speculators' own XPressRefinerHead, with random weights and a non-zero raw mixer, is
read through the harness's checkpoint layout (core.speculators_layout.split_tensors, then xpress_head_from_state,
which folds the mixer): its teacher-forced bias and its Jacobi consistency rounds (XPressDraftModel.forward's
recurrence: slot 0 forced to the anchor, each round fed the previous round's argmax) equal the harness's head
and XPressRefiner in float64.

Power: a transposed or non-causal mixer, g taken over other rows than the block's B, slot 0's predecessor taken as
the anchor instead of the token before it, or the seed's slots shifted by one each change the bias or the tokens
(the rollout case checks that the passes really change tokens, so a refiner that did nothing would fail too)."""
import pytest
import torch

from core.protocols import Proposal, RefineContext
from core.speculators_layout import split_tensors
from refiners.xpress import XPressRefiner, xpress_head_from_state
from tolerance import assert_close

spec = pytest.importorskip("speculators.models.xpress.model_definitions", reason="speculators (training extras)")

V, H, R, B = 96, 32, 16, 8


def heads(seed: int):
    torch.manual_seed(seed)
    ref = spec.XPressRefinerHead(verifier_vocab_size=V, draft_vocab_size=V, hidden_size=H, block_size=B, rank=R,
                                 mlp_ratio=2)
    with torch.no_grad():  # trained-looking scales: the bias moves the argmax, the mixer matters
        for name, p in ref.named_parameters():
            p.normal_(0.0, 0.3 if name == "mix_l" else 0.25)
    ref.double()  # float32 values in float64: the head's loader builds float32 modules first, exactly here
    tensors = {"refiner_head." + k: v for k, v in ref.state_dict().items()}
    kind, draft, state, _ = split_tensors({"speculators_model_type": "xpress"}, tensors, "test")
    assert kind == "xpress" and not draft
    return ref, xpress_head_from_state(state, dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1])
def test_teacher_forced_bias_equals_speculators_block_bias(seed):
    ref, head = heads(seed)
    g = torch.Generator().manual_seed(100 + seed)
    hidden = torch.randn(3, B, H, generator=g, dtype=torch.float64)
    prev = torch.randint(0, V, (3, B), generator=g)
    with torch.no_grad():
        want = ref.block_bias(prev, hidden_states=hidden)
        got = torch.stack([head(hidden[i], prev[i]) for i in range(3)])
    assert_close(got, want, magnitude=float(want.abs().max()))


@pytest.mark.parametrize("passes", [1, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_jacobi_rounds_equal_speculators_consistency_rounds(seed, passes):
    ref, head = heads(seed)
    g = torch.Generator().manual_seed(200 + seed)
    hidden = torch.randn(B, H, generator=g, dtype=torch.float64)
    with torch.no_grad():
        spread = ref.block_bias(torch.randint(0, V, (1, B), generator=g), hidden_states=hidden[None]).std()
    base = torch.randn(B, V, generator=g, dtype=torch.float64) * spread  # slot 0's row is never read out
    anchor, am1 = torch.randint(0, V, (2,), generator=g)
    # speculators' consistency rounds (XPressDraftModel.forward, fill-in layout), one block
    pred = base.argmax(-1)[None]
    with torch.no_grad():
        for _ in range(passes):
            pred[:, 0] = anchor
            prev = torch.cat([am1.view(1, 1), pred[:, :-1]], dim=1)
            refined = base[None] + ref.block_bias(prev, hidden_states=hidden[None])
            pred = refined.argmax(-1)
    seed_tokens = base[1:].argmax(-1)
    with torch.no_grad():
        out = XPressRefiner(head, passes).refine(Proposal(seed_tokens, base[1:], hidden),
                                                 RefineContext(anchor=anchor, prev_token=am1))
    assert not torch.equal(pred[0, 1:], seed_tokens), "the passes must change tokens for this check to have power"
    assert torch.equal(out.tokens, pred[0, 1:])
    assert_close(out.logits, refined[0, 1:], magnitude=float(refined.abs().max()))
