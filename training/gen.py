"""Batched generation, returning each row's new token ids cut at its first stop token (kept when keep_stop).

Two engines: `generate_batch`, HF transformers `generate` (left padding; Magpie prompts, and the responses stage
with responses.engine=hf), and `generate_fast`, harness.decode.batched_gen.BatchedGenerator (the responses
stage's default: a static KV cache, continuous batching, CUDA graphs and bf16 on CUDA)."""
from __future__ import annotations

import weakref

import torch

from core.errors import UsageError

ENGINES = ("fast", "hf")
ATTENTIONS = ("auto", "sdpa", "triton")  # responses.attention: the fast engine's decode attention
_FAST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {rows: BatchedGenerator}


def stop_ids(model, tokenizer) -> list[int]:
    from harness.decode.accounting import STANDARD, model_stop_ids
    return list(model_stop_ids(model, tokenizer, STANDARD))


def fast_dtype(model) -> torch.dtype:
    """bf16 on CUDA (whatever the loaded weights are), the model's own dtype elsewhere."""
    return torch.bfloat16 if model.device.type == "cuda" else next(model.parameters()).dtype


def fast_generator(model, rows: int, attention: str = "auto"):
    """One BatchedGenerator per (model, rows, attention), kept while the model lives: its graphs and cache are
    reused. attention: responses.attention (auto: the Triton kernel on CUDA where it runs, SDPA elsewhere)."""
    from harness.decode.batched_gen import BatchedGenerator
    per_model = _FAST.setdefault(model, {})
    if (rows, attention) not in per_model:
        per_model.clear()  # one at a time: each holds a cache of its own
        per_model[rows, attention] = BatchedGenerator(model, rows, dtype=fast_dtype(model), attention=attention)
    return per_model[rows, attention]


def release_fast(model) -> None:
    """Drop the model's fast generators (their KV cache and graphs) once a stage is done with them."""
    _FAST.pop(model, None)


def generate_fast(model, prompts: list[list[int]], max_new_tokens: int, stops: list[int], sample: bool,
                  temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, keep_stop: bool = True,
                  rows: int = 256, attention: str = "auto") -> list[list[int]]:
    """generate_batch's answers from the fast engine, `rows` prompts decoding at a time."""
    gen = fast_generator(model, max(1, min(rows, len(prompts))), attention)
    return gen.generate(prompts, max_new_tokens, stops, sample=sample, temperature=temperature, top_p=top_p,
                        seed=seed, keep_stop=keep_stop)


def generate_batch(model, prompts: list[list[int]], max_new_tokens: int, stops: list[int], pad_id: int,
                   sample: bool, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                   keep_stop: bool = True) -> list[list[int]]:
    """HF generate (harness.decode.batched_gen.hf_generate): Magpie prompts, and responses with engine=hf."""
    from harness.decode.batched_gen import hf_generate
    return hf_generate(model, prompts, max_new_tokens, stops, pad_id, sample, temperature=temperature, top_p=top_p,
                       seed=seed, keep_stop=keep_stop)


def check_engine(cfg) -> None:
    """Before any model loads: a known engine, and a target family the fast engine runs."""
    engine, attention = cfg["responses"]["engine"], cfg["responses"]["attention"]
    if engine not in ENGINES:
        raise UsageError(f"config responses.engine {engine!r}: use one of {', '.join(ENGINES)}")
    if attention not in ATTENTIONS:
        raise UsageError(f"config responses.attention {attention!r}: use one of {', '.join(ATTENTIONS)}")
    if attention != "auto" and engine != "fast":
        raise UsageError(f"config responses.attention {attention} is the fast engine's; responses.engine is "
                         f"{engine}: leave responses.attention at auto, or set responses.engine=fast")
    if attention == "triton":  # the package and the device the target will load on
        from harness.decode.batched import check_triton
        from training.target import target_device
        check_triton(target_device(cfg), who="config responses.attention triton",
                     instead="set responses.attention=auto or sdpa")
    if engine == "fast":
        from harness.decode.target import PLAIN_FAMILIES
        from training.target import target_config
        family = getattr(target_config(cfg["target"]), "model_type", None)
        if family not in PLAIN_FAMILIES:
            raise UsageError(f"config responses.engine fast runs {', '.join(PLAIN_FAMILIES)} targets, not "
                             f"{family!r}; set responses.engine=hf")
