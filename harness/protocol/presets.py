"""Random-weights models at real shapes, for timing (--random-weights PRESET): nothing is downloaded.

Step time does not depend on weight values, so a target, a dFlash drafter, an xPress head and a vanilla Markov head
are built from configs alone. Large models are constructed on the meta device and materialised directly on the
target device (`to_empty`, then in-place normal init), so a 16 GB target never exists on the CPU. Every number
measured with these models is labelled: "random weights / scripted acceptance" (RANDOM_LABEL) when acceptance is
scripted (DecodeSettings.scripted_accept), as timing at a chosen tau needs, and "random weights" when it is not (the
random models' own acceptance, meaningless as a drafter's quality).

`build_random(preset, backend)` with a meta-device backend builds every module with its shapes and no memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.protocol.algorithms import (DFlashConfig, DFlashDrafter, DFlashModel, MarkovHead, MarkovRefiner,
                                         XPressHead, XPressRefiner, config_for_target, inv_frequencies)
from core.devices import Backend
from core.ops import Ops, TorchOps
from core.errors import UsageError
from harness.decode.loading import make_target
from harness.decode.target import Target
from harness.protocol.preset_names import RANDOM_PRESETS

RANDOM_LABEL = "random weights / scripted acceptance"
RANDOM_ONLY_LABEL = "random weights"  # --random-weights without --scripted-accept: tau is the random models' own
SCRIPTED_LABEL = "scripted acceptance"  # --scripted-accept on real (or trained) weights


def timing_label(config: dict) -> str | None:
    """RANDOM_LABEL for --random-weights with --scripted-accept, RANDOM_ONLY_LABEL without it (the acceptance is
    measured, of random models); SCRIPTED_LABEL for --scripted-accept on real weights (no claim of random weights);
    else None. `config`: config.json or the RunConfig as a dict."""
    scripted = config.get("scripted_accept") is not None
    if config.get("random_weights"):
        return RANDOM_LABEL if scripted else RANDOM_ONLY_LABEL
    return SCRIPTED_LABEL if scripted else None


@dataclass(frozen=True)
class Preset:
    name: str
    family: str                  # qwen3 | llama (transformers config class)
    config: dict                 # the HF config fields that set the shapes
    drafter_layers: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...] | None = None   # None: the z-lab default spacing
    head_rank: int = 256
    head_mlp: int = 512
    markov_rank: int = 256
    stop_ids: tuple[int, ...] = ()
    note: str = ""
    drafter: dict | None = None   # explicit drafter geometry (DFlashConfig fields) where it differs from the target


PRESETS = {
    "qwen3-8b": Preset(
        "qwen3-8b", "qwen3",
        dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
             tie_word_embeddings=False),
        drafter_layers=5, mask_token_id=151669, target_layer_ids=(1, 9, 17, 25, 33), stop_ids=(151643, 151645),
        note="Qwen3-8B shapes; z-lab dFlash drafter (5 layers, taps 1/9/17/25/33); xPress r=256 mlp 512"),
    "smollm2-135m": Preset(
        "smollm2-135m", "llama",
        dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
             rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, rms_norm_eps=1e-5,
             tie_word_embeddings=True),
        drafter_layers=2, mask_token_id=49151, stop_ids=(2,),
        note="SmolLM2-135M shapes (tied embeddings); a 2-layer drafter; mask id = the last vocabulary id"),
    "gemma4-26b-a4b": Preset(
        "gemma4-26b-a4b", "gemma4",
        dict(vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
             layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5, num_attention_heads=16,
             num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
             attention_k_eq_v=True, sliding_window=1024, final_logit_softcapping=30.0,
             hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=128, top_k_experts=8,
             moe_intermediate_size=704, max_position_embeddings=262144, tie_word_embeddings=True,
             hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                 "rope_theta": 1000000.0}}),
        drafter_layers=5, mask_token_id=4, target_layer_ids=(1, 6, 11, 17, 22, 27), stop_ids=(1, 106),
        drafter=dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=5632,
                     layer_types=("sliding_attention",) * 4 + ("full_attention",), sliding_window=2048,
                     rope_theta=1000000.0),
        note="google/gemma-4-26B-A4B-it text backbone (30 layers, 25 sliding + 5 full, 128 experts top-8); "
             "z-lab Gemma dFlash drafter layout (4 sliding + 1 full, taps 1/6/11/17/22/27); docs/SPYRE_GEMMA.md"),
    "gemma4-tiny": Preset(
        "gemma4-tiny", "gemma4",
        dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
             layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"],
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
             num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8, final_logit_softcapping=30.0,
             hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=16, top_k_experts=4,
             moe_intermediate_size=32, max_position_embeddings=1024, tie_word_embeddings=True),
        drafter_layers=3, mask_token_id=4, target_layer_ids=(1, 3, 4), head_rank=16, head_mlp=32, markov_rank=16,
        drafter=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                     layer_types=("sliding_attention",) * 2 + ("full_attention",), sliding_window=8),
        note="CPU tests of the Gemma 4 paths (experts, sliding layers)"),
    "tiny": Preset(
        "tiny", "qwen3",
        dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6,
             tie_word_embeddings=False),
        drafter_layers=2, mask_token_id=511, target_layer_ids=(1, 2), head_rank=16, head_mlp=32, markov_rank=16,
        note="CPU tests"),
}


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise UsageError(f"--random-weights {name!r}: unknown preset; choose one of "
                         f"{', '.join(sorted(RANDOM_PRESETS))}")
    return PRESETS[name]


def hf_config(p: Preset):
    from transformers import LlamaConfig, Qwen3Config
    if p.family == "gemma4":
        from transformers.models.gemma4 import Gemma4TextConfig
        return Gemma4TextConfig(**p.config)
    cls = {"qwen3": Qwen3Config, "llama": LlamaConfig}[p.family]
    return cls(**p.config)


def drafter_config(p: Preset, cfg, block_size: int):
    """The preset's dFlash drafter: the target's geometry, or the preset's own (Gemma's drafter is narrower)."""
    if p.drafter is None:
        return config_for_target(cfg, p.drafter_layers, block_size, p.mask_token_id,
                                 list(p.target_layer_ids) if p.target_layer_ids else None)
    d = {"rms_norm_eps": 1e-6, **p.drafter}
    return DFlashConfig(hidden_size=cfg.hidden_size, num_hidden_layers=p.drafter_layers, vocab_size=cfg.vocab_size,
                        block_size=block_size, num_target_layers=cfg.num_hidden_layers, mask_token_id=p.mask_token_id,
                        target_layer_ids=tuple(p.target_layer_ids), **d)


@dataclass
class RandomModels:
    """A target, its drafter and both refiner heads, all random, at one preset's shapes."""
    preset: Preset
    backend: Backend
    target: Target
    drafter: DFlashDrafter
    xpress_head: XPressHead
    markov_head: MarkovHead
    label: str = RANDOM_LABEL
    refiners: dict = field(default_factory=dict)
    ops: Ops = field(default_factory=TorchOps)  # core.ops, given to every refiner made here

    def use_ops(self, ops: Ops) -> None:
        """The target, the drafter (where its heads fit) and every refiner, now and later, on `ops` (the lab
        compares ops in one process; a run chooses them once, at build_random)."""
        self.target.use_ops(ops)
        c = self.drafter.model.config
        self.drafter.ops = ops.for_heads(c.head_dim, c.num_attention_heads, c.num_key_value_heads,
                                         windows="sliding_attention" in c.layer_types)
        self.ops = ops
        for r in self.refiners.values():
            r.ops = ops

    def refiner(self, method: str, K: int = 0, topc: int = 0):
        """The refiner of an arm: method in ar | drafter-only | markov | xpress (None for the first two)."""
        if method in ("ar", "drafter-only"):
            return None
        key = (method, K, topc)
        if key not in self.refiners:
            if method == "xpress":
                self.refiners[key] = XPressRefiner(self.xpress_head, K, topc=topc, ops=self.ops)
            elif method == "markov":
                self.refiners[key] = MarkovRefiner(self.markov_head, ops=self.ops)
            else:
                raise UsageError(f"unknown method {method!r}")
        return self.refiners[key]

    def target_weight_bytes(self, include_embedding: bool = True) -> int:
        """Bytes of the target's weights (each tied tensor once). Without the embedding: what one step reads."""
        seen, total = set(), 0
        emb = self.target.embed.weight
        for p in self.target.model.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p is emb and not include_embedding and p is not self.target.lm_head.weight:
                continue
            total += p.numel() * p.element_size()
        return total

    def drafter_step_bytes(self) -> int:
        """Weight bytes the dFlash drafter reads in one speculative step: every layer and the target's lm_head
        (again, for the draft rows) to propose, then the context projection and each layer's k/v projections
        to observe the accepted tokens."""
        def size(*tensors):
            return sum(t.numel() * t.element_size() for t in tensors)
        m = self.drafter.model
        propose = size(*m.layers.parameters(), m.norm.weight, self.target.lm_head.weight)
        observe = size(m.fc.weight, m.hidden_norm.weight) + sum(
            size(l.self_attn.k_proj.weight, l.self_attn.v_proj.weight, l.self_attn.k_norm.weight) for l in m.layers)
        return propose + observe


def _init_(module: torch.nn.Module, gen: torch.Generator | None, std: float) -> None:
    """Norm scales one, every other parameter normal(0, std), in place on its device."""
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=gen)


def _materialise(module: torch.nn.Module, backend: Backend, gen, std: float) -> None:
    if backend.device.type == "meta":
        return
    module.to_empty(device=backend.device)
    _init_(module, gen, std)


@torch.no_grad()
def build_random(name: str, backend: Backend, block_size: int = 16, capacity: int = 256, seed: int = 0,
                 std: float = 0.02, fuse: bool = True, ops: Ops | None = None) -> RandomModels:
    """Random target + drafter + xPress head + vanilla Markov head at preset `name`'s shapes on `backend`.

    A meta-device backend gives shapes without memory (for checks); otherwise weights are made on the device.
    `fuse`: Target.fuse_projections (one q/k/v and one gate/up matmul per layer). `ops`: core.ops for
    every model (default torch ops).
    """
    ops = ops or TorchOps()
    from transformers import AutoModelForCausalLM
    p = preset(name)
    cfg = hf_config(p)
    dev, dt = backend.device, backend.dtype
    gen = None if dev.type == "meta" else torch.Generator(device=dev).manual_seed(seed)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dt, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    _materialise(model, backend, gen, std)
    if cfg.tie_word_embeddings:  # to_empty makes new tensors per module: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    if dev.type != "meta":  # the rotary tables are buffers computed at construction: build them on the device
        rotary = model.model.rotary_emb
        with torch.device(dev):
            model.model.rotary_emb = type(rotary)(config=model.config)
        for layer in model.model.layers:  # Gemma 4's per-layer output scalar is a buffer too
            if hasattr(layer, "layer_scalar"):
                layer.layer_scalar.fill_(1.0)
    if p.family == "gemma4" and dev.type == "cuda":
        model.set_experts_implementation("grouped_mm")  # no host sync (capturable), the serving engines' kernel
    dcfg = drafter_config(p, cfg, block_size)
    target = make_target(model, backend, capacity=capacity, taps=dcfg.target_layer_ids, ops=ops)
    if fuse and dev.type != "meta":
        target.fuse_projections()

    with torch.device("meta"):
        dmodel = DFlashModel(dcfg)
    dmodel = dmodel.to(dtype=dt).eval().requires_grad_(False)
    _materialise(dmodel, backend, gen, std)
    dmodel.inv_freq = inv_frequencies(dcfg.head_dim, dcfg.rope_theta, dcfg.rope_scaling).to(dev)  # fp32
    drafter = DFlashDrafter(dmodel, target.embed, target.lm_head, backend, block_size=block_size,
                            capacity=capacity, ops=ops)

    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    with torch.device(dev):
        head = XPressHead(vocab, hidden, p.head_rank, block_size, p.head_mlp)
        markov = MarkovHead("vanilla", vocab, p.markov_rank, hidden)
    if dev.type != "meta":
        _init_(head, gen, std)
        head.mix.L.normal_(0.0, 0.1, generator=gen)  # a mixer that mixes (values do not change the cost)
        _init_(markov, gen, std)
    head = head.to(dtype=dt).eval().requires_grad_(False).fold()  # the runner's order: cast, then fold
    markov = markov.to(dtype=dt).eval().requires_grad_(False)
    return RandomModels(p, backend, target, drafter, head, markov, ops=ops)


class ByteTokenizer:
    """Prompts for random-weights runs: UTF-8 bytes shifted past a few reserved ids, no chat template.

    Random models make meaningless text anyway; this only gives every prompt its realistic length."""
    chat_template = None
    OFFSET = 3

    def __init__(self, vocab_size: int):
        if vocab_size < 256 + self.OFFSET:
            raise UsageError(f"random-weights preset vocabulary {vocab_size} is too small for byte prompts")
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < 256 + self.OFFSET)
        return data.decode("utf-8", errors="replace")
