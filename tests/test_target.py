"""The harness's own forward over the static cache agrees with HF's forward, logits and tapped features."""
import pytest
import torch

from harness.decode.loop import DecodeSettings, generate
from tiny import CPU32, tiny_target
from tolerance import assert_close


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_prefill_and_verify_match_hf(family):
    t = tiny_target(family, taps=(1, 3, 5))
    prompt = torch.tensor([9, 14, 33, 60, 21, 70, 11, 12, 40, 41])
    block = torch.tensor([50, 51, 52, 53])
    full = torch.cat((prompt, block))
    with torch.no_grad():
        ref = t.model(full.unsqueeze(0), output_hidden_states=True)
    logits, feats = t.prefill(prompt, want_features=True)
    assert_close(logits, ref.logits[0, len(prompt) - 1], steps=t.n_layers)
    want = torch.cat([ref.hidden_states[i + 1][0, : len(prompt)] for i in (1, 3, 5)], dim=-1)
    # Layer 5 is the last one: HF reports it after the final norm, and so do we (drafters were trained on it).
    assert_close(feats, want, steps=t.n_layers)
    vlogits, vfeats = t.verify(block, len(full), want_features=True)
    assert_close(vlogits, ref.logits[0, len(prompt):], steps=t.n_layers)
    want_v = torch.cat([ref.hidden_states[i + 1][0, len(prompt):] for i in (1, 3, 5)], dim=-1)
    assert_close(vfeats, want_v, steps=t.n_layers)


def test_eager_attention_matches_sdpa():
    t = tiny_target("qwen3")
    prompt = torch.tensor([9, 14, 33, 60, 21, 70, 11])
    a, _ = t.prefill(prompt, want_features=False)
    t.attn_impl = "eager"
    b, _ = t.prefill(prompt, want_features=False)
    assert_close(a, b, steps=t.n_layers)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_ar_loop_matches_hf_generate(family):
    t = tiny_target(family)
    settings = DecodeSettings(max_new_tokens=20, max_model_len=512, stop_ids=())
    for prompt in ([9, 14, 33], [40, 41, 42, 43, 44, 45, 46, 47]):
        ours = generate(t, prompt, settings, CPU32).tokens
        with torch.no_grad():
            ref = t.model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)
        assert ours == ref[0, len(prompt):].tolist()


def test_unsupported_family_is_refused():
    from transformers import GPT2Config
    from core.errors import UsageError
    from harness.decode.loading import check_family
    with pytest.raises(UsageError, match="not supported"):
        check_family(GPT2Config())


def test_qwen2_with_biases_and_fused_projections_match_hf():
    from transformers import AutoModelForCausalLM, Qwen2Config
    from harness.decode.target import Target
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, initializer_range=0.3)
    for family_model in (AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval(),
                         tiny_target("qwen3").model):
        t = Target(family_model, CPU32, capacity=32)
        fused = t.fuse_projections()
        assert fused == (family_model.config.model_type == "qwen3")  # q/k/v biases keep the separate path
        prompt = torch.tensor([9, 14, 33, 60, 21, 70, 11])
        with torch.no_grad():
            ref = family_model(prompt.unsqueeze(0)).logits[0, -1]
        logits, _ = t.prefill(prompt, want_features=False)
        assert_close(logits, ref, steps=t.n_layers)


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "relu"])
def test_fused_layers_with_another_activation_match_hf(act):
    """The MLP's activation reaches the ops by its config name: a fused layer of a non-silu target applies that
    activation (transformers' ACT2FN, as the HF module does), not silu."""
    t = tiny_target("llama", hidden_act=act)
    assert t.fuse_projections()
    prompt = torch.tensor([9, 14, 33, 60, 21, 70, 11])
    with torch.no_grad():
        ref = t.model(prompt.unsqueeze(0)).logits[0, -1]
    logits, _ = t.prefill(prompt, want_features=False)
    assert_close(logits, ref, steps=t.n_layers)


def test_the_torch_ops_apply_an_activation_by_its_config_name():
    from transformers.activations import ACT2FN
    from core.ops import TorchOps
    from core.errors import UsageError
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 16, generator=g), torch.randn(5, 8, generator=g)
    gate, up = x.chunk(2, dim=-1)
    for name in ("silu", "swish", "gelu_pytorch_tanh", "relu"):
        want = torch.nn.functional.linear(ACT2FN[name](gate) * up, w)
        assert torch.equal(TorchOps().linear(x, w, act=name), want), name
    with pytest.raises(UsageError, match="'no_such_act' is not one transformers knows"):
        TorchOps().linear(x, w, act="no_such_act")


def test_a_trained_activation_keeps_its_weights():
    """prelu carries a trained weight that a name cannot: such a layer is not fused, so HF's module (with the
    checkpoint's weight) runs it, and asking the ops for it by name is refused."""
    from core.ops import TorchOps
    from core.errors import UsageError
    t = tiny_target("llama", hidden_act="prelu")
    with torch.no_grad():
        for layer in t.layers:
            layer.mlp.act_fn.weight.fill_(-0.7)  # not the default 0.25: a fresh ACT2FN instance would differ
    assert not t.fuse_projections()
    prompt = torch.tensor([9, 14, 33, 60, 21, 70, 11])
    with torch.no_grad():
        ref = t.model(prompt.unsqueeze(0)).logits[0, -1]
    logits, _ = t.prefill(prompt, want_features=False)
    assert_close(logits, ref, steps=t.n_layers)
    with pytest.raises(UsageError, match="'prelu' has trained parameters"):
        TorchOps().linear(torch.ones(1, 8), torch.ones(2, 4), act="prelu")
