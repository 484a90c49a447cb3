"""Sliding-window attention masks over a static cache (keys addressed by absolute position)."""
from __future__ import annotations

import torch


def window_mask(positions: torch.Tensor, length: int, window: int) -> torch.Tensor:
    """[T, length] bool: key j visible to query i iff position_i - window < j <= position_i (causal, and only the
    `window` most recent positions, HF's sliding-window rule). Stale slots beyond position_i are never visible."""
    keys = torch.arange(length, device=positions.device).unsqueeze(0)
    q = positions.unsqueeze(1)
    return (keys <= q) & (keys > q - window)
