"""The target model: an HF causal LM driven by our own forward over a static KV cache.

We keep HF's modules and weights (projections, norms, MLP, rotary tables) but run the layer loop ourselves, so that
the harness owns the cache (write at positions, attend over a prefix, roll back by moving a pointer) and taps only
the hidden layers a drafter asks for. Qwen3, Qwen2 and Llama families share this structure.
"""
from __future__ import annotations

import os

import torch

from harness.decode.cache import StaticKV, attend, causal_mask, rotate
from harness.decode.devices import Backend
from harness.errors import UsageError

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma4_text")  # gemma4_text: harness.decode.gemma4


def split_model_path(spec: str) -> tuple[str, dict]:
    """A local .gguf file loads through transformers' GGUF reader: directory + gguf_file kwarg."""
    if spec.lower().endswith(".gguf"):
        if not os.path.isfile(spec):
            raise UsageError(f"--model-name-or-path {spec}: GGUF file not found")
        return os.path.dirname(os.path.abspath(spec)), {"gguf_file": os.path.basename(spec)}
    return spec, {}


def load_target_config(spec: str, overrides: dict | None = None):
    """Read only the config (cheap) so that compatibility can be checked before any weights are loaded.
    `overrides`: --hf-overrides (harness.decode.hf_overrides), e.g. the text backbone of a multimodal model."""
    from transformers import AutoConfig

    from harness.decode.hf_overrides import apply_overrides
    path, extra = split_model_path(spec)
    try:
        config = AutoConfig.from_pretrained(path, **extra)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"cannot read the target config from {spec!r}: {first}") from None
    config = apply_overrides(config, overrides or {})
    check_family(config)
    return config


def check_family(config) -> None:
    family = getattr(config, "model_type", None)
    from harness.decode.hf_overrides import multimodal_hint
    hint = multimodal_hint(config)
    if hint:
        raise UsageError(hint)
    if family == "gemma4_text":
        from harness.decode.gemma4 import check_gemma4
        return check_gemma4(config)
    if family not in SUPPORTED_FAMILIES:
        raise UsageError(f"target model_type {family!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}")
    window = getattr(config, "sliding_window", None)
    sliding = window is not None and (family == "mistral" or getattr(config, "use_sliding_window", False))
    if sliding:
        raise UsageError(f"target uses sliding-window attention (window {window}), which this harness does not "
                         "model yet; use a full-attention checkpoint")


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer
    path, extra = split_model_path(spec)
    return AutoTokenizer.from_pretrained(path, **extra)


def load_target(spec: str, backend: Backend, capacity: int = 256, taps: tuple[int, ...] = (),
                attn_impl: str = "sdpa", tokenizer=None, overrides: dict | None = None):
    """Returns (Target, tokenizer). `spec` is a hub id, a local directory or a local .gguf file; `overrides`:
    --hf-overrides (the config is read and overridden first, then the weights load into it)."""
    from transformers import AutoModelForCausalLM

    from harness.decode.hf_overrides import load_kwargs
    path, extra = split_model_path(spec)
    tokenizer = tokenizer or load_tokenizer(spec)
    if overrides:
        extra = {**extra, "config": load_target_config(spec, overrides), **load_kwargs(overrides)}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=backend.dtype, attn_implementation="sdpa", **extra)
    model.to(backend.device).eval()
    return make_target(model, backend, capacity=capacity, taps=taps, attn_impl=attn_impl), tokenizer


def make_target(model, backend: Backend, capacity: int = 256, taps: tuple[int, ...] = (), attn_impl: str = "sdpa"):
    """The Target class for the model's family (Gemma 4 has its own layer, harness.decode.gemma4)."""
    if getattr(model.config, "model_type", None) == "gemma4_text":
        from harness.decode.gemma4 import Gemma4Target
        return Gemma4Target(model, backend, capacity=capacity, taps=taps, attn_impl=attn_impl)
    return Target(model, backend, capacity=capacity, taps=taps, attn_impl=attn_impl)


def stop_token_ids(model, tokenizer) -> list[int]:
    """All of generation_config.eos_token_id (Qwen3 lists two), else the tokenizer's eos."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = getattr(model.config, "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    ids = [ids] if isinstance(ids, int) else list(ids)
    return sorted(set(int(i) for i in ids))


def _rms(norm, x: torch.Tensor) -> torch.Tensor:
    """An HF RMSNorm in two kernels instead of about seven (four norms a layer): the fused normalisation computes
    in fp32 and rounds to the input dtype once, then the weight multiplies in that dtype, as HF does."""
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None:
        return norm(x)
    return norm.weight * torch.nn.functional.rms_norm(x, norm.weight.shape, None, eps)


class Target:
    """prefill / verify / commit / reset over a static cache; `pos` is the committed length, on the device."""

    def __init__(self, model, backend: Backend, capacity: int, taps: tuple[int, ...] = (), attn_impl: str = "sdpa"):
        check_family(model.config)
        if attn_impl not in ("sdpa", "eager"):
            raise UsageError(f"--attn-implementation {attn_impl!r} is not supported here; use sdpa or eager")
        self.model, self.backend, self.attn_impl = model, backend, attn_impl
        inner = model.model
        self.embed, self.layers, self.norm, self.rotary = inner.embed_tokens, inner.layers, inner.norm, inner.rotary_emb
        self.lm_head = model.lm_head
        cfg = model.config
        self.config = cfg
        self.n_layers = len(self.layers)
        self.hidden_size = cfg.hidden_size
        self.vocab_size = self.lm_head.weight.shape[0]
        attn0 = self.layers[0].self_attn
        self.head_dim = getattr(attn0, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.scale = getattr(attn0, "scaling", self.head_dim ** -0.5)
        self.max_position = int(getattr(cfg, "max_position_embeddings", 0) or 0)
        self.set_taps(taps)
        self.kv = StaticKV(self.n_layers, self.n_kv_heads, self.head_dim, capacity, backend.dtype, backend.device)
        self.pos = torch.zeros((), dtype=torch.long, device=backend.device)
        self.step_graphs = None  # harness.decode.graphs.StepGraphs, created by the first use_graph generation
        self._fused: list | None = None  # per layer: (qkv weight, q/k/v row counts, gate+up weight) or None
        self._kernels = None  # harness.decode.kernels when use_kernels() turned them on: the decode-step fast path
        self._lm_fp32 = None  # float32 copy of the lm_head weight when use_fp32_logits() (--fp32-logits)

    def use_fp32_logits(self) -> None:
        """Logits in float32 from the (normed) last hidden state: bf16 logits round at 2^-8 relative, so two
        computations of the same step can flip a near-tie; this keeps one float32 copy of the lm_head weight."""
        self._lm_fp32 = self.lm_head.weight.detach().float()

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        if self._lm_fp32 is None:
            return self.lm_head(normed)
        return torch.nn.functional.linear(normed.float(), self._lm_fp32)

    def use_kernels(self, on: bool = True) -> bool:
        """Run decode steps (AR steps and verify blocks up to kernels.MAX_ROWS rows) on harness.decode.kernels' Triton
        kernels: six launches a layer at one row (eight for a block), the q/k/v norm folded at one row, fused
        activation and residual adds, attention bounded by the block's own positions. Prefill stays on the torch
        path. Raises UsageError if this target or machine cannot; captured step graphs are dropped (they hold the
        old kernels)."""
        self.step_graphs = None
        if not on:
            self._kernels = None
            return False
        from harness.decode import kernels
        self.fuse_projections()
        why = kernels.unsupported_reason(self)
        if why is None and self.backend.device.type != "cuda" and not kernels.interpreted():
            why = "they need a CUDA device"
        if why is not None:
            raise UsageError(f"--kernels triton: not available for this target: {why}; use --kernels torch")
        kernels.prepare(self.backend.device)
        self._kernels = kernels
        return True

    @property
    def kernels(self) -> str:
        return "triton" if self._kernels is not None else "torch"

    @torch.no_grad()
    def fuse_projections(self, on: bool = True) -> bool:
        """One matmul for q/k/v and one for gate/up per layer (4 weight reads per layer instead of 7: at one row,
        small matmuls run far below copy bandwidth). The fused matrix is built once and the HF modules' weights
        become views into it, so no memory is added and the HF forward still works. Layers with projection
        biases keep the separate path. Captured step graphs are dropped (they hold the old kernels)."""
        self.step_graphs = None
        if not on:
            self._fused = None
            self._kernels = None  # the kernels need the fused weights
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
        from harness.decode.kernels import fuse_rows
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
                last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids/positions [T]; attends over cache slots [0, length). Returns logits [T or 1, V], features."""
        groups = self.config.num_attention_heads // self.n_kv_heads
        if self._kernels is not None and not last_only and self._kernels.fits(ids.shape[0], groups):
            return self._forward_kernels(ids, positions, want_features)
        h = self.embed(ids).unsqueeze(0)
        cos, sin = self.rotary(h, positions.unsqueeze(0))
        cos, sin = cos[0], sin[0]
        mask = causal_mask(positions, length)
        if self.attn_impl == "sdpa" and groups > 1:
            mask = mask.repeat(groups, 1)  # once per forward, for attend's grouped-query folding
        tapped = {}
        for i, layer in enumerate(self.layers):
            h = self._layer(i, layer, h, positions, cos, sin, mask, length)
            if want_features and i in self._tap_set:
                tapped[i] = h[0]
        out = _rms(self.norm, h[0])
        if want_features and self.n_layers - 1 in tapped:
            # HF's last hidden_state is taken after the final norm; drafters were trained on that tensor.
            tapped[self.n_layers - 1] = out
        features = torch.cat([tapped[t] for t in self.taps], dim=-1) if want_features and self.taps else None
        logits = self._logits(out[-1:] if last_only else out)
        return logits, features

    def _forward_kernels(self, ids, positions, want_features):
        """The decode forward on harness.decode.kernels (same math and rounding steps as `forward`; positions must be
        increasing, as every decode step's are)."""
        k = self._kernels
        h = self.embed(ids)
        cos, sin = self.rotary(h.unsqueeze(0), positions.unsqueeze(0))
        cos, sin = cos[0], sin[0]
        h, tapped = k.decoder_stack(
            h, self.layers, lambda i: (self._fused[i][0], self._fused[i][2], self.kv.k[i, 0], self.kv.v[i, 0]),
            cos, sin, positions, self.config.num_attention_heads, self.scale,
            taps=self._tap_set if want_features else ())
        last = self.n_layers - 1
        if last in tapped or self._lm_fp32 is not None:  # the tapped tensor is the normed one (see `forward`)
            normed = k.final_norm(h, self.norm)
            tapped[last] = normed
            logits = k.linear(normed, self.lm_head.weight) if self._lm_fp32 is None else self._logits(normed)
        else:  # the final norm folds into the lm_head where it can
            logits = k.normed_linear(h, self.norm, self.lm_head.weight)
        features = torch.cat([tapped[t] for t in self.taps], dim=-1) if want_features and self.taps else None
        return logits, features

    def _layer(self, i, layer, h, positions, cos, sin, mask, length):
        attn = layer.self_attn
        x = _rms(layer.input_layernorm, h)
        t = x.shape[1]
        fused = self._fused[i] if self._fused is not None else None
        if fused is not None:
            q, k, v = torch.nn.functional.linear(x, fused[0]).split(fused[1], dim=-1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q = q.view(1, t, -1, self.head_dim)
        k = k.view(1, t, -1, self.head_dim)
        v = v.view(1, t, -1, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q, k = _rms(attn.q_norm, q), _rms(attn.k_norm, k)
        q = rotate(q.transpose(1, 2), cos, sin)
        k = rotate(k.transpose(1, 2), cos, sin)
        self.kv.write(i, positions, k, v)
        ks, vs = self.kv.read(i, length)
        h = h + attn.o_proj(attend(q, ks, vs, mask, self.scale, self.attn_impl))
        x = _rms(layer.post_attention_layernorm, h)
        if fused is None:
            return h + layer.mlp(x)
        mlp = layer.mlp
        gate, up = torch.nn.functional.linear(x, fused[2]).chunk(2, dim=-1)
        return h + mlp.down_proj(mlp.act_fn(gate) * up)

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
