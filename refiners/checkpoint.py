"""The vocabulary of refiner checkpoints, shared by both readers (refiners.formats, the serving directory, and
refiners.cotrain_pt, the co-training pickle): kinds, key names, the loaded form and the head's shape checks."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.errors import UsageError

XPRESS, MARKOV = "xpress", "markov"
KINDS = (XPRESS, MARKOV)
KIND_NAMES = {XPRESS: "xPress", MARKOV: "Markov"}
KIND_FLAGS = {XPRESS: "--xpress-refiner-path", MARKOV: "--markov-refiner-path"}
ENV_VARS = {XPRESS: "XPRESS_CKPT", MARKOV: "MK_CKPT"}
ARCHITECTURES = {XPRESS: "Qwen3XPressModel", MARKOV: "Qwen3DSparkModel"}

DEFAULT_HUB_FILENAME = "refiner_cotrain.pt"
SERVING_PATTERNS = ["config.json", "*.safetensors"]

XPRESS_HEAD_KEYS = ("w1.weight", "down_h.weight", "down_g.weight", "in_proj.weight", "mix.L",
                    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "w2.weight")
MARKOV_HEAD_KEYS = ("w1.weight", "w2.weight")
HEAD_KEYS = {XPRESS: XPRESS_HEAD_KEYS, MARKOV: MARKOV_HEAD_KEYS}
# Keys only an xPress head has; their presence in a `.pt` marks the kind.
XPRESS_ONLY_KEYS = frozenset(XPRESS_HEAD_KEYS) - frozenset(MARKOV_HEAD_KEYS)
# A buffer (the causal mask) some checkpoints carry; the head rebuilds it, so it is dropped on read.
XPRESS_DROPPED_KEYS = ("mix.tril",)

XPRESS_PREFIX, MARKOV_PREFIX = "xpress_head.", "markov_head."
FOLDED_MIXER_KEY = "mix_L"  # vLLM's serving name of the folded matrix L*tril + I
# vLLM's serving module names of the SwiGLU, accepted as aliases of the training names in a serving directory.
XPRESS_SERVING_ALIASES = {"mlp_gate.weight": "mlp.gate_proj.weight", "mlp_up.weight": "mlp.up_proj.weight",
                          "mlp_down.weight": "mlp.down_proj.weight"}
# speculators' DSpark names (config markov_head_type vanilla / gated / rnn): w1, w2, and the variant's layer
MARKOV_SERVING_NAMES = {"w1.weight": "markov_w1.weight", "w2.weight": "markov_w2.weight",
                        "gate.weight": "gate_proj.weight", "gate.bias": "gate_proj.bias",
                        "cell.weight": "joint_proj.weight", "cell.bias": "joint_proj.bias"}
MARKOV_VARIANTS = ("vanilla", "gated", "rnn")
MARKOV_VARIANT_KEYS = {"vanilla": (), "gated": ("gate.weight", "gate.bias"), "rnn": ("cell.weight", "cell.bias")}

# Training flags of the one head variant the harness implements (xpress.py's pass); checked only when present.
XPRESS_EXPECTED_ARGS = {
    "markov_only": False, "no_hidden": False, "no_perpos": False, "no_global": False, "no_residual": True,
    "no_mixer": False, "no_mlp": False, "input_mode": "concat", "no_sublayer_norm": True, "no_mix_out": True,
    "lowrank_lmhead_shared_rank": 0, "lowrank_base_rank": 0, "input_relu": False,
}
DEFAULT_RANK = 256
DEFAULT_MLP_RATIO = 2


@dataclass
class RefinerCheckpoint:
    kind: str                                   # "xpress" | "markov"
    draft_state: dict[str, torch.Tensor] | None  # co-trained drafter tensors (z-lab names), None = none stored
    head_state: dict[str, torch.Tensor]          # training names; see XPRESS_HEAD_KEYS / MARKOV_HEAD_KEYS
    rank: int
    mlp_hidden: int | None = None               # xPress only
    block_size: int | None = None               # xPress only: the mixer's block (last dim of mix.L)
    step: int | None = None                     # training global_step, when recorded
    source: str = ""                            # the path it was read from
    mixer: str = "raw"                          # "raw" (L, fold at load) | "folded" (L*tril + I, never refold)
    variant: str = "vanilla"                    # Markov only: vanilla | gated | rnn (refiners.markov)
    num_passes: int | None = None               # serving config xpress_num_passes (informative; K is a CLI choice)
    topc: int | None = None                     # serving config xpress_topc / xpress_candidate_topc
    extras: dict = field(default_factory=dict)  # other informative facts (e.g. the serving architectures)

    @property
    def name(self) -> str:
        return KIND_NAMES[self.kind]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _shape(t) -> tuple[int, ...]:
    return tuple(t.shape)


def head_dims(kind: str, head: dict[str, torch.Tensor], where: str, variant: str = "vanilla") -> dict[str, int]:
    """Key set and internal shape consistency of a head; returns its dims (vocab, rank, and for xPress hidden,
    mlp_hidden, block; for a gated or rnn Markov head hidden)."""
    expected = HEAD_KEYS[kind] + (MARKOV_VARIANT_KEYS[variant] if kind == MARKOV else ())
    missing = [k for k in expected if k not in head]
    extra = sorted(k for k in head if k not in expected)
    label = f"{KIND_NAMES[kind]} head in {where}"
    if missing:
        raise UsageError(f"{label}: {len(missing)} missing key(s), e.g. {', '.join(missing[:3])}")
    if extra:
        hint = f" (a {variant} Markov head has {', '.join(expected)})" if kind == MARKOV else ""
        raise UsageError(f"{label}: {len(extra)} unexpected key(s), e.g. {', '.join(extra[:3])}{hint}")
    bad = [k for k in expected if not isinstance(head[k], torch.Tensor)]
    if bad:
        raise UsageError(f"{label}: {bad[0]} is a {type(head[bad[0]]).__name__}, not a tensor")
    w1 = _shape(head["w1.weight"])
    if len(w1) != 2:
        raise UsageError(f"{label}: w1.weight has shape {list(w1)}, expected [vocab, rank]")
    vocab, rank = w1
    dims = {"vocab": vocab, "rank": rank}
    want = {"w1.weight": (vocab, rank), "w2.weight": (vocab, rank)}
    if kind == XPRESS:
        dh, mix, gate = _shape(head["down_h.weight"]), _shape(head["mix.L"]), _shape(head["mlp.gate_proj.weight"])
        if len(dh) != 2 or len(mix) != 3 or len(gate) != 2:
            raise UsageError(f"{label}: down_h.weight {list(dh)}, mix.L {list(mix)} and mlp.gate_proj.weight "
                             f"{list(gate)} must be [rank, hidden], [rank, B, B] and [mlp, rank]")
        hidden, block, mlp = dh[1], mix[-1], gate[0]
        dims.update(hidden=hidden, block=block, mlp_hidden=mlp)
        want.update({"down_h.weight": (rank, hidden), "down_g.weight": (rank, hidden),
                     "in_proj.weight": (rank, 3 * rank), "mix.L": (rank, block, block),
                     "mlp.gate_proj.weight": (mlp, rank), "mlp.up_proj.weight": (mlp, rank),
                     "mlp.down_proj.weight": (rank, mlp)})
    if kind == MARKOV and variant != "vanilla":
        name, fixed, rows = ("gate", rank, rank) if variant == "gated" else ("cell", 2 * rank, 3 * rank)
        w = _shape(head[f"{name}.weight"])
        if len(w) != 2 or w[1] <= fixed:
            raise UsageError(f"{label}: {name}.weight has shape {list(w)}, expected [{rows}, hidden + {fixed}]")
        dims["hidden"] = w[1] - fixed
        want.update({f"{name}.weight": (rows, w[1]), f"{name}.bias": (rows,)})
    for k, shape in want.items():
        if _shape(head[k]) != shape:
            basis = "w1, down_h, mix.L and mlp.gate_proj" if kind == XPRESS else "w1"
            raise UsageError(f"{label}: {k} has shape {list(_shape(head[k]))}, expected {list(shape)} "
                             f"(from the shapes of {basis})")
    return dims


def _detect_kind_from_keys(head: dict) -> str:
    return XPRESS if any(k in XPRESS_ONLY_KEYS or k in XPRESS_DROPPED_KEYS for k in head) else MARKOV


def _check_kind(found: str, expect_kind: str | None, where: str, evidence: str) -> None:
    if expect_kind is None or found == expect_kind:
        return
    if expect_kind not in KINDS:
        raise ValueError(f"expect_kind must be one of {KINDS} or None, not {expect_kind!r}")
    raise UsageError(f"{where} is a {KIND_NAMES[found]}-head checkpoint ({evidence}), but a "
                     f"{KIND_NAMES[expect_kind]} head was expected; pass it with {KIND_FLAGS[found]}")


def recorded_step(folder) -> int | None:
    """The training step a serving folder's weights were exported at: `train_state.json`'s global_step, which
    python -m training writes beside every export (None when the folder has none, or it is unreadable)."""
    import json
    from pathlib import Path
    try:
        step = json.loads((Path(folder) / "train_state.json").read_text()).get("global_step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None
