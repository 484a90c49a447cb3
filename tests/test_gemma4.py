"""Gemma 4 text targets on the static cache, their text-backbone override, and dFlash drafters with sliding
(causal, windowed) and full (non-causal) layers: exactness against HF, greedy losslessness, window locality."""
import dataclasses

import pytest
import torch

from drafters.dflash import DFlashConfig
from gemma_tiny import gemma_drafter, gemma_hf_model, gemma_target
from harness.decode.loop import DecodeSettings, generate
from refiners.xpress import XPressRefiner, random_xpress_head
from tiny import CPU32, VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, 100, (int(torch.randint(5, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_target_matches_hf_with_scale_softcap_experts_and_windows():
    model = gemma_hf_model(cap=3.0)
    t = gemma_target(cap=3.0, taps=(1, 2, 5))
    ids = torch.randint(8, 100, (20,), generator=torch.Generator().manual_seed(1))  # 20 > window 6
    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True)
    logits, feats = t.forward(ids, torch.arange(20), 20, True)
    torch.testing.assert_close(logits, out.logits[0], rtol=0, atol=1e-5)
    hs = out.hidden_states
    torch.testing.assert_close(feats, torch.cat((hs[2][0], hs[3][0], hs[6][0]), -1), rtol=0, atol=1e-5)
    assert float(out.logits.abs().max()) <= 3.0  # the soft-cap is applied, inside the target
    t.reset()
    first, _ = t.prefill(ids[:9], False)
    block, _ = t.verify(ids[9:20], 20, False)
    torch.testing.assert_close(block, out.logits[0, 9:20], rtol=0, atol=1e-4)  # windows across cached positions
    torch.testing.assert_close(first, out.logits[0, 8], rtol=0, atol=1e-4)


def test_drafter_shares_the_raw_embedding_and_head():
    t = gemma_target()
    ids = torch.tensor([9, 40, 127])
    table = t.model.model.embed_tokens.weight
    assert torch.equal(t.embed(ids), table[ids])  # raw rows: the sqrt(hidden) factor stays in the target
    assert torch.equal(t.model.model.embed_tokens(ids), table[ids] * 64 ** 0.5)
    assert t.lm_head.weight is table  # tied, no soft-cap on the shared head
    d = gemma_drafter(t)
    assert d.embed is t.embed and d.lm_head is t.lm_head


@pytest.mark.parametrize("method", ["drafter-only", "xpress"])
def test_greedy_is_lossless(method):
    t = gemma_target(cap=10.0, capacity=128)
    d = gemma_drafter(t, block=4)
    head = random_xpress_head(VOCAB, 64, 16, 4, seed=7, std=0.3)
    s = DecodeSettings(max_new_tokens=16, max_model_len=512, stop_ids=(3, 5))
    for pr in prompts(4):
        ref = generate(t, pr, s, CPU32).tokens
        for k, c in ((0, 0),) if method == "drafter-only" else ((1, 0), (3, 8)):
            out = generate(t, pr, s, CPU32, drafter=d, refiner=XPressRefiner(head, k, topc=c) if k else None)
            assert out.tokens == ref, (method, k, c, pr)


def hidden_of_row(drafter, ctx_feats, anchor_pos, rows):
    """The drafter's normed hidden rows for one block after writing `ctx_feats` as context."""
    kv = drafter.kv
    n = ctx_feats.shape[0]
    drafter.model.write_context(ctx_feats, torch.arange(n), kv)
    x = drafter.embed(torch.tensor([9] + [drafter.mask_token_id] * (drafter.block_size - 1)))
    positions = anchor_pos + torch.arange(drafter.block_size)
    end = anchor_pos + drafter.block_size
    return drafter.model.block(x, positions, kv, torch.tensor(end), end)


def test_sliding_layers_attend_only_within_their_window():
    """Every layer sliding (window 3): changing context older than the window cannot move any block row, and a
    later block row cannot move an earlier one; with full attention, both do."""
    t = gemma_target()
    sliding = ("sliding_attention",) * 3
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(12, 3 * 64, generator=g)
    far = feats.clone()
    far[:8] = torch.randn(8, 3 * 64, generator=g)  # positions 0..7; block rows at 12.. see 10.. at most
    for types, local in ((sliding, True), (("full_attention",) * 3, False)):
        d = gemma_drafter(t, block=4, window=3, types=types)
        a, b = hidden_of_row(d, feats, 12, 4), hidden_of_row(d, far, 12, 4)
        assert torch.equal(a, b) is local, types
        # causality inside the block: a different token at the last slot leaves the earlier rows alone
        x = d.embed(torch.tensor([9, 4, 4, 4]))
        y = x.clone()
        y[3] = d.embed(torch.tensor([77]))[0]
        p = 12 + torch.arange(4)
        ra, rb = d.model.block(x, p, d.kv, torch.tensor(16), 16), d.model.block(y, p, d.kv, torch.tensor(16), 16)
        assert torch.equal(ra[:3], rb[:3]) is local, types


def test_layer_types_config_round_trip_and_refusals():
    t = gemma_target()
    cfg = gemma_drafter(t, types=("sliding_attention",) * 4 + ("full_attention",), taps=(1, 2, 3, 4, 5)).model.config
    d = cfg.to_dict()
    assert d["layer_types"] == ["sliding_attention"] * 4 + ["full_attention"] and d["sliding_window"] == 3
    assert DFlashConfig.from_dict(d) == cfg
    with pytest.raises(Exception, match="sliding_window"):
        DFlashConfig.from_dict({**d, "sliding_window": None})
    with pytest.raises(Exception, match="chunked_attention"):
        DFlashConfig.from_dict({**d, "layer_types": ["chunked_attention"] * 5})
    assert dataclasses.replace(cfg, layer_types=("full_attention",) * 5).sliding_window == 3


def test_text_backbone_of_a_multimodal_checkpoint(tmp_path):
    """A Gemma4ForConditionalGeneration directory loads text-only through --hf-overrides, with the same logits."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from harness.decode.hf_overrides import parse_overrides
    from harness.decode.loading import load_target, load_target_config
    from core.errors import UsageError
    from tiny import tiny_tokenizer
    torch.manual_seed(0)
    text = gemma_hf_model().config
    full = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text.to_dict())).eval()
    full.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(UsageError, match="hf-overrides '\\{\"architectures\": \\[\"Gemma4ForCausalLM\"\\]\\}'"):
        load_target_config(str(tmp_path))
    ov = parse_overrides('{"architectures": ["Gemma4ForCausalLM"], "final_logit_softcapping": 5.0}')
    assert load_target_config(str(tmp_path), ov).model_type == "gemma4_text"
    t, _ = load_target(str(tmp_path), CPU32, capacity=32, overrides=ov)
    ids = torch.randint(8, 100, (10,))
    with torch.no_grad():
        ref = torch.tanh(full.lm_head(full.model.language_model(ids[None]).last_hidden_state) / 5.0) * 5.0
    torch.testing.assert_close(t.forward(ids, torch.arange(10), 10, False)[0], ref[0], rtol=0, atol=1e-5)
    with pytest.raises(UsageError, match="not valid JSON"):
        parse_overrides("{architectures")


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_fp32_logits_are_honoured_by_both_targets(family):
    """Guards --fp32-logits on Gemma 4, whose forward never read the float32 head that use_fp32_logits set (the
    run was labelled fp32 logits on bf16 ones): in bf16, both targets' logits become float32, off the bf16 grid,
    within bf16 rounding of the bf16 logits, and Gemma's stay soft-capped."""
    from core.devices import Backend
    from tiny import tiny_target
    bf16 = Backend(torch.device("cpu"), torch.bfloat16)
    t = gemma_target(cap=3.0, backend=bf16) if family == "gemma4" else tiny_target("qwen3", backend=bf16)
    ids = torch.randint(8, 100, (12,), generator=torch.Generator().manual_seed(2))
    low, _ = t.forward(ids, torch.arange(12), 12, False)
    t.use_fp32_logits()
    t.reset()
    high, _ = t.forward(ids, torch.arange(12), 12, False)
    assert low.dtype == torch.bfloat16 and high.dtype == torch.float32
    assert not torch.equal(high, high.bfloat16().float())  # computed in float32, not a widened bf16 result
    scale = float(low.float().abs().max())
    torch.testing.assert_close(high, low.float(), rtol=0, atol=4 * 2 ** -8 * scale)
    if family == "gemma4":
        assert float(high.abs().max()) <= 3.0
