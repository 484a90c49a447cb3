"""Random-weights presets: the tiny one runs every method on the CPU; the big ones have the right shapes, built
on the meta device (no memory)."""
import pytest
import torch

from core.devices import Backend
from core.errors import UsageError
from harness.decode.loop import DecodeSettings, generate
from harness.protocol.presets import PRESETS, RANDOM_LABEL, build_random

META = Backend(torch.device("meta"), torch.bfloat16)


@pytest.fixture(scope="module")
def tiny():
    return build_random("tiny", Backend(torch.device("cpu"), torch.float32), block_size=8)


@pytest.mark.parametrize("method,K,topc", [("ar", 0, 0), ("drafter-only", 0, 0), ("xpress", 3, 0),
                                           ("xpress", 2, 16), ("markov", 0, 0)])
def test_tiny_preset_runs_every_method_with_scripted_acceptance(tiny, method, K, topc):
    drafter = None if method == "ar" else tiny.drafter
    s = DecodeSettings(33, 1024, (), scripted_accept=5)
    g = generate(tiny.target, list(range(10, 50)), s, tiny.backend, drafter=drafter,
                 refiner=tiny.refiner(method, K, topc))
    assert len(g.tokens) == 33 and g.stop_reason == "max_new_tokens"
    if method == "ar":
        assert g.spec_steps == 0 and g.ar_steps == 32
    else:
        assert g.accepted == [5] * len(g.accepted) and g.accept_lengths[:-1] == [6] * (len(g.accepted) - 1)


def test_tiny_weights_are_random_and_reproducible(tiny):
    again = build_random("tiny", tiny.backend, block_size=8)
    w = tiny.target.model.model.layers[0].mlp.up_proj.weight
    assert 0.015 < float(w.std()) < 0.025
    torch.testing.assert_close(w, again.target.model.model.layers[0].mlp.up_proj.weight)
    assert tiny.label == RANDOM_LABEL == "random weights / scripted acceptance"


def test_qwen3_8b_shapes_on_meta():
    m = build_random("qwen3-8b", META)
    t, d = m.target, m.drafter
    assert (t.n_layers, t.hidden_size, t.vocab_size, t.head_dim, t.n_kv_heads) == (36, 4096, 151936, 128, 8)
    assert t.config.num_attention_heads == 32 and t.config.intermediate_size == 12288
    assert t.lm_head.weight is not t.embed.weight
    assert round(m.target_weight_bytes() / 1e9, 2) == 16.38  # the 16.4 GB of DESIGN.md section 5
    assert t.taps == d.target_layer_ids == (1, 9, 17, 25, 33)
    assert d.mask_token_id == 151669 and d.block_size == 16 and len(d.model.layers) == 5
    assert d.model.fc.weight.shape == (4096, 5 * 4096)
    assert d.model.layers[0].mlp.gate_proj.weight.shape == (12288, 4096)
    assert m.xpress_head.rank == 256 and m.xpress_head.mlp.gate_proj.weight.shape == (512, 256)
    assert m.xpress_head.folded and m.xpress_head.vocab == 151936
    assert m.markov_head.variant == "vanilla" and m.markov_head.w2.weight.shape == (151936, 256)
    assert t.model.model.rotary_emb.config.rope_parameters["rope_theta"] == 1e6
    assert all(p.device.type == "meta" for p in t.model.parameters())


def test_smollm2_shapes_on_meta():
    m = build_random("smollm2-135m", META)
    t = m.target
    assert (t.n_layers, t.hidden_size, t.vocab_size, t.n_kv_heads) == (30, 576, 49152, 3)
    assert t.config.num_attention_heads == 9 and t.config.intermediate_size == 1536
    assert t.lm_head.weight is t.embed.weight  # tied
    assert len(m.drafter.model.layers) == 2 and m.drafter.block_size == 16
    assert t.model.model.rotary_emb.config.rope_parameters["rope_theta"] == 1e5


def test_unknown_preset_is_a_usage_error():
    with pytest.raises(UsageError, match="qwen3-8b"):
        build_random("gpt-5", META)
    assert set(PRESETS) >= {"qwen3-8b", "smollm2-135m", "tiny"}


def test_qwen3_8b_drafter_bytes_bound_the_spec_step():
    """The byte floor of results/perf/NOTES.md: the drafter's 5 layers (1.93 GB), the lm_head read again
    (1.245 GB) and the context write (fc 0.168 GB + k/v 0.084 GB) against the 15.14 GB an AR step reads."""
    m = build_random("qwen3-8b", META)
    drafter, ar = m.drafter_step_bytes(), m.target_weight_bytes(include_embedding=False)
    assert abs(drafter / 1e9 - 3.426) < 0.001 and abs(ar / 1e9 - 15.137) < 0.001
    assert 1.22 < (ar + drafter) / ar < 1.23
