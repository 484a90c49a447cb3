"""Tiny random models built from configs, shared by the tests (no downloads)."""
from __future__ import annotations

import torch

from drafters.dflash import DFlashDrafter, config_for_target, random_dflash
from core.devices import Backend
from harness.decode.target import Target

CPU32 = Backend(torch.device("cpu"), torch.float32)
VOCAB = 128
MASK_ID = VOCAB - 1  # never produced as text by the tests' tokenizer, like Qwen3's 151669


def tiny_config(family: str = "qwen3", vocab: int = VOCAB, layers: int = 6, max_pos: int = 512, **extra):
    """extra: other config fields (hidden_act=...), over the defaults below."""
    from transformers import LlamaConfig, Qwen3Config
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                  tie_word_embeddings=False, eos_token_id=[3, 5], bos_token_id=1, pad_token_id=0,
                  initializer_range=0.3)  # wide init: random models then babble instead of looping on one token
    common.update(extra)
    if family == "qwen3":
        return Qwen3Config(head_dim=16, rms_norm_eps=1e-6, **common)
    if family == "llama":
        return LlamaConfig(rms_norm_eps=1e-5, **common)
    raise ValueError(family)


def tiny_hf_model(family: str = "qwen3", seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = tiny_config(family, **kw)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()


def tiny_target(family: str = "qwen3", seed: int = 0, taps=(), capacity: int = 64, backend=CPU32, **kw) -> Target:
    model = tiny_hf_model(family, seed, **kw).to(backend.device, backend.dtype)
    return Target(model, backend, capacity=capacity, taps=tuple(taps))


def tiny_drafter(target: Target, block: int = 4, layers: int = 2, seed: int = 1, backend=CPU32,
                 target_layer_ids=None) -> DFlashDrafter:
    """target_layer_ids: the taps (default: the z-lab rule, which needs >= 4 target layers for 2 drafter layers)."""
    cfg = config_for_target(target.config, layers, block, MASK_ID, target_layer_ids=target_layer_ids)
    target.set_taps(cfg.target_layer_ids)
    model = random_dflash(cfg, seed=seed).to(backend.device, backend.dtype)
    return DFlashDrafter(model, target.embed, target.lm_head, backend)


SPECIALS = ["<pad>", "<s>", "<unk>", "<eos>", "<|user|>", "<eot>", "<|assistant|>", "<sep>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eot>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_tokenizer():
    """Character-level tokenizer over printable ASCII (ids 8..103), specials 0..7; ids >= 104 never appear as text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for c in [chr(x) for x in range(32, 127)] + ["\n"]:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>", additional_special_tokens=SPECIALS[4:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_checkpoint(directory, family: str = "qwen3", seed: int = 0, **kw) -> None:
    """An HF model directory (weights + tokenizer) the CLI can load like any hub checkpoint."""
    model = tiny_hf_model(family, seed, **kw)
    model.generation_config.eos_token_id = list(model.config.eos_token_id)
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)


XPRESS_ARGS = dict(markov_rank=8, mlp_ratio=2, no_residual=True, input_mode="concat", no_sublayer_norm=True,
                   no_mix_out=True)


def write_run_fixture(root, rows: list[dict], xpress_std: float = 0.3, markov_std: float = 0.3):
    """Everything a CLI run needs on disk: target/ (2 layers), drafter/ (block 4, taps [0, 1]), xpress.pt and markov.pt (random heads with
    their own co-trained drafter weights), and data/mini.jsonl holding `rows`."""
    import argparse
    import json

    from drafters.dflash import random_dflash, save_dflash
    from refiners.markov import random_markov_head
    from refiners.xpress import random_xpress_head
    save_tiny_checkpoint(root / "target", layers=2)  # 2 layers: each run decodes hundreds of steps
    base = tiny_drafter(tiny_target("qwen3", layers=2), block=4, target_layer_ids=[0, 1])
    save_dflash(base.model, root / "drafter")
    cotrained = random_dflash(base.model.config, seed=11).state_dict()
    head = random_xpress_head(VOCAB, 64, 8, 4, seed=2, std=xpress_std)
    torch.save({"draft_state_dict": cotrained, "refiner_state_dict": head.state_dict(), "global_step": 7,
                "args": argparse.Namespace(**XPRESS_ARGS)}, root / "xpress.pt")
    mk = random_markov_head("vanilla", VOCAB, 64, 8, seed=3, std=markov_std)
    torch.save({"draft_state_dict": cotrained, "refiner_state_dict": mk.state_dict(), "global_step": 9,
                "args": argparse.Namespace(markov_rank=8)}, root / "markov.pt")
    (root / "data").mkdir()
    (root / "data" / "mini.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root
