"""Many rows of one HF causal LM (llama, qwen2, qwen3) decoding together over a static KV cache.

`BatchedLM` holds the model's weights as the decode math wants them (q/k/v and gate/up concatenated once, cast
to the run's dtype) and a cache [layers, rows, n_kv, capacity, head_dim] that it owns. Each row has its own
positions: `prefill` runs right-padded prompts of several rows (any subset, so that a finished row can take a
new prompt while the others keep decoding) and `decode` runs one token per row, written at that row's own
position and attending over that row's own prefix (a boolean key mask over a length bucket). Slots past a row's
committed length are stale: masked out, and overwritten before they become visible. Only torch ops (the
projections are cuBLAS matmuls, attention is SDPA), so one decode call can be captured as a CUDA graph
(harness.decode.batched_gen). The HF modules are reused for the rotary tables only; the model is not modified.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core import kernels
from core.cache import rotate
from core.ops import TorchOps, eps_of
from core.ops.torch_impl import rms, trained
from core.errors import UsageError
from harness.decode.target import check_plain_family


# the decode's attention: SDPA under a mask over the step's bucket, or the Triton kernel over each row's prefix
ATTENTIONS = ("sdpa", "triton")


def check_triton(device: torch.device, head_dim: int | None = None, n_q: int = 1, n_kv: int = 1,
                 who: str = "batched generation: attention triton", instead: str = "use attention sdpa") -> None:
    """attention="triton": the harness's decode attention kernel (core/kernels/attention.py), one launch a layer
    for every row, each over its own prefix; refused where it cannot run (the shapes when given). `who` and
    `instead` word the error for the caller's setting (training/gen.py: responses.attention)."""
    if not kernels.available():
        raise UsageError(f"{who} needs the triton package (pip install triton); {instead}")
    if device.type != "cuda" and not kernels.interpreted():
        raise UsageError(f"{who} runs on a CUDA device (Triton's CPU interpreter, TRITON_INTERPRET=1, is for tests: "
                         f"far too slow for real work), not on {device.type}; {instead}")
    if head_dim is None:
        return
    if not kernels.heads_fit(head_dim, n_q, n_kv) or not kernels.fits(1, n_q // n_kv):
        raise UsageError(f"{who} takes a power-of-two head_dim >= 16 and whole query groups (this model: head_dim "
                         f"{head_dim}, {n_q} query and {n_kv} K/V heads); {instead}")


def _head_shape(cfg) -> tuple[int, int, int]:
    n_q = cfg.num_attention_heads
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q, n_q, cfg.num_key_value_heads


def pick_attention(model, choice: str, device: torch.device | None = None) -> str:
    """`auto`: the Triton kernel where it runs (a CUDA device, the triton package, the model's head shape), SDPA
    elsewhere; `sdpa` and `triton` are taken as given (triton is checked where the generator is built). On the
    H200 the kernel decoded SmolLM2-135M at 114k tokens/s against SDPA's 51k (2,048 prompts x 512 tokens, batch
    1,024: results/perf/generate_h200_triton_2048x512.json and _sdpa_), SDPA reading 3.8 times the cache slots
    the rows need."""
    if choice not in ("auto",) + ATTENTIONS:
        raise UsageError(f"batched generation: attention {choice!r} is not one of auto, {', '.join(ATTENTIONS)}")
    if choice != "auto":
        return choice
    dev = torch.device(device) if device is not None else model.device
    if dev.type != "cuda":  # never Triton's CPU interpreter unasked
        return "sdpa"
    if torch.version.hip is not None or (torch.cuda.is_available() and torch.cuda.get_device_capability(dev) < (8, 0)):
        return "sdpa"  # the kernel is tested and measured on NVIDIA GPUs with bf16 tiles (sm80 on) only
    try:
        check_triton(dev, *_head_shape(model.config))
    except UsageError:
        return "sdpa"
    return "triton"


@dataclass
class LayerWeights:
    ln1: torch.Tensor
    eps1: float
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qk_eps: float
    o: torch.Tensor
    o_bias: torch.Tensor | None
    ln2: torch.Tensor
    eps2: float
    gate_up: torch.Tensor
    down: torch.Tensor
    down_bias: torch.Tensor | None


def _cat(tensors, dtype) -> torch.Tensor | None:
    if all(t is None for t in tensors):
        return None
    if any(t is None for t in tensors):
        raise UsageError("batched generation: a projection group mixes biased and unbiased projections")
    return torch.cat([t.detach() for t in tensors]).to(dtype)


def _cast(t, dtype):
    return None if t is None else t.detach().to(dtype)


def _layer_weights(layer, dtype) -> LayerWeights:
    a, mlp = layer.self_attn, layer.mlp
    if not hasattr(mlp, "gate_proj") or trained(getattr(mlp, "act_fn", None)):
        raise UsageError("batched generation needs a gated MLP (gate/up/down) with a named activation")
    if getattr(mlp.gate_proj, "bias", None) is not None or getattr(mlp.up_proj, "bias", None) is not None:
        raise UsageError("batched generation: gate/up projections with biases are not supported")
    qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
    projs = (a.q_proj, a.k_proj, a.v_proj)
    return LayerWeights(
        ln1=_cast(layer.input_layernorm.weight, dtype), eps1=eps_of(layer.input_layernorm),
        qkv=_cat([p.weight for p in projs], dtype), qkv_bias=_cat([p.bias for p in projs], dtype),
        q_norm=None if qn is None else _cast(qn.weight, dtype), k_norm=None if kn is None else _cast(kn.weight, dtype),
        qk_eps=0.0 if qn is None else eps_of(qn),
        o=_cast(a.o_proj.weight, dtype), o_bias=_cast(a.o_proj.bias, dtype),
        ln2=_cast(layer.post_attention_layernorm.weight, dtype), eps2=eps_of(layer.post_attention_layernorm),
        gate_up=_cat([mlp.gate_proj.weight, mlp.up_proj.weight], dtype),
        down=_cast(mlp.down_proj.weight, dtype), down_bias=_cast(mlp.down_proj.bias, dtype))


class BatchedLM:
    """The model's forward over `rows` cache rows. prefill(rows, prompts) and decode(tokens, lengths, length)
    both write K/V into the cache and return logits; neither keeps any per-row state of its own (the caller,
    harness.decode.batched_gen.BatchedGenerator, owns lengths, stops and outputs)."""

    def __init__(self, model, rows: int, capacity: int, dtype: torch.dtype | None = None,
                 device: torch.device | None = None, attention: str = "sdpa"):
        cfg = model.config
        check_plain_family(cfg)
        if attention not in ATTENTIONS:
            raise UsageError(f"batched generation: attention {attention!r} is not one of {', '.join(ATTENTIONS)}")
        self.device = torch.device(device) if device is not None else model.device
        if attention == "triton":  # before any weight is cast
            check_triton(self.device, *_head_shape(cfg))
        self.dtype = dtype or next(model.parameters()).dtype
        inner = model.model
        self.rotary = inner.rotary_emb
        self.embed = _cast(inner.embed_tokens.weight, self.dtype)
        tied = model.lm_head.weight.data_ptr() == inner.embed_tokens.weight.data_ptr()
        self.lm_head = self.embed if tied else _cast(model.lm_head.weight, self.dtype)
        self.lm_bias = _cast(getattr(model.lm_head, "bias", None), self.dtype)
        self.norm, self.norm_eps = _cast(inner.norm.weight, self.dtype), eps_of(inner.norm)
        self.layers = [_layer_weights(layer, self.dtype) for layer in inner.layers]
        attn0 = inner.layers[0].self_attn
        self.head_dim = getattr(attn0, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.n_q, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.groups = self.n_q // self.n_kv
        self.scale = getattr(attn0, "scaling", self.head_dim ** -0.5)
        self.act = getattr(cfg, "hidden_act", "silu")
        self.vocab_size = self.lm_head.shape[0]
        self.ops = TorchOps()
        self.attention = attention
        self.rows, self.capacity = rows, 0
        self.k = self.v = torch.empty(0)
        self.ensure(capacity)
        self.row_ids = torch.arange(rows, device=self.device)

    @property
    def max_position(self) -> int:
        return int(getattr(getattr(self.rotary, "config", None), "max_position_embeddings", 0) or 0)

    def ensure(self, capacity: int) -> bool:
        """Grow the cache (contents are dropped: only between generations). True when it was reallocated."""
        if capacity <= self.capacity:
            return False
        shape = (len(self.layers), self.rows, self.n_kv, capacity, self.head_dim)
        self.k = self.v = None  # free the old pair first
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.capacity = capacity
        return True

    # --- the layer loop ---------------------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """ids/positions [N] (flattened rows); attend(layer, weights, qkv [N, (n_q + 2 n_kv) d], cos, sin [N, d])
        -> [N, n_q*d] (the q/k norms and the rotary its own: `heads`, or a kernel's). Returns the last layer's
        hidden rows [N, H] (before the final norm)."""
        h = F.embedding(ids, self.embed)
        cos, sin = self.rotary(h.unsqueeze(0), positions.unsqueeze(0))
        cos, sin = cos[0], sin[0]
        ops = self.ops
        for i, w in enumerate(self.layers):
            qkv = ops.linear(h, w.qkv, bias=w.qkv_bias, norm=w.ln1, eps=w.eps1)
            o = attend(i, w, qkv, cos, sin)
            h = ops.linear(o, w.o, bias=w.o_bias, residual=h)
            gate_up = ops.linear(h, w.gate_up, norm=w.ln2, eps=w.eps2)
            h = ops.linear(gate_up, w.down, bias=w.down_bias, act=self.act, residual=h)
        return h

    def heads(self, w: LayerWeights, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [N, n_q, d], k, v [N, n_kv, d] of a layer's fused projection: per-head norms (Qwen3), then the rotary."""
        d, n = self.head_dim, qkv.shape[0]
        q, k, v = qkv.split((self.n_q * d, self.n_kv * d, self.n_kv * d), dim=-1)
        q, k, v = q.view(n, self.n_q, d), k.view(n, self.n_kv, d), v.view(n, self.n_kv, d)
        if w.q_norm is not None:
            q, k = rms(q, w.q_norm, w.qk_eps), rms(k, w.k_norm, w.qk_eps)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [N, 1, d]: broadcast over heads
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(h, self.lm_head, bias=self.lm_bias, norm=self.norm, eps=self.norm_eps)

    # --- prefill: right-padded prompts of some rows -------------------------------------------------------------
    def prefill(self, rows: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """rows [R] (cache rows), ids [R, W] right-padded prompts, lengths [R] (>= 1). Writes K/V at positions
        0..W-1 of each row (pad slots are stale: past the row's length) and returns each row's logits at its last
        prompt position [R, V]. Attention sees only this call's keys: a refilled row never reads its old prompt."""
        r, width = ids.shape
        positions = torch.arange(width, device=ids.device).expand(r, width)
        keys = torch.arange(width, device=ids.device)
        causal = keys[None, :] <= keys[:, None]                                     # [W, W]
        mask = causal[None] & (keys[None, None, :] < lengths[:, None, None])         # [R, W, W]
        mask = mask.repeat(1, self.groups, 1).unsqueeze(1)                         # [R, 1, groups*W, W]
        d, g = self.head_dim, self.groups

        def attend(i, w, qkv, cos, sin):
            q, k, v = self.heads(w, qkv, cos, sin)
            k, v = k.view(r, width, self.n_kv, d), v.view(r, width, self.n_kv, d)
            self.k[i][rows[:, None], :, positions] = k
            self.v[i][rows[:, None], :, positions] = v
            qg = q.view(r, width, self.n_kv, g, d).permute(0, 2, 3, 1, 4).reshape(r, self.n_kv, g * width, d)
            o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                               scale=self.scale)
            return o.view(r, self.n_kv, g, width, d).permute(0, 3, 1, 2, 4).reshape(r * width, self.n_q * d)

        h = self._forward(ids.reshape(-1), positions.reshape(-1), attend)
        last = h.view(r, width, -1)[torch.arange(r, device=ids.device), lengths - 1]
        return self.logits(last)

    # --- decode: one token per row, every row -------------------------------------------------------------------
    def decode(self, tokens: torch.Tensor, lengths: torch.Tensor, length: int) -> torch.Tensor:
        """tokens [rows] at positions `lengths` [rows] (each row's committed length, on the device); attends over
        cache slots [0, length) (a host bound > every row's position), each row up to its own position. No host
        sync: capturable. Returns logits [rows, V]."""
        d, b = self.head_dim, self.rows
        if self.attention == "triton":  # each row over its own prefix only: `length` bounds nothing here
            positions = lengths.view(b, 1)

            def fused(i, w, qkv, cos, sin):  # norms, rotary, the cache write and the attention: one launch
                return kernels.attention(qkv, w.q_norm, w.k_norm, w.qk_eps, cos, sin, positions, self.k[i],
                                         self.v[i], self.n_q, self.scale, causal=True, splits=1)
            return self.logits(self._forward(tokens, lengths, fused))
        keys = torch.arange(length, device=tokens.device)
        mask = (keys[None, :] <= lengths[:, None]).view(self.rows, 1, 1, length)

        def attend(i, w, qkv, cos, sin):
            q, k, v = self.heads(w, qkv, cos, sin)
            self.k[i][self.row_ids, :, lengths] = k
            self.v[i][self.row_ids, :, lengths] = v
            qg = q.view(b, self.n_kv, self.groups, d)  # query head h reads K/V head h // groups
            o = F.scaled_dot_product_attention(qg, self.k[i][:, :, :length], self.v[i][:, :, :length],
                                               attn_mask=mask, scale=self.scale)
            return o.reshape(b, self.n_q * d)

        return self.logits(self._forward(tokens, lengths, attend))
