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

import re
from pathlib import Path

from core.checkpoints import check_state, read_config, read_tensors, shard_files, tensor_shapes
from core.errors import UsageError
from refiners.checkpoint import (  # noqa: F401  (re-exported: the checkpoint vocabulary)
    XPRESS, MARKOV, KINDS, KIND_NAMES, KIND_FLAGS, ENV_VARS, ARCHITECTURES, DEFAULT_HUB_FILENAME,
    SERVING_PATTERNS, XPRESS_HEAD_KEYS, MARKOV_HEAD_KEYS, HEAD_KEYS, XPRESS_ONLY_KEYS, XPRESS_DROPPED_KEYS,
    XPRESS_PREFIX, MARKOV_PREFIX, FOLDED_MIXER_KEY, XPRESS_SERVING_ALIASES, MARKOV_SERVING_NAMES,
    XPRESS_EXPECTED_ARGS, MARKOV_VARIANTS, DEFAULT_RANK, DEFAULT_MLP_RATIO, RefinerCheckpoint, _first_line, head_dims, _shape,
    _detect_kind_from_keys, _check_kind)
from refiners.cotrain_pt import load_cotrain_pt

# --- path resolution -------------------------------------------------------------------------------------------

_HUB_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9_.\-]+")


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


def resolve_refiner_path(value: str | None) -> str | None:
    """A local path for the refiner checkpoint `value`; None when it is None or empty (no such arm). The caller
    (the command line) decides where the value comes from, flag or environment; nothing here reads either.

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
    if not value:
        return None
    text = value.strip()
    local = Path(text).expanduser()
    if local.exists():
        return str(local)
    repo, sep, filename = text.partition(":")
    if (not _HUB_REPO.fullmatch(repo) or (sep and not filename) or any(c.isspace() for c in text)
            or text.startswith(("/", ".", "~"))):
        raise UsageError(f"refiner checkpoint {text!r}: no such file or directory, and not a Hugging Face "
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
                raise UsageError(f"refiner checkpoint {text!r}: not a local path, and downloading {name} "
                                 f"from the hub repo {repo} failed ({_first_line(e)})") from None
    try:
        return str(huggingface_hub.snapshot_download(repo_id=repo, allow_patterns=list(SERVING_PATTERNS)))
    except Exception as e:  # noqa: BLE001
        why = "" if serving else f"it has no {DEFAULT_HUB_FILENAME}, and "
        raise UsageError(f"refiner checkpoint {text!r}: {why}downloading the serving layout "
                         f"(config.json + *.safetensors) from the hub repo {repo} failed ({_first_line(e)})") from None


# --- head structure --------------------------------------------------------------------------------------------

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
        if variant not in MARKOV_VARIANTS:
            raise UsageError(f"{where}: markov_head_type {variant!r} is not one of {', '.join(MARKOV_VARIANTS)}")
        back = {v: k for k, v in MARKOV_SERVING_NAMES.items()}
        head = {back.get(k, k): v for k, v in raw_head.items()}
        unknown = sorted(k for k in raw_head if k not in back)
        if unknown:
            raise UsageError(f"{where}: unexpected Markov head tensor(s), e.g. "
                             f"{', '.join(prefix + k for k in unknown[:3])} (DSpark's Markov head: "
                             f"{', '.join(prefix + v for v in MARKOV_SERVING_NAMES.values())})")
    variant = variant if kind == MARKOV else "vanilla"
    dims = head_dims(kind, head, str(d), variant)
    from refiners.checkpoint import recorded_step
    ck = RefinerCheckpoint(kind=kind, draft_state=draft or None, head_state=head, rank=dims["rank"], source=str(d),
                           mixer=mixer, variant=variant, extras={"architectures": cfg.get("architectures")},
                           step=recorded_step(d))
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
        return load_cotrain_pt(p, expect_kind, trust_pickle)
    raise UsageError(f"refiner checkpoint {path}: no such file or directory")


def validate_against(ckpt: RefinerCheckpoint, vocab_size: int, hidden_size: int, block_size: int | None,
                     draft_expected_shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """Compatibility with the run: target vocab, drafter/target hidden, the run's block (xPress), and the co-trained
    drafter's key set and shapes. Every failure is a one-line UsageError."""
    from core.checkpoints import DRAFTER_IGNORED_KEYS as IGNORED_KEYS
    where = ckpt.source or "refiner checkpoint"
    dims = head_dims(ckpt.kind, ckpt.head_state, where, ckpt.variant)
    label = f"{ckpt.name} head in {where}"
    if dims["vocab"] != vocab_size:
        raise UsageError(f"{label}: vocab {dims['vocab']} (w1/w2 rows) differs from the target's vocab {vocab_size}; "
                         "it was trained for another target")
    if "hidden" in dims and dims["hidden"] != hidden_size:
        reads = "down_h/down_g read" if ckpt.kind == XPRESS else f"the {ckpt.variant} layer reads"
        raise UsageError(f"{label}: {reads} hidden size {dims['hidden']}, but the drafter/target "
                         f"hidden size is {hidden_size}; it was trained for another target")
    if ckpt.kind == XPRESS:
        if block_size is not None and dims["block"] != block_size:
            raise UsageError(f"{label}: the mixer was trained for block {dims['block']}, the run uses block "
                             f"{block_size}; pass --block-size {dims['block']}")
    if ckpt.draft_state is not None and draft_expected_shapes is not None:
        found = {k: _shape(v) for k, v in ckpt.draft_state.items()}
        check_state(draft_expected_shapes, found, f"co-trained drafter in {where}", ignored=IGNORED_KEYS)
