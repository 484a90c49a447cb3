"""The Markov head's gated and rnn variants load from speculators' DSpark layout (config `markov_head_type`,
tensors `markov_head.{markov_w1, markov_w2, gate_proj, joint_proj}`), and compute what those tensors mean."""
import argparse

import pytest
import torch

from core.errors import UsageError
from refiner_fixtures import H, R, V, base_dir, drafter, save_pt, write_serving  # noqa: F401
from refiners.formats import load_refiner_checkpoint, validate_against
from refiners.markov import markov_head_from_state
from tolerance import assert_close


def dspark_head(variant, seed=0, hidden=H):
    g = torch.Generator().manual_seed(seed)
    head = {"markov_w1.weight": torch.randn(V, R, generator=g), "markov_w2.weight": torch.randn(V, R, generator=g)}
    if variant == "gated":
        head.update({"gate_proj.weight": torch.randn(R, hidden + R, generator=g), "gate_proj.bias": torch.randn(R)})
    if variant == "rnn":
        head.update({"joint_proj.weight": torch.randn(3 * R, 2 * R + hidden, generator=g) * 0.3,
                     "joint_proj.bias": torch.randn(3 * R, generator=g)})
    return head


def write_dspark(d, drafter, variant, head=None):
    """A DSpark-style directory: drafter tensors, a confidence head (unused here) and the Markov head."""
    d = write_serving(d, drafter, head or dspark_head(variant), prefix="markov_head.",
                      architectures=["DSparkSpeculator"], markov_rank=R, markov_head_type=variant)
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(d / "model.safetensors"))
    tensors.update({"confidence_head.proj.weight": torch.zeros(1, H), "confidence_head.proj.bias": torch.zeros(1)})
    save_file(tensors, str(d / "model.safetensors"))
    return d, None


def by_hand(variant, t, prev, h, state):
    """DSpark's step for one slot from the raw tensors: (bias [V], next state)."""
    e = t["markov_w1.weight"][prev]
    if variant == "vanilla":
        return t["markov_w2.weight"] @ e, state
    if variant == "gated":
        gate = torch.sigmoid(t["gate_proj.weight"] @ torch.cat((h, e)) + t["gate_proj.bias"])
        return t["markov_w2.weight"] @ (gate * e), state
    g, c, o = (t["joint_proj.weight"] @ torch.cat((state, e, h)) + t["joint_proj.bias"]).chunk(3)
    state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
    return t["markov_w2.weight"] @ torch.tanh(o), state


@pytest.mark.parametrize("variant", ["vanilla", "gated", "rnn"])
def test_dspark_variants_load_and_match_their_tensors(tmp_path, drafter, variant):
    raw = dspark_head(variant)
    d, _ = write_dspark(tmp_path / variant, drafter, variant, raw)
    ck = load_refiner_checkpoint(d, "markov")
    assert ck.variant == variant and ck.rank == R
    validate_against(ck, V, H, None, drafter[0].expected_shapes())
    head = markov_head_from_state(ck.head_state, ck.variant)
    g = torch.Generator().manual_seed(5)
    hs = torch.randn(4, H, generator=g)
    state, state_ref = head.initial_state(hs), torch.zeros(R)
    with torch.no_grad():
        for k, prev in enumerate((3, 17, 99, 42)):
            bias, state = head.step(torch.tensor(prev), hs[k], state)
            want, state_ref = by_hand(variant, raw, prev, hs[k], state_ref)
            assert_close(bias, want, steps=3)


def test_dspark_refusals(tmp_path, drafter):
    with pytest.raises(UsageError, match="variant 'gated' is not supported"):  # the co-training .pt: vanilla only
        load_refiner_checkpoint(save_pt(tmp_path / "g.pt", drafter, "markov",
                                        args=argparse.Namespace(markov_rank=R, markov_head_type="gated")), "markov")
    d, _ = write_dspark(tmp_path / "odd", drafter, "vanilla", {**dspark_head("vanilla"), "rnn_J.weight": torch.zeros(2)})
    with pytest.raises(UsageError, match="rnn_J.weight.*DSpark's Markov head"):
        load_refiner_checkpoint(d, "markov")
    d, _ = write_dspark(tmp_path / "bare", drafter, "rnn", dspark_head("vanilla"))
    with pytest.raises(UsageError, match="missing key.*cell"):
        load_refiner_checkpoint(d, "markov")
    d, _ = write_dspark(tmp_path / "bogus", drafter, "lstm", dspark_head("vanilla"))
    with pytest.raises(UsageError, match="markov_head_type 'lstm'"):
        load_refiner_checkpoint(d, "markov")
    d, _ = write_dspark(tmp_path / "wide", drafter, "gated", dspark_head("gated", hidden=2 * H))
    with pytest.raises(UsageError, match="gated layer reads hidden size 128"):
        validate_against(load_refiner_checkpoint(d, "markov"), V, H, None)
