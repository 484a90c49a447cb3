"""dFlash block-diffusion drafter, weight-compatible with the z-lab checkpoints.

Per block, the input is [anchor, mask x (B-1)] embedded with the target's embedding. Every layer attends, without
a causal mask, over the K/V of the committed context (projected target features, computed once per position and
kept in a static cache) and of the block itself. Row k >= 1 of the output, through the target's lm_head, predicts
the token at anchor position + k ("fill-in" layout).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from core.cache import StaticKV
from core.checkpoints import DRAFTER_IGNORED_KEYS as IGNORED_KEYS
from core.checkpoints import check_state, read_config, read_tensors, shard_files, tensor_shapes, write_safetensors_dir
from core.devices import Backend
from core.errors import UsageError
from core.ops import Ops, TorchOps, fuse_rows
from core.protocols import Proposal
from drafters.layer_kinds import block_spans
from drafters.rope import cos_sin, inv_frequencies, rope_settings

LAYER_KINDS = ("full_attention", "sliding_attention")  # masks: drafters.layer_kinds



def default_layer_ids(n_target_layers: int, n_draft_layers: int) -> list[int]:
    """Evenly spaced taps from layer 1 to layer N-3 (the z-lab rule; [1, 9, 17, 25, 33] for 36 layers, 5 taps).
    A target too shallow for the rule's span to hold distinct taps (it gave [1, 1] for 4 layers) spreads them over
    every layer instead; more taps than layers is refused (UsageError)."""
    if n_draft_layers > n_target_layers:
        raise UsageError(f"a drafter of {n_draft_layers} layers taps {n_draft_layers} distinct target layers, and "
                         f"the target has {n_target_layers}: use at most {n_target_layers} drafter layers")
    if n_draft_layers == 1:
        return [n_target_layers // 2]
    span = n_target_layers - 4
    if span >= n_draft_layers - 1:  # the rule's layers 1..N-3 hold a distinct tap each
        return [int(round(1 + i * span / (n_draft_layers - 1))) for i in range(n_draft_layers)]
    return [int(round(i * (n_target_layers - 1) / (n_draft_layers - 1))) for i in range(n_draft_layers)]


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    block_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_types: tuple[str, ...]
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=lambda: {"rope_type": "default"})
    max_position_embeddings: int = 32768
    sliding_window: int | None = None  # for sliding_attention layers (causal, windowed); full layers: non-causal

    @classmethod
    def from_dict(cls, d: dict, where: str = "drafter config") -> "DFlashConfig":
        from core.speculators_layout import is_speculators, zlab_config
        if is_speculators(d):  # the speculators/vLLM layout: read as the equivalent z-lab config
            d = zlab_config(d, where)

        def need(key):
            if key not in d:
                raise UsageError(f"{where}: field {key!r} is missing")
            return d[key]
        block = need("block_size")
        if not isinstance(block, int) or isinstance(block, bool) or block < 2:
            raise UsageError(f"{where}: block_size must be an integer >= 2 (got {block!r}); block 1 is plain AR")
        dfc = d.get("dflash_config")
        if not isinstance(dfc, dict) or "mask_token_id" not in dfc or dfc["mask_token_id"] is None:
            raise UsageError(f"{where}: dflash_config.mask_token_id is missing; the drafter fills draft slots "
                             "with it and cannot run without it")
        n_layers = int(need("num_hidden_layers"))
        n_target = int(need("num_target_layers"))
        ids = dfc.get("target_layer_ids") or default_layer_ids(n_target, n_layers)
        types = tuple(d.get("layer_types") or ["full_attention"] * n_layers)
        if len(types) != n_layers:
            raise UsageError(f"{where}: layer_types has {len(types)} entries for {n_layers} layers")
        bad = [t for t in types if t not in LAYER_KINDS]
        if bad:
            raise UsageError(f"{where}: layer type {bad[0]!r} is not supported (only {', '.join(LAYER_KINDS)})")
        window = d.get("sliding_window")
        if "sliding_attention" in types and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise UsageError(f"{where}: sliding_attention layers need an integer sliding_window >= 1 "
                             f"(got {window!r})")
        if d.get("attention_bias"):
            raise UsageError(f"{where}: attention_bias=true is not a dFlash (Qwen3) drafter")
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        theta, scaling = rope_settings(d)
        return cls(hidden_size=hidden, intermediate_size=int(need("intermediate_size")), num_hidden_layers=n_layers,
                   num_attention_heads=heads, num_key_value_heads=int(d.get("num_key_value_heads", heads)),
                   head_dim=int(d.get("head_dim") or hidden // heads), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                   vocab_size=int(need("vocab_size")), block_size=block, num_target_layers=n_target,
                   mask_token_id=int(dfc["mask_token_id"]), target_layer_ids=tuple(int(i) for i in ids),
                   layer_types=types, rope_theta=theta, rope_scaling=scaling,
                   max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
                   sliding_window=window if "sliding_attention" in types else None)

    def to_dict(self) -> dict:
        """The z-lab config.json layout (a Qwen3 config plus the dFlash fields)."""
        return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "vocab_size": self.vocab_size,
                "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
                "rope_theta": self.rope_theta,
                "rope_scaling": None if self.rope_scaling.get("rope_type") == "default" else self.rope_scaling,
                "max_position_embeddings": self.max_position_embeddings, "block_size": self.block_size,
                "num_target_layers": self.num_target_layers, "layer_types": list(self.layer_types),
                **({"sliding_window": self.sliding_window} if self.sliding_window else {}),
                "dflash_config": {"mask_token_id": self.mask_token_id,
                                  "target_layer_ids": list(self.target_layer_ids)}}

    def check_target(self, target_config, where: str = "drafter") -> None:
        """Compatibility with the target, from configs alone (before any weights are read)."""
        n = target_config.num_hidden_layers
        if self.hidden_size != target_config.hidden_size:
            raise UsageError(f"{where}: hidden size {self.hidden_size} differs from the target's "
                             f"{target_config.hidden_size}; it was trained for another target")
        if self.num_target_layers not in (0, n):  # 0: not recorded (speculators configs need not say)
            raise UsageError(f"{where}: built for a {self.num_target_layers}-layer target, this target has {n} layers")
        bad = [i for i in self.target_layer_ids if not 0 <= i < n]
        if bad:
            raise UsageError(f"{where}: target_layer_ids {list(self.target_layer_ids)} reach layer {bad[0]}, "
                             f"beyond the target's {n} layers (0..{n - 1})")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise UsageError(f"{where}: target_layer_ids {list(self.target_layer_ids)} repeat a layer")
        if not 0 <= self.mask_token_id < target_config.vocab_size:
            raise UsageError(f"{where}: mask_token_id {self.mask_token_id} is outside the target's embedding "
                             f"(vocab {target_config.vocab_size})")

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        h, hd = self.hidden_size, self.head_dim
        shapes = {"fc.weight": (h, h * len(self.target_layer_ids)), "hidden_norm.weight": (h,), "norm.weight": (h,)}
        for i in range(self.num_hidden_layers):
            p = f"layers.{i}."
            shapes.update({
                p + "self_attn.q_proj.weight": (self.num_attention_heads * hd, h),
                p + "self_attn.k_proj.weight": (self.num_key_value_heads * hd, h),
                p + "self_attn.v_proj.weight": (self.num_key_value_heads * hd, h),
                p + "self_attn.o_proj.weight": (h, self.num_attention_heads * hd),
                p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (self.intermediate_size, h),
                p + "mlp.up_proj.weight": (self.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, self.intermediate_size),
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        return shapes


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fused normalisation (fp32 inside, rounded once to x's dtype), then the weight: the textbook result in
        # two kernels instead of about seven
        return self.weight * nn.functional.rms_norm(x, self.weight.shape, None, self.eps)


class _Attention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        hd = c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * hd, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)


class _MLP(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class DFlashModel(nn.Module):
    """The weights and the two forward pieces; state-dict keys are exactly the z-lab ones."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(c.hidden_size * len(c.target_layer_ids), c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("inv_freq", inv_frequencies(c.head_dim, c.rope_theta, c.rope_scaling), persistent=False)
        self._fused: list = []  # per layer: (q/k/v weight, gate/up weight), views shared with the modules

    @torch.no_grad()
    def fuse(self) -> list:
        """q/k/v and gate/up as one weight each (views: no memory added, the modules still work); once."""
        if not self._fused:
            self._fused = [(fuse_rows((l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj)),
                            fuse_rows((l.mlp.gate_proj, l.mlp.up_proj))) for l in self.layers]
        return self._fused

    def _apply(self, fn, recurse=True):
        # Rotary frequencies stay fp32 whatever the weights' dtype: in bf16, position x frequency would lose whole
        # radians at a few thousand tokens. Rebuilt after every move or cast, on the weights' device.
        super()._apply(fn, recurse)
        c = self.config
        self.inv_freq = inv_frequencies(c.head_dim, c.rope_theta, c.rope_scaling).to(self.norm.weight.device)
        self._fused = []  # a move or cast makes new tensors: fuse again
        return self

    @torch.no_grad()
    def write_context(self, features: torch.Tensor, positions: torch.Tensor, kv: StaticKV,
                      ops: Ops | None = None) -> None:
        """Context K/V from projected target features; they do not depend on the block, so each position once.
        k and v rows are adjacent in the fused q/k/v weight: one matmul and one cache write per layer."""
        c = self.config
        ops = (ops or TorchOps()).sized(features.shape[0], c.num_attention_heads // c.num_key_value_heads)
        ctx = ops.rms_norm(ops.linear(features, self.fc.weight), self.hidden_norm.weight, self.hidden_norm.eps)
        cos, sin = cos_sin(self.inv_freq, positions, ctx.dtype)
        q_rows = c.num_attention_heads * c.head_dim
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            ops.write_kv(ops.linear(ctx, self.fuse()[i][0][q_rows:]), kv, i, positions, cos, sin, a.k_norm.weight,
                         a.k_norm.eps)

    @torch.no_grad()
    def block(self, x: torch.Tensor, positions: torch.Tensor, kv: StaticKV, limit: torch.Tensor,
              length: int, ops: Ops | None = None) -> torch.Tensor:
        """x [B, H] block embeddings at `positions`; attends over slots < limit (limit - 1 is the block's last
        position). Returns normed hidden [B, H]. ops: the drafter's (default torch ops)."""
        c = self.config
        ops = (ops or TorchOps()).sized(x.shape[0], c.num_attention_heads // c.num_key_value_heads)
        cos, sin = cos_sin(self.inv_freq, positions, x.dtype)
        spans = block_spans(c, positions, limit, length)
        h = x
        for i, layer in enumerate(self.layers):
            a, (qkv_w, gate_up_w) = layer.self_attn, self.fuse()[i]
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            qkv = ops.linear(h, qkv_w, norm=ln1.weight, eps=ln1.eps)
            o = ops.attention(qkv, kv, i, spans[c.layer_types[i]], cos, sin, c.num_attention_heads,
                              c.head_dim ** -0.5, a.q_norm.weight, a.k_norm.weight, a.q_norm.eps)
            h = ops.linear(o, a.o_proj.weight, residual=h)
            gate_up = ops.linear(h, gate_up_w, norm=ln2.weight, eps=ln2.eps)
            h = ops.linear(gate_up, layer.mlp.down_proj.weight, act="silu", residual=h)
        return ops.rms_norm(h, self.norm.weight, self.norm.eps)  # the proposal's hidden rows are the normed ones


class DFlashDrafter:
    """The Drafter protocol over a DFlashModel, the target's embedding and lm_head, and a static context cache."""

    def __init__(self, model: DFlashModel, embed: nn.Module, lm_head: nn.Module, backend: Backend,
                 block_size: int | None = None, capacity: int = 256, ops: Ops | None = None):
        c = model.config
        self.model, self.embed, self.lm_head = model, embed, lm_head
        self.ops = (ops or TorchOps()).for_heads(c.head_dim, c.num_attention_heads, c.num_key_value_heads,
                                                 windows="sliding_attention" in c.layer_types)
        model.fuse()
        # A block other than the trained one is allowed (the attention is shape-agnostic); acceptance may drop.
        self.block_size, self.mask_token_id = block_size or c.block_size, c.mask_token_id
        self.target_layer_ids = c.target_layer_ids
        self.kv = StaticKV(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, capacity, backend.dtype,
                           backend.device)
        self.ctx = torch.zeros((), dtype=torch.long, device=backend.device)
        self._offsets = torch.arange(self.block_size, device=backend.device)
        self._masks = torch.full((self.block_size - 1,), c.mask_token_id, dtype=torch.long, device=backend.device)

    def ensure_capacity(self, n: int) -> None:
        # observe() writes a full verify width past the committed context; keep room for it.
        self.kv.ensure(n + self.block_size)

    def begin(self, features: torch.Tensor) -> None:
        n = features.shape[0]
        self.model.write_context(features, torch.arange(n, device=features.device), self.kv, self.ops)
        self.ctx.fill_(n)

    def observe(self, features: torch.Tensor, count: torch.Tensor) -> None:
        positions = self.ctx + self._offsets[: features.shape[0]]
        self.model.write_context(features, positions, self.kv, self.ops)
        self.ctx.add_(count)

    @torch.no_grad()
    def propose(self, anchor: torch.Tensor, position: torch.Tensor, length: int) -> Proposal:
        ids = torch.cat((anchor.view(1), self._masks))
        positions = position + self._offsets
        hidden = self.model.block(self.embed(ids), positions, self.kv, position + self.block_size, length, self.ops)
        c = self.model.config
        ops = self.ops.sized(self.block_size, c.num_attention_heads // c.num_key_value_heads)
        logits, tokens = ops.linear(hidden[1:], self.lm_head.weight,
                                    bias=self.lm_head.bias, argmax=True)
        return Proposal(tokens=tokens, logits=logits, hidden=hidden)


# --- checkpoints -----------------------------------------------------------------------------------------------

def read_dflash_config(path: str | Path) -> DFlashConfig:
    return DFlashConfig.from_dict(read_config(path, "--draft-name-or-path"), f"drafter config {path}")


def check_dflash_checkpoint(path: str | Path, config: DFlashConfig) -> list[Path]:
    """Key set and shapes from the safetensors headers; returns the shard files."""
    files = shard_files(path, "--draft-name-or-path")
    check_state(config.expected_shapes(), tensor_shapes(files), f"drafter {path}", ignored=IGNORED_KEYS)
    return files


def load_dflash(path: str | Path, config: DFlashConfig, backend: Backend) -> DFlashModel:
    files = check_dflash_checkpoint(path, config)
    model = DFlashModel(config)
    state = read_tensors(files, set(config.expected_shapes()))
    model.load_state_dict(state, strict=True)
    return model.to(device=backend.device, dtype=backend.dtype).eval()


def save_dflash(model: DFlashModel, path: str | Path) -> None:
    write_safetensors_dir(path, model.config.to_dict(), model.state_dict())


def random_dflash(config: DFlashConfig, seed: int = 0, std: float = 0.02) -> DFlashModel:
    """Random weights at a given shape, for tests and timing; norms start at one as in training."""
    g = torch.Generator().manual_seed(seed)
    model = DFlashModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model.eval()


def config_for_target(target_config, n_layers: int, block_size: int, mask_token_id: int,
                      target_layer_ids: list[int] | None = None, intermediate_size: int | None = None) -> DFlashConfig:
    """A drafter config that matches a target's geometry (used by the random presets and the tests)."""
    t = target_config
    heads = t.num_attention_heads
    theta, scaling = rope_settings(t.to_dict())
    n_t = t.num_hidden_layers
    return DFlashConfig(hidden_size=t.hidden_size, intermediate_size=intermediate_size or t.intermediate_size,
                        num_hidden_layers=n_layers, num_attention_heads=heads,
                        num_key_value_heads=getattr(t, "num_key_value_heads", heads),
                        head_dim=getattr(t, "head_dim", None) or t.hidden_size // heads,
                        rms_norm_eps=float(getattr(t, "rms_norm_eps", 1e-6)), vocab_size=t.vocab_size,
                        block_size=block_size, num_target_layers=n_t, mask_token_id=mask_token_id,
                        target_layer_ids=tuple(target_layer_ids or default_layer_ids(n_t, n_layers)),
                        layer_types=("full_attention",) * n_layers, rope_theta=theta, rope_scaling=scaling,
                        max_position_embeddings=int(getattr(t, "max_position_embeddings", 32768)))
