"""Static KV storage shared by the target and the drafter.

One preallocated tensor pair per model; a write puts K/V at explicit absolute positions, a read takes the prefix
that the caller's mask allows. Rollback is the owner moving its position: slots past it are stale, masked out by
the attention mask, and overwritten by the next write at those positions. Nothing is ever cropped.
"""
from __future__ import annotations

import torch


class StaticKV:
    """k, v [layers, rows, n_kv, capacity, head_dim]: one row per request (rows > 1: harness.decode.batch_target,
    each request's own region, written by `write_rows`; one row elsewhere)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device, rows: int = 1):
        self.n_layers, self.n_kv_heads, self.head_dim, self.rows = n_layers, n_kv_heads, head_dim, rows
        self.dtype, self.device = dtype, device
        self.capacity = 0
        self.k = self.v = torch.empty(0)
        # split attention's arrival counters, one row per layer (core.kernels.attention), one per K/V head of
        # each request row: this cache's own, so that no other cache or stream shares them; 0 between
        # launches, never reallocated
        self.counters = torch.zeros((n_layers, max(n_kv_heads, 1) * rows), dtype=torch.int32, device=device)
        self.ensure(capacity)

    def ensure(self, capacity: int) -> None:
        """Grow (never shrink) to hold `capacity` positions. Done between generations, never inside a step."""
        if capacity <= self.capacity:
            return
        shape = (self.n_layers, self.rows, self.n_kv_heads, capacity, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.capacity:
            k[:, :, :, : self.capacity] = self.k
            v[:, :, :, : self.capacity] = self.v
        self.k, self.v, self.capacity = k, v, capacity

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [1, n_kv, T, hd] for absolute `positions` [T]. Out-of-range positions raise (CPU) by design."""
        self.k[layer].index_copy_(2, positions, k)
        self.v[layer].index_copy_(2, positions, v)

    def write_rows(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [rows, n_kv, T, hd], row r's at its own absolute `positions[r]` ([rows, T]). Out-of-range positions
        raise (CPU)."""
        rows = torch.arange(self.rows, device=positions.device).unsqueeze(1)
        self.k[layer][rows, :, positions] = k.transpose(1, 2)  # indexed [rows, T, n_kv, hd]
        self.v[layer][rows, :, positions] = v.transpose(1, 2)

    def check_counters(self) -> None:
        """The debug check between steps: every split-attention counter back at 0. A leftover count (a launch that
        did not finish, or another stream's launch on this cache) would make the next merge run early or never;
        raises instead, naming the layers, and puts them back at 0."""
        left = self.counters.any(-1).nonzero().flatten().tolist()  # a host sync: debug runs only
        if left:
            self.counters.zero_()
            raise RuntimeError(f"split-attention counters of layer(s) {left} were not 0 between steps: a launch on "
                               "this cache was aborted or ran on another stream")

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer, :, :, :length], self.v[layer, :, :, :length]


def causal_mask(q_positions: torch.Tensor, length: int) -> torch.Tensor:
    """[T, length] bool: key j visible to query i iff j <= position_i. Stale slots beyond are never visible.
    Positions [R, T] (one row per request) give [R, T, length]."""
    keys = torch.arange(length, device=q_positions.device)
    return keys <= q_positions.unsqueeze(-1)


def prefix_mask(limit: torch.Tensor, n_queries: int, length: int) -> torch.Tensor:
    """[T, length] bool: every query sees keys j < limit (non-causal block attention of the drafter)."""
    keys = torch.arange(length, device=limit.device)
    return (keys < limit).unsqueeze(0).expand(n_queries, length)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           impl: str = "sdpa") -> torch.Tensor:
    """q [R,Hq,T,d], k/v [R,Hkv,S,d] (grouped-query), mask [T,S] bool (or [R,T,S]: one per request row)
    -> [R,T,Hq*d]; R = 1 but for harness.decode.batch_target's rows of several requests.

    sdpa: the query heads that share a K/V head are folded into the query rows ([R, Hkv, groups*T, d], mask
    repeated per group, or passed with groups*T rows already), so K/V are read in place instead of being copied
    `groups` times per layer."""
    r, hq, t = q.shape[0], q.shape[1], q.shape[2]
    groups = hq // k.shape[1]
    per_row = mask.dim() == 3
    if impl == "sdpa":
        if groups > 1:
            qg = q.reshape(r, k.shape[1], groups * t, q.shape[-1])
            m = mask if mask.shape[-2] == groups * t else mask.repeat(*(1,) * (mask.dim() - 2), groups, 1)
            m = m.unsqueeze(1) if per_row else m
            o = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=scale)
            o = o.reshape(r, hq, t, q.shape[-1])  # a view where the kernel's output layout allows
        else:
            m = mask.unsqueeze(1) if per_row else mask
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)
    else:
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)  # "eager": the textbook formula with an fp32 softmax, kept as a cross-check of the fused kernel
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale
        scores = scores.masked_fill(~(mask.unsqueeze(1) if per_row else mask), float("-inf"))
        o = (scores.softmax(-1) @ v.float()).to(q.dtype)
    return o.transpose(1, 2).reshape(r, q.shape[2], -1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the half-split layout used by HF Llama/Qwen checkpoints. cos/sin: [T, d]."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin
