"""Rotary-embedding frequencies for the drafter (the target uses its own HF rotary module).

A drafter shares the target's positional scheme, so its config carries the same rope fields, either in the older
form (`rope_theta` + `rope_scaling`) or the transformers-5 form (`rope_parameters`).
"""
from __future__ import annotations

import math

import torch

from core.errors import UsageError

SUPPORTED = ("default", "linear", "llama3")


def rope_settings(cfg: dict) -> tuple[float, dict]:
    """(theta, scaling dict with a 'rope_type') from either config style."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    merged = {**scaling, **{k: v for k, v in params.items() if k != "rope_theta"}}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in SUPPORTED:
        raise UsageError(f"drafter rope_type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}")
    merged["rope_type"] = kind
    return float(theta), merged


def inv_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth blend in between.
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        original = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = ((original / wavelen) - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > original / low, inv / factor, torch.where(wavelen < original / high, inv, blended))
    return inv.float()


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, head_dim] tables for absolute positions, in the half-split layout of `core.cache.rotate`."""
    angles = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
