"""A tiny GGUF file written with gguf-py: what SmolLM2-135M-Instruct's GGUF holds, at a size the tests can convert in
about a second (the real 98 MB file takes ~45 s on the 2-core machine).

Like the real file: architecture llama, weights in Q4_1 blocks (norms in float32), no output.weight (the output is
tied to the embedding), a byte-level BPE tokenizer ("gpt2") with merges, special tokens <|endoftext|> (id 0),
<|im_start|> (1, bos) and <|im_end|> (2, eos and pad), and a ChatML template.
"""
from __future__ import annotations

from pathlib import Path

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("Ġ t", "Ġ a", "t h", "Ġt h", "e r", "i n", "Ġ s", "o n")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
EOS = 2


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A 2-layer llama (hidden 64, 4 heads, 2 KV heads) with the tokenizer above, written to `path`."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    byte_chars = bytes_to_unicode()
    tokens = list(SPECIAL) + [byte_chars[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES]
    vocab, hidden, inter, layers, heads, kv_heads = len(tokens), 64, 128, 2, 4, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIAL) + [gguf.TokenType.NORMAL] * (vocab - len(SPECIAL)))
    w.add_token_merges(list(MERGES))
    w.add_bos_token_id(1)
    w.add_eos_token_id(EOS)
    w.add_pad_token_id(EOS)
    w.add_unk_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)

    def tensor(name, shape, quantized=True):
        a = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if quantized:  # Q4_1 blocks of 32 along the last axis, as the real file's matrices
            w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q4_1),
                         raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        else:
            w.add_tensor(name, a)
    kv = kv_heads * hidden // heads
    tensor("token_embd.weight", (vocab, hidden))
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", (hidden,), False)
        tensor(f"blk.{i}.ffn_norm.weight", (hidden,), False)
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (inter, hidden)),
                            ("ffn_up", (inter, hidden)), ("ffn_down", (hidden, inter))):
            tensor(f"blk.{i}.{name}.weight", shape)
    tensor("output_norm.weight", (hidden,), False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
