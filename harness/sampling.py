"""Sampling primitives that need no host sync (and so can later live inside a CUDA graph)."""
from __future__ import annotations

import torch

GREEDY_BELOW = 1e-5  # temperatures under this are greedy, as in the reference


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_BELOW


def sample_rows(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `logits` [..., V]: argmax when greedy, else a draw from softmax(logits / T).

    The draw is argmax(p / E) with E ~ Exponential(1) i.i.d., an exact categorical sample that, unlike
    torch.multinomial, never waits on the device.
    """
    if is_greedy(temperature):
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    e = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / e).argmax(-1)
