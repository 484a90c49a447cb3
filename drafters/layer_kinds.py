"""Per-layer attention of a dFlash drafter block, by `layer_types` (the vLLM rule for z-lab Gemma drafters):

    full_attention     non-causal: every block row sees the whole committed context and the whole block;
    sliding_attention  causal and windowed: block row i (position p + i) sees keys at positions
                       p + i - window < j <= p + i, the earlier block rows included, later ones not.
"""
from __future__ import annotations

import torch

from core.ops import Span


def block_spans(config, positions: torch.Tensor, limit: torch.Tensor, length: int) -> dict[str, Span]:
    """{layer kind: the slots its attention sees} for the kinds `config.layer_types` uses."""
    spans = {}
    for kind in set(config.layer_types):
        if kind == "sliding_attention":
            spans[kind] = Span(positions, length, window=config.sliding_window)
        else:
            spans[kind] = Span(positions, length, limit=limit)
    return spans
