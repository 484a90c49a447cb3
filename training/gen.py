"""Batched generation with HF transformers `generate` (left padding), returning each row's new token ids cut at
its first stop token. Used for Magpie prompts and for the target's own responses."""
from __future__ import annotations

import torch


def stop_ids(model, tokenizer) -> list[int]:
    from harness.decode.accounting import STANDARD, model_stop_ids
    return list(model_stop_ids(model, tokenizer, STANDARD))


@torch.no_grad()
def generate_batch(model, prompts: list[list[int]], max_new_tokens: int, stops: list[int], pad_id: int,
                   sample: bool, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                   keep_stop: bool = True) -> list[list[int]]:
    device = model.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kwargs = dict(do_sample=sample, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                  eos_token_id=stops or None)
    if sample:
        torch.manual_seed(seed)
        kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
    new = out[:, width:].tolist()
    result = []
    for row in new:
        cut = next((j for j, t in enumerate(row) if t in stops), None)
        if cut is not None:
            row = row[:cut + 1] if keep_stop else row[:cut]
        result.append(row)
    return result
