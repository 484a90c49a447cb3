"""Per-layer attention of a dFlash drafter block, by `layer_types` (the vLLM rule for z-lab Gemma drafters):

    full_attention     non-causal: every block row sees the whole committed context and the whole block;
    sliding_attention  causal and windowed: block row i (position p + i) sees keys at positions
                       p + i - window < j <= p + i, the earlier block rows included, later ones not.
"""
from __future__ import annotations

import torch

from harness.decode.cache import prefix_mask
from harness.decode.windows import window_mask


def block_masks(config, positions: torch.Tensor, limit: torch.Tensor, length: int) -> dict[str, torch.Tensor]:
    """{layer kind: [B, length] bool mask} for the kinds `config.layer_types` uses."""
    masks = {}
    for kind in set(config.layer_types):
        if kind == "sliding_attention":
            masks[kind] = window_mask(positions, length, config.sliding_window)
        else:
            masks[kind] = prefix_mask(limit, positions.shape[0], length)
    return masks
