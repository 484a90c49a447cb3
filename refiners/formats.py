"""Refiner-head checkpoints: the co-training `.pt` and the serving directory, read into one in-memory form.

Two on-disk layouts hold a refiner head (xPress or the Markov baseline) together with its co-trained dFlash drafter:

* the co-training pickle (`refiner_cotrain*.pt`): a dict with `draft_state_dict`, `refiner_state_dict`, `args`
  (the training argparse Namespace, or a plain dict) and `global_step`. It is read with `weights_only=True` and only
  `argparse.Namespace` allow-listed; anything else in the pickle is refused unless the caller trusts the file.
* the serving directory (the vLLM converter output): `config.json` (the dFlash config plus `xpress_*` or
  `markov_rank` fields) and `model.safetensors` (or shards) holding the drafter tensors without a prefix and the head
  tensors under `xpress_head.` / `markov_head.`.

Both are returned as a `RefinerCheckpoint` whose `head_state` uses the TRAINING key names (`w1.weight`, `mix.L`,
`mlp.gate_proj.weight`, ...). The xPress mixer is normally raw (`mixer="raw"`: L, to be folded at load as
L*tril + I); a serving state that already holds the folded matrix (`xpress_head.mix_L`) is returned with
`mixer="folded"` and the folded matrix under `mix.L`, and must never be folded a second time.

Hub ids (`user/repo`, `user/repo:file`) are resolved by `resolve_refiner_path`, see there. The `.pt` reader lives
in refiners.cotrain_pt; `load_refiner_checkpoint` picks the reader.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness.checkpoints import check_state, read_config, read_tensors, shard_files, tensor_shapes
from harness.errors import UsageError

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
MARKOV_SERVING_NAMES = {"w1.weight": "markov_w1.weight", "w2.weight": "markov_w2.weight"}

# Training flags of the head variant the harness implements (REFERENCE 5.5 step 2); checked only when present.
XPRESS_EXPECTED_ARGS = {
    "markov_only": False, "no_hidden": False, "no_perpos": False, "no_global": False, "no_residual": True,
    "no_mixer": False, "no_mlp": False, "input_mode": "concat", "no_sublayer_norm": True, "no_mix_out": True,
    "lowrank_lmhead_shared_rank": 0, "lowrank_base_rank": 0, "input_relu": False,
}
DEFAULT_RANK = 256
DEFAULT_MLP_RATIO = 2
MARKOV_VARIANTS_UNSUPPORTED = ("gated", "rnn")


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
    num_passes: int | None = None               # serving config xpress_num_passes (informative; K is a CLI choice)
    topc: int | None = None                     # serving config xpress_topc / xpress_candidate_topc
    extras: dict = field(default_factory=dict)  # other informative facts (e.g. the serving architectures)

    @property
    def name(self) -> str:
        return KIND_NAMES[self.kind]


# --- path resolution -------------------------------------------------------------------------------------------

_HUB_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9_.\-]+")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _is_remote_missing(e: BaseException) -> bool:
    """The repo answered, and the file is not in it (as opposed to a network, auth or offline failure)."""
    try:
        from huggingface_hub import errors
    except ImportError:  # pragma: no cover - huggingface_hub is a requirement
        return False
    remote = getattr(errors, "RemoteEntryNotFoundError", None)
    if remote is not None and isinstance(e, remote):
        return True
    local = getattr(errors, "LocalEntryNotFoundError", ())
    return isinstance(e, errors.EntryNotFoundError) and not isinstance(e, local)


def resolve_refiner_path(value: str | None, env_var: str) -> str | None:
    """A local path for a refiner checkpoint given on the command line or in `env_var`; None when neither is set.

    Accepted forms:
    * an existing local file (a co-training `.pt`) or directory (the serving layout), used as is;
    * `user/repo:FILE`: FILE is downloaded with `hf_hub_download` (FILE may name a hub subfolder, `sub/x.pt`);
      if FILE is `config.json` or ends in `.safetensors`, the repo's serving layout is fetched instead
      (`snapshot_download` of config.json and *.safetensors) and its directory is returned;
    * `user/repo`: `refiner_cotrain.pt` is downloaded, as the reference does; only if the repo answers that it has
      no such file, the serving layout is fetched instead. A network, auth or offline failure is an error, never
      a silent switch of format.
    The repo part must contain exactly one '/' and no spaces. Any failure is a one-line UsageError.
    """
    source = ""
    if value is None or value == "":
        value = os.environ.get(env_var) or None
        source = f" (from ${env_var})"
        if value is None:
            return None
    text = value.strip()
    local = Path(text).expanduser()
    if local.exists():
        return str(local)
    repo, sep, filename = text.partition(":")
    if (not _HUB_REPO.fullmatch(repo) or (sep and not filename) or any(c.isspace() for c in text)
            or text.startswith(("/", ".", "~"))):
        raise UsageError(f"refiner checkpoint {text!r}{source}: no such file or directory, and not a Hugging Face "
                         "hub id; accepted forms: a local .pt file, a local serving directory (config.json + "
                         "*.safetensors), 'user/repo' or 'user/repo:file.pt'")
    import huggingface_hub
    serving = sep and (filename == "config.json" or filename.endswith(".safetensors"))
    if not serving:
        name = filename or DEFAULT_HUB_FILENAME
        try:
            return str(huggingface_hub.hf_hub_download(repo_id=repo, filename=name))
        except Exception as e:  # noqa: BLE001 - every hub failure becomes one line
            if filename or not _is_remote_missing(e):
                raise UsageError(f"refiner checkpoint {text!r}{source}: not a local path, and downloading {name} "
                                 f"from the hub repo {repo} failed ({_first_line(e)})") from None
    try:
        return str(huggingface_hub.snapshot_download(repo_id=repo, allow_patterns=list(SERVING_PATTERNS)))
    except Exception as e:  # noqa: BLE001
        why = "" if serving else f"it has no {DEFAULT_HUB_FILENAME}, and "
        raise UsageError(f"refiner checkpoint {text!r}{source}: {why}downloading the serving layout "
                         f"(config.json + *.safetensors) from the hub repo {repo} failed ({_first_line(e)})") from None


# --- head structure --------------------------------------------------------------------------------------------

def _shape(t) -> tuple[int, ...]:
    return tuple(t.shape)


def head_dims(kind: str, head: dict[str, torch.Tensor], where: str) -> dict[str, int]:
    """Key set and internal shape consistency of a head; returns its dims (vocab, rank, and for xPress hidden,
    mlp_hidden, block)."""
    expected = HEAD_KEYS[kind]
    missing = [k for k in expected if k not in head]
    extra = sorted(k for k in head if k not in expected)
    label = f"{KIND_NAMES[kind]} head in {where}"
    if missing:
        raise UsageError(f"{label}: {len(missing)} missing key(s), e.g. {', '.join(missing[:3])}")
    if extra:
        hint = " (only the vanilla Markov head, w1/w2, is supported)" if kind == MARKOV else ""
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


# --- serving directory -------------------------------------------------------------------------------------------

def _config_int(cfg: dict, key: str, where: str) -> int | None:
    v = cfg.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise UsageError(f"{where}: config field {key}={v!r} must be a non-negative integer")
    return v


def _detect_serving_kind(cfg: dict, keys: set[str], where: str) -> str:
    found = set()
    if any(k.startswith("xpress_") for k in cfg) or any(k.startswith(XPRESS_PREFIX) for k in keys):
        found.add(XPRESS)
    if "markov_rank" in cfg or "markov_head_type" in cfg or any(k.startswith(MARKOV_PREFIX) for k in keys):
        found.add(MARKOV)
    if len(found) == 2:
        raise UsageError(f"{where}: holds both xPress (xpress_*) and Markov (markov_*) head fields or tensors; "
                         "expected one head")
    if not found:
        arch = cfg.get("architectures")
        raise UsageError(f"{where}: no refiner head found (no xpress_*/markov_rank config field, no {XPRESS_PREFIX}/"
                         f"{MARKOV_PREFIX} tensors; architectures={arch!r}); is this a plain dFlash drafter?")
    return found.pop()


def load_serving_dir(path: str | Path, expect_kind: str | None = None) -> RefinerCheckpoint:
    d = Path(path)
    where = f"refiner checkpoint {d}"
    cfg = read_config(d, "refiner checkpoint")
    from refiners.speculators_layout import is_speculators, load_dir
    if is_speculators(cfg):  # the speculators/vLLM layout (training/ writes it)
        return load_dir(d, cfg, expect_kind)
    files = shard_files(d, "refiner checkpoint")
    keys = set(tensor_shapes(files))
    kind = _detect_serving_kind(cfg, keys, where)
    _check_kind(kind, expect_kind, where, "from its config fields and tensor names")
    if cfg.get("sample_from_anchor"):
        raise UsageError(f"{where}: sample_from_anchor=true (the DSpark anchor layout) is not supported; the harness "
                         "uses the fill-in layout")
    tensors = read_tensors(files)
    prefix = XPRESS_PREFIX if kind == XPRESS else MARKOV_PREFIX
    raw_head = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    draft = {k: v for k, v in tensors.items() if not k.startswith(prefix)}
    stray = sorted(k for k in draft if k.startswith((XPRESS_PREFIX, MARKOV_PREFIX)))
    if stray:
        raise UsageError(f"{where}: tensor {stray[0]} belongs to the other head kind")
    mixer, head = "raw", {}
    if kind == XPRESS:
        if "mix.L" in raw_head and FOLDED_MIXER_KEY in raw_head:
            raise UsageError(f"{where}: holds both {XPRESS_PREFIX}mix.L (raw) and {XPRESS_PREFIX}{FOLDED_MIXER_KEY} "
                             "(folded); cannot tell which one is meant")
        for k, v in raw_head.items():
            if k in XPRESS_DROPPED_KEYS:
                continue
            if k == FOLDED_MIXER_KEY:
                mixer, k = "folded", "mix.L"
            elif k in XPRESS_SERVING_ALIASES:
                if XPRESS_SERVING_ALIASES[k] in raw_head:
                    raise UsageError(f"{where}: holds both {prefix}{k} and {prefix}{XPRESS_SERVING_ALIASES[k]}")
                k = XPRESS_SERVING_ALIASES[k]
            head[k] = v
    else:
        variant = cfg.get("markov_head_type", "vanilla")
        if variant != "vanilla":
            raise UsageError(f"{where}: Markov head variant {variant!r} is not supported (only 'vanilla', w1/w2)")
        back = {v: k for k, v in MARKOV_SERVING_NAMES.items()}
        head = {back.get(k, k): v for k, v in raw_head.items()}
        unknown = sorted(k for k in raw_head if k not in back)
        if unknown:
            raise UsageError(f"{where}: unexpected Markov head tensor(s), e.g. "
                             f"{', '.join(prefix + k for k in unknown[:3])} (only the vanilla Markov head, "
                             f"{prefix}markov_w1.weight and {prefix}markov_w2.weight, is supported)")
    dims = head_dims(kind, head, str(d))
    ck = RefinerCheckpoint(kind=kind, draft_state=draft or None, head_state=head, rank=dims["rank"], source=str(d),
                           mixer=mixer, extras={"architectures": cfg.get("architectures")})
    if kind == XPRESS:
        ck.mlp_hidden, ck.block_size = dims["mlp_hidden"], dims["block"]
        for key, value, what in (("xpress_rank", ck.rank, "w1.weight width"),
                                 ("xpress_mlp_hidden", ck.mlp_hidden, "mlp.gate_proj.weight rows"),
                                 ("xpress_block_size", ck.block_size, "mix.L block")):
            got = _config_int(cfg, key, where)
            if got is not None and got != value:
                raise UsageError(f"{where}: config {key}={got} differs from the tensors' {what} {value}")
        ck.num_passes = _config_int(cfg, "xpress_num_passes", where)
        topc = [_config_int(cfg, k, where) for k in ("xpress_topc", "xpress_candidate_topc")]
        topc = [t for t in topc if t is not None]
        if len(set(topc)) > 1:
            raise UsageError(f"{where}: xpress_topc and xpress_candidate_topc disagree ({topc[0]} vs {topc[1]})")
        ck.topc = topc[0] if topc else None
    else:
        got = _config_int(cfg, "markov_rank", where)
        if got is not None and got != ck.rank:
            raise UsageError(f"{where}: config markov_rank={got} differs from the tensors' w1.weight width {ck.rank}")
    return ck


# --- entry points ----------------------------------------------------------------------------------------------

def load_refiner_checkpoint(path: str | Path, expect_kind: str | None, trust_pickle: bool = False) -> RefinerCheckpoint:
    """A co-training `.pt` (a file) or a serving directory; `expect_kind` "xpress"/"markov" refuses the other kind
    (None accepts either). A `config.json` or `*.safetensors` file stands for its directory."""
    if expect_kind is not None and expect_kind not in KINDS:
        raise ValueError(f"expect_kind must be one of {KINDS} or None, not {expect_kind!r}")
    p = Path(path).expanduser()
    if p.is_dir():
        return load_serving_dir(p, expect_kind)
    if p.is_file():
        if p.name == "config.json" or p.name.endswith(".safetensors"):
            return load_serving_dir(p.parent, expect_kind)
        from refiners.cotrain_pt import load_cotrain_pt  # imports this module: loaded on first use
        return load_cotrain_pt(p, expect_kind, trust_pickle)
    raise UsageError(f"refiner checkpoint {path}: no such file or directory")


def validate_against(ckpt: RefinerCheckpoint, vocab_size: int, hidden_size: int, block_size: int | None,
                     draft_expected_shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """Compatibility with the run: target vocab, drafter/target hidden, the run's block (xPress), and the co-trained
    drafter's key set and shapes. Every failure is a one-line UsageError."""
    from drafters.dflash import IGNORED_KEYS
    where = ckpt.source or "refiner checkpoint"
    dims = head_dims(ckpt.kind, ckpt.head_state, where)
    label = f"{ckpt.name} head in {where}"
    if dims["vocab"] != vocab_size:
        raise UsageError(f"{label}: vocab {dims['vocab']} (w1/w2 rows) differs from the target's vocab {vocab_size}; "
                         "it was trained for another target")
    if ckpt.kind == XPRESS:
        if dims["hidden"] != hidden_size:
            raise UsageError(f"{label}: down_h/down_g read hidden size {dims['hidden']}, but the drafter/target "
                             f"hidden size is {hidden_size}; it was trained for another target")
        if block_size is not None and dims["block"] != block_size:
            raise UsageError(f"{label}: the mixer was trained for block {dims['block']}, the run uses block "
                             f"{block_size}; pass --block-size {dims['block']}")
    if ckpt.draft_state is not None and draft_expected_shapes is not None:
        found = {k: _shape(v) for k, v in ckpt.draft_state.items()}
        check_state(draft_expected_shapes, found, f"co-trained drafter in {where}", ignored=IGNORED_KEYS)
