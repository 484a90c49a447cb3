"""The decode math's one interface: what a target layer, the drafter and the refiners ask of a backend.

Callers hold an `Ops` object, chosen once before the weights load (`core.ops.make_ops`) and passed to
their constructors; they never ask which implementation it is. Two implement it: `TorchOps` (torch ops, the
reference numerics, differentiable: the one training runs through) and `TritonOps` (core.kernels, the
fast decode path, which hands what its kernels do not take to a TorchOps).

Shapes are rows: x [T, K] for T tokens, weights [N, K] (nn.Linear's layout). Attention works on the fused
projection qkv [T, (n_q + 2 n_kv) d] (q heads, then k, then v) and writes the new keys and values into a
core.cache.StaticKV at the rows' positions before it attends.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.cache import StaticKV, causal_mask, prefix_mask
from core.windows import window_mask


@dataclass
class Span:
    """The slots one forward's rows see. positions [T]: increasing, on the device; length: a host bound (> the
    last position) on the slots the torch path reads; limit: None for causal rows, else every slot below it
    (the drafter's block, whose last position is limit - 1); window: causal rows that see only the `window` most
    recent positions (sliding-window layers); impl: how the torch path attends (sdpa, eager)."""
    positions: torch.Tensor
    length: int
    limit: torch.Tensor | None = None
    window: int | None = None
    impl: str = "sdpa"
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def causal(self) -> bool:
        """Causal rows (windowed or not); False: the drafter's block, every slot below `limit`."""
        return self.limit is None

    def mask(self, groups: int) -> torch.Tensor:
        """[rows, length] bool, made once per forward: repeated per query group where sdpa folds the groups."""
        rows = groups if self.impl == "sdpa" and groups > 1 else 1
        if rows not in self._masks:
            t = self.positions.shape[0]
            if self.window is not None:
                m = window_mask(self.positions, self.length, self.window)
            elif self.causal:
                m = causal_mask(self.positions, self.length)
            else:
                m = prefix_mask(self.limit, t, self.length)
            self._masks[rows] = m.repeat(rows, 1) if rows > 1 else m
        return self._masks[rows]


class Ops:
    """The operations of a decode step. Every method takes and returns rows as described in the module."""
    name = "abstract"

    def sized(self, rows: int, groups: int, prefill: bool = False, request_rows: int | None = None) -> "Ops":
        """The ops for a forward of `rows` tokens with `groups` query heads per K/V head (prefill: a prompt):
        these, or ones whose limits that forward fits. request_rows: the forward holds the rows of several
        requests, `request_rows` each, and each request attends alone (core.ops.BatchOps over these ops)."""
        return self

    @property
    def proposing(self) -> "Ops":
        """The ops for the drafter and the refiners: their fastest (only the target's numbers decide the output
        at T=0, so batch invariance is the target's alone)."""
        return self

    def for_heads(self, head_dim: int, n_q: int, n_kv: int, windows: bool = False) -> "Ops":
        """The ops for a model with these attention heads (windows: some layers attend over a sliding window);
        chosen once, at construction."""
        return self

    def linear(self, x: torch.Tensor, w: torch.Tensor, *, bias: torch.Tensor | None = None,
               norm: torch.Tensor | None = None, eps: float = 0.0, act: str | None = None,
               residual: torch.Tensor | None = None, argmax: bool = False):
        """y = act_glu(rms_norm(x)) W^T + bias + residual, in the residual's dtype (else w's).
        norm: an RMSNorm weight [K] applied to x first (HF's roundings, eps); act: x holds gate | up [T, 2K] and
        the input is act(gate) * up, act named as an HF config's hidden_act names it ("silu", "gelu_pytorch_tanh",
        ...: a name, so that no backend has to recognise a function object); residual [T, N]: added to the
        product, rounded once. argmax: also each row's
        argmax [T] (lowest column among equal maxima): returns (y, ids)."""
        raise NotImplementedError

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """HF's RMSNorm of rows x [T, K]: normalised in fp32, rounded, times the weight."""
        raise NotImplementedError

    def xpress_latent(self, head, cache: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """One xPress pass before its readout, z [B-1, r]: `head` is refiners.xpress.XPressHead (duck-typed: core
        sits below the refiners), cache its block_cache, prev [B] the slots' predecessors. The head's own torch
        modules here; a backend may fuse them (TritonOps: one launch)."""
        return head.latent(cache, prev)

    def markov_latent(self, head, prev: torch.Tensor, h: torch.Tensor | None, state: torch.Tensor):
        """One Markov step before its readout, (z [r], next state): `head` is refiners.markov.MarkovHead
        (duck-typed); the head's own torch modules here; TritonOps fuses the gated variant's (one launch)."""
        return head.latent(prev, h, state)

    def attention(self, qkv: torch.Tensor, kv: StaticKV, layer: int, span: Span, cos: torch.Tensor,
                  sin: torch.Tensor, n_q: int, scale: float, q_norm: torch.Tensor | None = None,
                  k_norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
        """One layer's attention for qkv [T, (n_q + 2 n_kv) d]: per-head RMSNorm of q and k (weights [d], None
        for none), rotary (cos/sin [T, d]), k/v written into `kv` at layer `layer`, then attention over the
        span's slots. Returns [T, n_q * d]."""
        raise NotImplementedError

    def write_kv(self, rows: torch.Tensor, kv: StaticKV, layer: int, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, k_norm: torch.Tensor | None = None, eps: float = 0.0) -> None:
        """Projected rows [T, 2 n_kv d] (k heads, then v heads) into `kv` at `positions`: k normed (if k_norm)
        and rotated, v as it is."""
        raise NotImplementedError


def eps_of(norm) -> float:
    """An RMSNorm module's epsilon: HF's modules call it variance_epsilon, the dFlash drafter's eps."""
    eps = getattr(norm, "variance_epsilon", None)
    return norm.eps if eps is None else eps


def fuse_rows(modules) -> torch.Tensor:
    """One weight for several projections of the same input (q/k/v, gate/up): concatenated once, and each module's
    weight becomes a view into it, so no memory is added and the modules still work on their own."""
    w = torch.cat([m.weight for m in modules])
    start = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight = torch.nn.Parameter(w[start:start + n], requires_grad=False)
        start += n
    return w
