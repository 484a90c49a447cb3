"""Tiny random Gemma 4 text models (sliding and full layers, k = v on full layers, experts, soft-cap, embedding
scale) and their dFlash drafters with sliding and full layers, for the tests."""
from __future__ import annotations

import torch

from drafters.dflash import DFlashConfig, DFlashDrafter, random_dflash
from harness.decode.loading import make_target
from tiny import CPU32, MASK_ID, VOCAB

KINDS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
         "full_attention"]


def gemma_config(window: int = 6, cap: float | None = 3.0, moe: bool = True, vocab: int = VOCAB):
    from transformers.models.gemma4 import Gemma4TextConfig
    return Gemma4TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=len(KINDS), layer_types=KINDS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=window, final_logit_softcapping=cap, hidden_size_per_layer_input=0,
        enable_moe_block=moe, num_experts=4 if moe else None, top_k_experts=2 if moe else None,
        moe_intermediate_size=32 if moe else None, max_position_embeddings=512, tie_word_embeddings=True,
        eos_token_id=[3, 5], bos_token_id=1, pad_token_id=0, initializer_range=0.3)


def gemma_hf_model(seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(gemma_config(**kw), attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and scalars, so that a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("scale"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
        for layer in model.model.layers:
            layer.layer_scalar.fill_(0.9)
    return model.eval()


def gemma_target(seed: int = 0, taps=(), capacity: int = 64, backend=CPU32, **kw):
    return make_target(gemma_hf_model(seed, **kw).to(backend.device, backend.dtype), backend, capacity=capacity,
                       taps=tuple(taps))


def gemma_drafter(target, block: int = 4, window: int = 3, seed: int = 1, taps=(1, 2, 4),
                  types=("sliding_attention",) * 2 + ("full_attention",)) -> DFlashDrafter:
    """A dFlash drafter at the target's width with sliding (causal, windowed) and full (non-causal) layers."""
    t = target.config
    cfg = DFlashConfig(hidden_size=t.hidden_size, intermediate_size=96, num_hidden_layers=len(types),
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                       vocab_size=t.vocab_size, block_size=block, num_target_layers=t.num_hidden_layers,
                       mask_token_id=MASK_ID, target_layer_ids=tuple(taps), layer_types=tuple(types),
                       rope_theta=1e6, sliding_window=window)
    target.set_taps(cfg.target_layer_ids)
    model = random_dflash(cfg, seed=seed)
    return DFlashDrafter(model, target.embed, target.lm_head, CPU32)
