"""Gemma 4 text targets (transformers' `gemma4_text`, e.g. the backbone of google/gemma-4-26B-A4B-it) on the
harness's static KV cache.

What differs from the Llama/Qwen layer that harness.decode.target runs, all handled here with HF's own modules:
  - two attention kinds (config.layer_types): sliding-window layers (own head_dim and KV heads, RoPE theta 1e4)
    and full layers (wider heads, fewer KV heads, proportional partial RoPE, keys reused as values when
    attention_k_eq_v); attention scale 1 (the q/k norms carry it); a weightless v norm;
  - sandwich norms (after attention and after the feed-forward) and a per-layer output scalar;
  - a dense GeGLU branch plus, with enable_moe_block, a routed mixture of experts added to it;
  - the embedding is scaled by sqrt(hidden) and the final logits are soft-capped (cap * tanh(x / cap)).
The scaling and the soft-cap stay inside this target: `embed` and `lm_head`, which a drafter shares, are the raw
table and the raw head (the vLLM convention: the drafter's own config decides its logits' cap).

The cache keeps every position for every layer; a sliding layer's window is its attention mask (keys with
position > q - window), so rollback stays a pointer move, as for the other targets.
"""
from __future__ import annotations

import torch
from torch import nn

from core.cache import StaticKV, attend, causal_mask, rotate
from core.ops import TorchOps
from harness.decode.target import Target
from core.windows import window_mask
from core.errors import UsageError

FAMILY = "gemma4_text"


def check_gemma4(config) -> None:
    """What this target does not model yet, refused from the config alone."""
    if getattr(config, "hidden_size_per_layer_input", 0):
        raise UsageError("Gemma 4 per-layer embeddings (hidden_size_per_layer_input > 0, the E2B/E4B models) are "
                         "not modelled; use a model without them (26B-A4B, 31B)")
    if getattr(config, "num_kv_shared_layers", 0):
        raise UsageError("Gemma 4 KV sharing across layers (num_kv_shared_layers > 0) is not modelled")
    if getattr(config, "use_bidirectional_attention", None):
        raise UsageError("Gemma 4 bidirectional attention is not a causal decoder; use a causal text model")


class RawEmbedding(nn.Module):
    """The embedding table without Gemma's sqrt(hidden) factor (shares the target's weight)."""

    def __init__(self, table: nn.Embedding):
        super().__init__()
        self.table = table

    @property
    def weight(self) -> torch.Tensor:
        return self.table.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.table.weight)


class LayerKV:
    """One StaticKV per attention kind (their head counts and widths differ), addressed by global layer index."""

    def __init__(self, layers, kinds: list[str], capacity: int, dtype, device):
        self.slot, self.caches = {}, {}
        for kind in dict.fromkeys(kinds):
            ids = [i for i, k in enumerate(kinds) if k == kind]
            a = layers[ids[0]].self_attn
            self.caches[kind] = StaticKV(len(ids), a.k_proj.out_features // a.head_dim, a.head_dim, capacity,
                                         dtype, device)
            self.slot.update({i: (kind, n) for n, i in enumerate(ids)})

    @property
    def capacity(self) -> int:
        return min(c.capacity for c in self.caches.values())

    def ensure(self, n: int) -> None:
        for c in self.caches.values():
            c.ensure(n)

    def write(self, layer: int, positions, k, v) -> None:
        kind, n = self.slot[layer]
        self.caches[kind].write(n, positions, k, v)

    def read(self, layer: int, length: int):
        kind, n = self.slot[layer]
        return self.caches[kind].read(n, length)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if not cap else torch.tanh(logits / cap) * cap


class Gemma4Target(Target):
    """prefill / verify / commit / reset like Target, for a Gemma4ForCausalLM (text) model."""

    def __init__(self, model, backend, capacity: int, taps: tuple[int, ...] = (), attn_impl: str = "sdpa"):
        cfg = model.config
        check_gemma4(cfg)
        # its layers are its own torch code (make_ops refuses the kernels for Gemma 4); the embedding shared with
        # the drafter has no sqrt(hidden) factor, and `lm_head` (shared too) no soft-cap
        self._bind(model, backend, attn_impl, TorchOps(), RawEmbedding(model.model.embed_tokens))
        self.embed_scale = float(cfg.hidden_size) ** 0.5
        self.cap = getattr(cfg, "final_logit_softcapping", None)
        self.kinds = list(cfg.layer_types)
        self.window = int(cfg.sliding_window)
        a0 = self.layers[0].self_attn
        self.head_dim = a0.head_dim
        self.n_kv_heads = a0.k_proj.out_features // a0.head_dim  # the first layer's (per-layer values differ)
        self.set_taps(taps)
        self.kv = LayerKV(self.layers, self.kinds, capacity, backend.dtype, backend.device)
        self.route_log: list | None = None  # set to a list to record each MoE layer's expert ids (untimed use)

    def fuse_projections(self, on: bool = True) -> bool:
        return False  # HF's modules as they are: the q/k/v widths differ per layer kind

    def _embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.embed.weight
        return self.embed(ids) * torch.tensor(self.embed_scale, dtype=w.dtype, device=w.device)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, length: int, want_features: bool,
                last_only: bool = False):
        h = self._embed_rows(ids).unsqueeze(0)
        rope = {k: tuple(t[0] for t in self.rotary(h, positions.unsqueeze(0), k)) for k in set(self.kinds)}
        masks = {"full_attention": causal_mask(positions, length),
                 "sliding_attention": window_mask(positions, length, self.window)}
        tapped = {}
        for i, layer in enumerate(self.layers):
            kind = self.kinds[i]
            h = self._layer(i, layer, h, positions, *rope[kind], masks[kind], length)
            if want_features and i in self._tap_set:
                tapped[i] = h[0]
        out = self.norm(h[0])
        if want_features and self.n_layers - 1 in tapped:
            tapped[self.n_layers - 1] = out  # HF's last hidden state is the normed one (see Target.forward)
        features = torch.cat([tapped[t] for t in self.taps], dim=-1) if want_features and self.taps else None
        rows = out[-1:] if last_only else out
        # --fp32-logits: the head in float32 (Target.use_fp32_logits), soft-capped in float32 too
        logits = softcap(self.lm_head(rows) if self._lm_fp32 is None else self._fp32_logits(rows), self.cap)
        return logits, features

    def _layer(self, i, layer, h, positions, cos, sin, mask, length):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        t, hd = x.shape[1], a.head_dim
        q = rotate(a.q_norm(a.q_proj(x).view(1, t, -1, hd)).transpose(1, 2), cos, sin)
        k_raw = a.k_proj(x).view(1, t, -1, hd)
        v_raw = a.v_proj(x).view(1, t, -1, hd) if a.v_proj is not None else k_raw  # k_eq_v: keys are values
        k = rotate(a.k_norm(k_raw).transpose(1, 2), cos, sin)
        self.kv.write(i, positions, k, a.v_norm(v_raw).transpose(1, 2))
        ks, vs = self.kv.read(i, length)
        h = h + layer.post_attention_layernorm(a.o_proj(attend(q, ks, vs, mask, a.scaling, self.attn_impl)))
        y = layer.mlp(layer.pre_feedforward_layernorm(h))
        if layer.enable_moe_block:
            flat = h.reshape(-1, h.shape[-1])
            _, weights, experts = layer.router(flat)
            if self.route_log is not None:
                self.route_log.append(experts)
            routed = layer.experts(layer.pre_feedforward_layernorm_2(flat), experts, weights).reshape(h.shape)
            y = layer.post_feedforward_layernorm_1(y) + layer.post_feedforward_layernorm_2(routed)
        h = h + layer.post_feedforward_layernorm(y)
        return h * layer.layer_scalar
