"""models.NAME.anchor_bias (training/anchors.py): a drafter's training anchors drawn toward the tokens the target
was unsure of. The draw's law (exact at bias 1, a frequency at bias 0.5 with its power stated), the fallback to
speculators' own draw, u against a direct computation, the name restored, the config's refusals, and existing
fingerprints unchanged at bias 0. The whole pipeline with a bias: tests/test_training_online.py."""
import pytest
import torch
from torch import nn

from core.errors import UsageError
from training.anchors import AnchorBias, installed, target_unsure

core = pytest.importorskip("speculators.models.dflash.core", reason="speculators (training extras)")


def biased(bias, u):
    b = AnchorBias(bias)
    b.original = core.select_anchors
    b.unsure = u
    return b


def test_at_bias_one_only_unsure_positions_are_drawn():
    mask = torch.zeros(1, 40, dtype=torch.long)
    mask[0, 5:40] = 1  # valid: 5..35 (the last block of 4 is never an anchor)
    u = torch.zeros(40)
    hot = [6, 9, 17, 21, 30, 33]
    u[hot] = torch.tensor([0.9, 0.1, 0.5, 0.7, 0.3, 0.2])
    u[38] = 5.0  # past the last whole block: not drawable
    for seed in range(20):
        torch.manual_seed(seed)
        anchors, flags = biased(1.0, u).select(mask, 4, 4)
        assert flags.all() and anchors.tolist() == sorted(anchors.tolist()) and set(anchors.tolist()) <= set(hot)
        assert len(set(anchors.tolist())) == 4  # without replacement
    torch.manual_seed(0)
    anchors, flags = biased(1.0, u).select(mask, 64, 4)  # more anchors than positions: every valid one, once
    assert anchors[flags].tolist() == list(range(5, 36)) and not flags[31:].any()


def test_at_bias_half_the_unsure_share_is_the_mixture():
    """N = 100 drawable positions, u on 10 of them: one anchor lands there with probability 0.5 * 0.1 + 0.5 = 0.55.
    2,000 draws give a share within 0.055 of it (5 sigma, sigma 0.011); a bias ignored gives 0.10 and a bias taken
    as 1 gives 1.0, each over 40 sigma away."""
    mask = torch.ones(1, 104, dtype=torch.long)
    u = torch.zeros(104)
    u[torch.arange(0, 100, 10)] = 1.0
    torch.manual_seed(0)
    hits = 0
    for _ in range(2000):
        anchors, _ = biased(0.5, u).select(mask, 1, 4)
        hits += int(anchors[0]) % 10 == 0
    assert abs(hits / 2000 - 0.55) < 0.055


def test_without_a_steps_u_the_draw_is_speculators_own():
    from speculators.models.dflash.utils import select_anchors
    mask = torch.zeros(1, 64, dtype=torch.long)
    mask[0, 10:] = 1
    b = biased(0.7, torch.rand(64))
    torch.manual_seed(3)
    first = b.select(mask, 8, 4)  # uses the step's u, then forgets it
    torch.manual_seed(3)
    again = b.select(mask, 8, 4)
    torch.manual_seed(3)
    want = select_anchors(mask, 8, 4)
    assert all(torch.equal(x, y) for x, y in zip(again, want)) and b.steps == 1
    assert not torch.equal(first[0], want[0])  # the biased draw differed (u uniform-random, bias 0.7)
    module = nn.Linear(1, 1).eval()  # validation: the hook sets no u
    b(module, (), {"verifier_last_hidden_states": torch.zeros(1, 64, 4), "input_ids": torch.zeros(1, 64).long()})
    assert b.unsure is None


def test_u_is_one_minus_the_targets_largest_probability(monkeypatch):
    """u[i] = 1 - max_v P(v | before i): the target's uncertainty at i (on greedy text, 1 - P(token i)); exact near
    certainty, where 1 - exp(log p) rounds to 0 (a row of only such positions would make the draw index-ordered)."""
    import training.anchors as anchors
    monkeypatch.setattr(anchors, "CHUNK", 3)  # chunk edges inside the row
    torch.manual_seed(0)
    model = nn.Module()
    model.verifier_norm = nn.LayerNorm(8)
    model.verifier_lm_head = nn.Linear(8, 11, bias=False)
    h = torch.randn(1, 10, 8)
    ids = torch.randint(0, 11, (1, 10))
    u = target_unsure(model, h, ids)
    p = model.verifier_lm_head(model.verifier_norm(h[0])).softmax(-1)
    want = torch.cat([torch.zeros(1), 1 - p[:-1].max(-1).values]).detach()
    torch.testing.assert_close(u, want, atol=8 * torch.finfo(torch.float32).eps, rtol=0)
    with torch.no_grad():  # a near-certain target: u about 3 exp(-79), not 0
        model.verifier_lm_head.weight.mul_(0).add_(torch.eye(11, 8) * 30)
    u = target_unsure(model, torch.ones(1, 4, 8) * torch.tensor([1.0] + [0.0] * 7), torch.zeros(1, 4).long())
    assert (u[1:] > 0).all() and (u[1:] < 1e-6).all()


def test_installed_points_speculators_at_the_draw_and_restores_it():
    original = core.select_anchors
    b = AnchorBias(0.5)
    with pytest.raises(RuntimeError):
        with installed(b):
            assert core.select_anchors == b.select and b.original is original
            raise RuntimeError("a step failed")
    assert core.select_anchors is original
    with installed(None):
        assert core.select_anchors is original


@pytest.mark.parametrize("model, says", [
    ({"type": "xpress", "anchor_bias": 0.5, "init_from": "drafter", "freeze_backbone": True}, "only for a dflash"),
    ({"anchor_bias": 1.5}, "in [0, 1]"),
    ({"anchor_bias": True}, "in [0, 1]"),
])
def test_bad_anchor_bias_is_refused(tmp_path, model, says):
    from training.config import load_config
    from training_fixtures import tiny_models, write_config
    models = tiny_models(heads=False)
    common = {k: v for k, v in models["drafter"].items() if k != "type"}
    models["x" if model.get("type") else "drafter"] = {**models["drafter"], **common, **model}
    with pytest.raises(UsageError) as e:
        load_config(str(write_config(tmp_path, models)))
    assert "anchor_bias" in str(e.value) and says in str(e.value)


def test_a_bias_with_the_whole_forward_compiled_is_refused(tmp_path):
    from training.config import load_config
    from training_fixtures import tiny_models, write_config
    models = tiny_models(heads=False)
    models["drafter"]["anchor_bias"] = 0.5
    with pytest.raises(UsageError, match="not tested with train.compile=model"):
        load_config(str(write_config(tmp_path, models, train={"compile": "model"})))


def test_existing_fingerprints_are_unchanged_at_bias_zero():
    """The keys of the presets' models, computed before anchor_bias existed: runs trained then stay up to date."""
    from training.config import load_config, model_fingerprint
    cfg = load_config("smollm2-gpu")
    assert {n: model_fingerprint(cfg, n) for n in cfg["models"]} == {
        "drafter": "46f0ffa79611b94b", "xpress": "ee0c03764bbcb2ef", "markov_vanilla": "25a5f66ce61a157c",
        "markov_gated": "b3a5fdb0bd5e9f71"}
    cfg["models"]["drafter"]["anchor_bias"] = 0.5
    assert model_fingerprint(cfg, "drafter") != "46f0ffa79611b94b"
