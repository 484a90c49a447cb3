"""The target model: an HF causal LM driven by our own forward over a static KV cache (loading: harness.decode.loading).

We keep HF's modules and weights (projections, norms, MLP, rotary tables) but run the layer loop ourselves, so that
the harness owns the cache (write at positions, attend over a prefix, roll back by moving a pointer) and taps only
the hidden layers a drafter asks for. Qwen3, Qwen2 and Llama families share this structure.
"""
from __future__ import annotations

import torch

from core.attention import check_attn_impl
from core.cache import StaticKV
from core.devices import Backend
from core.ops import Ops, Span, TorchOps, eps_of, fuse_rows
from core.ops.torch_impl import trained
from core.errors import UsageError

PLAIN_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")  # what this layer loop runs (Gemma 4: harness.decode.gemma4)


def check_plain_family(config) -> None:
    family = getattr(config, "model_type", None)
    if family not in PLAIN_FAMILIES:
        raise UsageError(f"target model_type {family!r} is not one this layer loop runs ({', '.join(PLAIN_FAMILIES)})")
    window = getattr(config, "sliding_window", None)
    sliding = window is not None and (family == "mistral" or getattr(config, "use_sliding_window", False))
    if sliding:
        raise UsageError(f"target uses sliding-window attention (window {window}), which this harness does not "
                         "model yet; use a full-attention checkpoint")


class Target:
    """prefill / verify / commit / reset over a static cache; `pos` is the committed length, on the device.

    `ops` (core.ops, default torch ops) runs the decode math: decode steps (AR steps and verify blocks
    within the ops' limits) on them, the prompt on the ops' prefill choice."""

    def __init__(self, model, backend: Backend, capacity: int, taps: tuple[int, ...] = (), attn_impl: str = "sdpa",
                 ops: Ops | None = None):
        check_plain_family(model.config)
        self._bind(model, backend, attn_impl, ops or TorchOps(), model.model.embed_tokens)
        cfg = self.config
        attn0 = self.layers[0].self_attn
        self.head_dim = getattr(attn0, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.groups = cfg.num_attention_heads // self.n_kv_heads
        self.scale = getattr(attn0, "scaling", self.head_dim ** -0.5)
        self.set_taps(taps)
        self.kv = StaticKV(self.n_layers, self.n_kv_heads, self.head_dim, capacity, backend.dtype, backend.device)
        self._act = getattr(cfg, "hidden_act", "silu")  # the MLP's activation, by name (the ops' interface)

    def _bind(self, model, backend: Backend, attn_impl: str, ops: Ops, embed) -> None:
        """The fields every target has, Gemma4Target's included: one code path, so that the families cannot drift
        apart. What a generation needs beyond weights and the cache (step graphs, samplers, output and gap
        buffers, per-request fields) is not here: it is the decode's (harness.decode.state.DecodeState)."""
        self.model, self.backend, self.config = model, backend, model.config
        self.attn_impl = check_attn_impl(attn_impl)
        inner = model.model
        self.embed, self.layers, self.norm, self.rotary = embed, inner.layers, inner.norm, inner.rotary_emb
        self.lm_head = model.lm_head
        self.n_layers = len(self.layers)
        self.hidden_size = self.config.hidden_size
        self.vocab_size = self.lm_head.weight.shape[0]
        self.max_position = int(getattr(self.config, "max_position_embeddings", 0) or 0)
        self.pos = torch.zeros((), dtype=torch.long, device=backend.device)
        self._fused: list | None = None  # per layer: (qkv weight, q/k/v row counts, gate+up weight) or None
        self.ops = ops
        self._lm_fp32 = None  # float32 copy of the lm_head weight when use_fp32_logits() (--fp32-logits)
        # Bumped by every change to what a decode step launches (ops, fused projections, fp32 logits): a
        # DecodeState drops the step graphs it captured at an older version.
        self.version = 0

    def use_fp32_logits(self) -> None:
        """Logits in float32 from the (normed) last hidden state: bf16 logits round at 2^-8 relative, so two
        computations of the same step can flip a near-tie; this keeps one float32 copy of the lm_head weight."""
        self.version += 1
        self._lm_fp32 = self.lm_head.weight.detach().float()

    def _fp32_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Logits [T, V] in float32 from normed rows, through the float32 copy of the head (use_fp32_logits)."""
        bias = None if self.lm_head.bias is None else self.lm_head.bias.float()
        return torch.nn.functional.linear(rows.float(), self._lm_fp32, bias)

    def use_ops(self, ops: Ops) -> None:
        """Other ops from now on (the lab compares them in one process); captured step graphs are dropped."""
        self.version += 1
        self.ops = ops

    @property
    def kernels(self) -> str:
        """The name of the ops the decode steps run on (torch, triton)."""
        return self.ops.name

    @torch.no_grad()
    def fuse_projections(self, on: bool = True) -> bool:
        """One matmul for q/k/v and one for gate/up per layer (4 weight reads per layer instead of 7: at one row,
        small matmuls run far below copy bandwidth). The fused matrix is built once and the HF modules' weights
        become views into it, so no memory is added and the HF forward still works. Layers with projection
        biases keep the separate path. Captured step graphs are dropped (they hold the old launches)."""
        self.version += 1
        if not on:
            self._fused = None
            return False
        if self._fused is None:
            self._fused = [self._fuse_layer(layer) for layer in self.layers]
        return any(f is not None for f in self._fused)

    @staticmethod
    def _fuse_layer(layer):
        a, mlp = layer.self_attn, layer.mlp
        projs = (a.q_proj, a.k_proj, a.v_proj, mlp.gate_proj, mlp.up_proj)
        if any(getattr(m, "bias", None) is not None for m in projs) or not hasattr(mlp, "act_fn"):
            return None
        if trained(mlp.act_fn):
            return None  # a trained activation (prelu, xielu): the HF module keeps its weights; the ops take names
        fused = [fuse_rows((a.q_proj, a.k_proj, a.v_proj)), fuse_rows((mlp.gate_proj, mlp.up_proj))]
        sizes = [a.q_proj.weight.shape[0], a.k_proj.weight.shape[0], a.v_proj.weight.shape[0]]
        return fused[0], sizes, fused[1]

    def set_taps(self, taps: tuple[int, ...]) -> None:
        for t in taps:
            if not 0 <= t < self.n_layers:
                raise UsageError(f"target layer id {t} is outside the target's {self.n_layers} layers")
        self.taps = tuple(taps)
        self._tap_set = frozenset(taps)

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    def ensure_capacity(self, n: int) -> None:
        self.kv.ensure(n)

    def reset(self) -> None:
        self.pos.zero_()

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, length: int, want_features: bool,
                last_only: bool = False, batch=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids/positions [T] (increasing); attends over cache slots [0, length). Returns logits [T or 1, V],
        features. batch: the rows of several requests, each over its own cache row (a
        harness.decode.batch_target.BatchRows: its ops, cache and span; `positions` stay the rows' own)."""
        ops = self.ops.sized(ids.shape[0], self.groups, prefill=last_only) if batch is None else batch.ops
        h = self.embed(ids)
        cos, sin = self.rotary(h.unsqueeze(0), positions.unsqueeze(0))
        cos, sin = cos[0], sin[0]
        span = Span(positions, length, impl=self.attn_impl) if batch is None else batch.span
        kv = self.kv if batch is None else batch.kv
        tapped = {}
        for i, layer in enumerate(self.layers):
            h = self._layer(ops, i, layer, h, span, cos, sin, kv)
            if want_features and i in self._tap_set:
                tapped[i] = h
        last = self.n_layers - 1
        w = self.lm_head.weight
        tap_last = want_features and last in tapped
        if tap_last or self._lm_fp32 is not None:
            # HF's last hidden_state is taken after the final norm; drafters were trained on that tensor, and the
            # lm_head reads it too
            out = ops.rms_norm(h, self.norm.weight, eps_of(self.norm))
            if tap_last:
                tapped[last] = out
            rows = out[-1:] if last_only else out
            if self._lm_fp32 is None:
                logits = ops.linear(rows, w, bias=self.lm_head.bias)
            else:
                logits = self._fp32_logits(rows)
        else:  # the final norm rides in the lm_head matmul where the ops can fold it
            logits = ops.linear(h[-1:] if last_only else h, w, bias=self.lm_head.bias, norm=self.norm.weight,
                                eps=eps_of(self.norm))
        features = torch.cat([tapped[t] for t in self.taps], dim=-1) if want_features and self.taps else None
        return logits, features

    def _layer(self, ops: Ops, i: int, layer, h: torch.Tensor, span: Span, cos, sin, kv) -> torch.Tensor:
        """One pre-norm decoder layer (HF Llama/Qwen module names) over rows h [T, H], attending through `kv`."""
        attn, ln1, ln2 = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
        fused = self._fused[i] if self._fused is not None else None
        if fused is not None:
            qkv = ops.linear(h, fused[0], norm=ln1.weight, eps=eps_of(ln1))
        else:
            x = ops.rms_norm(h, ln1.weight, eps_of(ln1))
            qkv = torch.cat([ops.linear(x, p.weight, bias=p.bias) for p in (attn.q_proj, attn.k_proj, attn.v_proj)],
                            dim=-1)
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        o = ops.attention(qkv, kv, i, span, cos, sin, self.config.num_attention_heads, self.scale,
                          None if qn is None else qn.weight, None if kn is None else kn.weight,
                          0.0 if qn is None else eps_of(qn))
        h = ops.linear(o, attn.o_proj.weight, bias=attn.o_proj.bias, residual=h)
        mlp = layer.mlp
        if fused is None:
            return h + mlp(ops.rms_norm(h, ln2.weight, eps_of(ln2)))
        gate_up = ops.linear(h, fused[2], norm=ln2.weight, eps=eps_of(ln2))
        return ops.linear(gate_up, mlp.down_proj.weight, bias=mlp.down_proj.bias, act=self._act, residual=h)

    def prefill(self, prompt: torch.Tensor, want_features: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs the prompt at positions 0..P-1 and commits it. Returns last-position logits [V], features [P, F]."""
        n = prompt.shape[0]
        positions = torch.arange(n, device=prompt.device)
        logits, feats = self.forward(prompt, positions, n, want_features, last_only=True)
        self.pos.fill_(n)
        return logits[0], feats

    def verify(self, block: torch.Tensor, length: int, want_features: bool):
        """Runs a fixed-width block at positions pos..pos+W-1 without committing it.

        `length` is a host-side bound on the slots to attend over (>= pos + W); stale slots below it are masked.
        """
        positions = self.pos + torch.arange(block.shape[0], device=block.device)
        return self.forward(block, positions, length, want_features)

    def commit(self, n: torch.Tensor) -> None:
        """Keep the first n verified positions: the anchor and the accepted drafts. A device-side add, no sync."""
        self.pos.add_(n)
