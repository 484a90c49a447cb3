"""Pipeline configs: a JSON file (training/configs/NAME.json or any path) plus `--set key.sub=value` overrides.

A config has one section per stage (prompts, responses, hidden, train, export) and `models`: name -> the
speculators model to train (type dflash | xpress | dspark and its sizes). Every field is checked here, before any
model is loaded, so a typo fails in a second with one line."""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

from core.errors import UsageError
from training import config_numbers, cotrain, fit, grow, loss_spec
from training.store import REPO_ROOT, export_digest, repo_path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
MODEL_TYPES = ("dflash", "xpress", "dspark")
MARKOV_TYPES = ("vanilla", "gated", "rnn")
SECTIONS = ("prompts", "responses", "hidden", "train", "export")

DEFAULTS = {
    "target": None,
    "workdir": None,                     # default: runs/<config name>
    "seed": 0,
    "prompts": {"jsonl": [], "jsonl_limit": 0, "magpie": 0, "magpie_max_new_tokens": 64,
                "magpie_temperature": 1.0, "magpie_top_p": 0.95, "magpie_batch": 16, "min_chars": 16,
                "max_chars": 2000, "dedup_jaccard": 0.8, "overlap_jaccard": 0.5, "ngram": 3,
                "eval_dir": "data/eval", "heldout": 8, "selection": 8, "magpie_domains": [], "templates": [],
                # more_magpie: N more Magpie prompts (round more_round) after the pool is split, written apart
                # (more.jsonl) and taken as parts after the pool's: fresh data for a later run, the same split
                "more_magpie": 0, "more_round": 1, "eval_sets": ""},  # eval_sets: pinned sets (eval_sets.py)
    "responses": {"max_new_tokens": 256, "batch_size": 32, "sampled": 1, "temperature": 0.8, "top_p": 0.95,
                  "max_prompt_tokens": 512, "engine": "fast", "max_minutes": 0,   # engine: fast (harness.decode.batched_gen) | hf
                  # attention: the fast engine's decode attention, auto (Triton on CUDA where it runs) | sdpa | triton
                  # first_part: the parts (in the seeded shuffle) before it are not generated: a later session's
                  # fresh data (the warm-start drafter's run wrote parts 0..first_part-1)
                  "first_part": 0, "attention": "auto", "sampled_by_group": {}},  # {group: sampled answers} (responses.py)
    "hidden": {"layer_ids": None, "batch_size": 16, "dtype": "bfloat16", "shard_rows": 0, "mode": "offline",
               "target_dtype": "float32"},
    "train": {"device": "auto", "attn_impl": "auto", "compile": "auto", "flex_kernel_options": "auto",  # compiling.py
              "total_seq_len": 2048, "epochs": 1, "lr": 6e-4,
              "weight_decay": 0.0, "scheduler": "cosine", "warmup_ratio": 0.04, "save_every": 0,
              "eval_every": 0, "eval_prompts": 8, "eval_max_new_tokens": 64, "train_ratio": 0.95,
              "num_workers": 0, "stop_after_step": 0, "cut_at_step": 0, "max_minutes": 0, "on_deadline": "stop", "mask_token_id": None,
              "eval_k": [1], "val_batches": 16, "eval_max_seconds": 60, "eval_share": 0.05, "log_every": 1,
              # warm_mode: resume (the same run continued) | extend (fresh data, its epochs after the warm step) |
              # restart (extend, the LR schedule begun anew there; warm.py)
              "warm_start": None, "warm_mode": "resume", "fit_box": False, "fit_probe_steps": 50, "fit_reserve": 0.1,
              # loss_impl auto: speculators' fused Triton losses on CUDA, its eager ones elsewhere; rows_in_memory: the
              # loaders read the dataset from memory (training/rows.py); profile_steps: torch.profiler over that
              # many steps after the first (training/profiling.py); compile_target: the online target's decoder
              # layers compiled (auto: on CUDA; training/online.py compile_layers); target_groups: a packed row
              # as at most that many right-padded batches of similar lengths (training/online.py length_groups;
              # 1, one batch, the faster on the H200: 36 ms a 32K-token row against 108 with 4, bench_taps_groups/)
              # profile_start: the process's step after which the profile starts (warm-up steps are not steady)
              # taps_cache_gib: the online target's output kept on its device, GiB (0: off; training/online.py TapsCache)
              # compile_cache: a file of torch.compile's artifacts, loaded before the stage, saved after (compiling.py)
              "loss_impl": "auto", "rows_in_memory": True, "profile_steps": 0, "profile_start": 3,
              "compile_target": "auto", "target_groups": 1, "taps_cache_gib": 0, "compile_cache": ""},
    "export": {"dtype": "bfloat16", "max_shard_mib": 15, "max_total_mb": 0},
    # after training: every final model on the whole selection and held-out sets (0: no time cap, every prompt)
    # dtype auto: bfloat16 on CUDA (the decode's CUDA graphs too), the target's float32 elsewhere; bench: data/eval
    # datasets measured the protocol's way, sampled_temperatures each T > 0 sampled too (report only; evaluate.py)
    "acceptance": {"selection_max_seconds": 0, "heldout_max_seconds": 0, "dtype": "auto", "bench": [],
                   "bench_prompts": 32, "bench_max_seconds": 0, "sampled_temperatures": []},
    "models": {},
}

MODEL_DEFAULTS = {
    "type": "dflash", "num_layers": 1, "block_size": 8, "intermediate_size": None, "max_anchors": 512,
    "loss_fn": '{"ce": 0.1, "tv": 0.9}', "gamma": 4.0, "init_from": None, "freeze_backbone": False,
    "xpress_rank": 64, "xpress_mlp_ratio": 2, "num_jacobi_passes": 6, "consistency_weight": 0.3,
    "consistency_passes": 3, "base_anchor_weight": 0.6, "markov_rank": 64, "markov_head_type": "vanilla",
    "enable_confidence_head": True, "per_position_loss_weight": "fixed-exp-decay", "dpace_alpha": loss_spec.DPACE_ALPHA,
    "epochs": None, "lr": None, "max_steps": None, "max_minutes": None, "anchor_bias": 0.0,
    "grow": False, "backbone_lr_scale": 1.0,
}
RANK_KEY = {"xpress": "xpress_rank", "dspark": "markov_rank"}  # a head type's own rank (MODEL_DEFAULTS has both)
MODEL_ADDED_LATER = {"anchor_bias": 0.0, "grow": False, "backbone_lr_scale": 1.0,  # the value models trained before had
                     "per_position_loss_weight": "fixed-exp-decay", "dpace_alpha": loss_spec.DPACE_ALPHA}


NAME_MAPS = ("models", "sampled_by_group")  # sections keyed by names (any key; a child config replaces them whole)


def _merge(base: dict, over: dict, where: str) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if k not in base and where not in NAME_MAPS:
            raise UsageError(f"config: unknown field {where + '.' if where else ''}{k}; known: {', '.join(base)}")
        out[k] = _merge(base[k], v, k) if isinstance(base.get(k), dict) and isinstance(v, dict) and k != "models" \
            else copy.deepcopy(v)
    return out


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_override(cfg: dict, item: str) -> None:
    """`a.b.c=value` (value parsed as JSON when it parses, else a string)."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise UsageError(f"--set {item!r}: expected KEY=VALUE, e.g. train.epochs=2")
    parts = key.split(".")
    node = cfg
    for p in parts[:-1]:
        if not isinstance(node.get(p), dict):
            raise UsageError(f"--set {item!r}: {p!r} is not a config section")
        node = node[p]
    if parts[-1] not in node and not (len(parts) == 3 and parts[0] == "models"):
        raise UsageError(f"--set {item!r}: unknown field {key}")
    node[parts[-1]] = _parse_value(value)


def resolve_config_path(name: str) -> Path:
    p = Path(name)
    if p.suffix == ".json" and p.is_file():
        return p
    candidate = CONFIG_DIR / f"{name}.json"
    if candidate.is_file():
        return candidate
    known = ", ".join(sorted(f.stem for f in CONFIG_DIR.glob("*.json")))
    raise UsageError(f"--config {name}: no such config file and no preset of that name (presets: {known})")


def load_config(name: str, overrides: list[str] = (), workdir: str | None = None) -> dict:
    path = resolve_config_path(name)
    raw = read_raw(path)
    cfg = _merge(DEFAULTS, raw, "")
    for item in overrides:
        apply_override(cfg, item)
    cfg["name"] = path.stem
    if workdir:
        cfg["workdir"] = workdir
    cfg["workdir"] = str(Path(cfg["workdir"] or REPO_ROOT / "runs" / cfg["name"]))
    cfg["models"] = {n: _merge(MODEL_DEFAULTS, m, f"models.{n}") for n, m in cfg["models"].items()}
    validate(cfg)
    return cfg


def read_raw(path: Path, seen: tuple = ()) -> dict:
    """A config file's JSON with its `extends` chain resolved: `"extends": "NAME"` (a preset name or a .json path)
    starts from that config and lays this file's sections over it, field by field, except `models` and
    `responses.sampled_by_group`, which a child that names them replaces whole (a variant that trains fewer models,
    e.g. smollm2-gpu-drafter; `{}` clears a parent's groups)."""
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"config {path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    if not isinstance(parent, str):
        raise UsageError(f"config {path}: extends must be a config name or a .json path, not {parent!r}")
    base_path = resolve_config_path(parent)
    if base_path.resolve() in seen + (path.resolve(),):
        raise UsageError(f"config {path}: extends {parent!r} makes a cycle; a config cannot extend itself")
    return _overlay(read_raw(base_path, seen + (path.resolve(),)), raw)


def _overlay(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if k not in NAME_MAPS and isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _overlay(out[k], v)
        else:
            out[k] = v
    return out


def validate(cfg: dict) -> None:
    if not cfg["target"]:
        raise UsageError("config: target is not set (a hub id, a model directory, a .gguf file or 'smollm2')")
    if not cfg["models"]:
        raise UsageError("config: models is empty; name at least one model to train")
    for name, m in cfg["models"].items():
        where = f"config models.{name}"
        if m["type"] not in MODEL_TYPES:
            raise UsageError(f"{where}: type {m['type']!r} is not one of {', '.join(MODEL_TYPES)}")
        if m["type"] == "dspark" and m["markov_head_type"] not in MARKOV_TYPES:
            raise UsageError(f"{where}: markov_head_type {m['markov_head_type']!r} is not one of "
                             f"{', '.join(MARKOV_TYPES)}")
        if not isinstance(m["block_size"], int) or m["block_size"] < 2:
            raise UsageError(f"{where}: block_size must be an integer >= 2")
        if not isinstance(m["num_layers"], int) or m["num_layers"] < 1:
            raise UsageError(f"{where}: num_layers must be an integer >= 1")
        src = m["init_from"]
        if src is not None and not isinstance(src, str):
            raise UsageError(f"{where}: init_from must be a model name of this config or an exported drafter "
                             f"folder (got {src!r})")
        if src is not None and src not in cfg["models"]:
            check_init_export(cfg, name)
        elif src is not None and cfg["models"][src]["type"] != "dflash":
            raise UsageError(f"{where}: init_from must name a dflash model (got {cfg['models'][src]['type']})")
        for check in (grow.check_options, cotrain.check, loss_spec.check):
            check(where, m)
        ab = m["anchor_bias"]
        if isinstance(ab, bool) or not isinstance(ab, (int, float)) or not 0 <= ab <= 1 or \
                (ab and m["type"] != "dflash"):
            raise UsageError(f"{where}: anchor_bias must be a number in [0, 1], and above 0 only for a dflash drafter "
                             f"(got {ab!r}, type {m['type']}; training/anchors.py)")
        if ab and cfg["train"]["compile"] == "model":
            raise UsageError(f"{where}: anchor_bias is not tested with train.compile=model; use auto or none")
        mm = m["max_minutes"]
        if mm is not None and (not isinstance(mm, (int, float)) or isinstance(mm, bool) or mm <= 0):
            raise UsageError(f"{where}: max_minutes must be a number > 0 (this model's own box) or null")
        if src is not None and src in cfg["models"]:
            theirs = {k: cfg["models"][src][k] for k in ("num_layers", "block_size", "intermediate_size")}
            grow.check_sizes(where, m, theirs, repr(src), folder=False)
    if cfg["train"]["on_deadline"] not in ("stop", "finish"):
        raise UsageError("config train.on_deadline must be stop (checkpoint; the same command resumes) or finish "
                         "(the checkpoint reached at train.max_minutes is the final model)")
    if cfg["train"]["device"] not in ("auto", "cpu", "cuda"):
        raise UsageError("config train.device must be auto, cpu or cuda")
    from training.compiling import MODES, flex_options
    flex_options(cfg["train"]["flex_kernel_options"])
    if cfg["train"]["compile"] not in MODES:
        raise UsageError(f"config train.compile {cfg['train']['compile']!r}: use one of {', '.join(MODES)} "
                         "(training/compiling.py says what each compiles)")
    validate_steps(cfg)
    config_numbers.check(cfg)
    fit.check_schedule(cfg["train"])
    from training.domains import validate_prompts
    validate_prompts(cfg)


HIDDEN_MODES = ("online", "offline")
DTYPE_NAMES = ("bfloat16", "float16", "float32")
LOSS_IMPLS = ("auto", "fused", "eager")
WARM_MODES = ("resume", "extend", "restart")  # train.warm_mode (training/warm.py)
TARGET_COMPILE = ("auto", "layers", "none")  # train.compile_target (training/online.py compile_layers)


def validate_steps(cfg: dict) -> None:
    """hidden.mode/target_dtype, the step size and the bounds on validation, held-out evaluation and logging."""
    h, t = cfg["hidden"], cfg["train"]
    if h["mode"] not in HIDDEN_MODES:
        raise UsageError(f"config hidden.mode {h['mode']!r}: use online (the training step runs the target) or "
                         "offline (hidden_states/ files, speculators' layout)")
    for key in ("dtype", "target_dtype"):
        if h[key] not in DTYPE_NAMES:
            raise UsageError(f"config hidden.{key} {h[key]!r} is not one of {', '.join(DTYPE_NAMES)}")
    for key, low in (("total_seq_len", 1), ("val_batches", 0), ("log_every", 1), ("profile_steps", 0),
                     ("profile_start", 1), ("cut_at_step", 0)):
        if not isinstance(t[key], int) or isinstance(t[key], bool) or t[key] < low:
            raise UsageError(f"config train.{key} must be an integer >= {low} (got {t[key]!r})")
    if not isinstance(t["eval_max_seconds"], (int, float)) or t["eval_max_seconds"] < 0:
        raise UsageError("config train.eval_max_seconds must be a number of seconds >= 0 (0: no cap)")
    rm = cfg["responses"]["max_minutes"]
    if not isinstance(rm, (int, float)) or isinstance(rm, bool) or rm < 0:
        raise UsageError(f"config responses.max_minutes must be a number of minutes >= 0 (0: no box; got {rm!r})")
    sg = cfg["responses"]["sampled_by_group"]
    if not isinstance(sg, dict) or any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in sg.values()):
        raise UsageError(f"config responses.sampled_by_group must map source groups (e.g. \"magpie:math\") to "
                         f"integers >= 0, the sampled answers each prompt of the group gets (got {sg!r})")
    fp = cfg["responses"]["first_part"]
    if not isinstance(fp, int) or isinstance(fp, bool) or fp < 0:
        raise UsageError(f"config responses.first_part must be an integer >= 0 (the first part to generate; got {fp!r})")
    for key in ("fit_box", "rows_in_memory"):
        if not isinstance(t[key], bool):
            raise UsageError(f"config train.{key} must be true or false")
    if t["fit_box"] and not t["max_minutes"] and not any(m.get("max_minutes") for m in cfg["models"].values()):
        raise UsageError("config train.fit_box needs a box: set train.max_minutes or a model's max_minutes (the "
                         "steps are fitted to it)")
    if not isinstance(t["fit_probe_steps"], int) or isinstance(t["fit_probe_steps"], bool) or t["fit_probe_steps"] < 1:
        raise UsageError("config train.fit_probe_steps must be an integer >= 1 (steps timed before the fit)")
    if not isinstance(t["fit_reserve"], (int, float)) or not 0 <= t["fit_reserve"] < 1:
        raise UsageError("config train.fit_reserve must be a fraction in [0, 1) of the box left at the fit")
    if not isinstance(t["eval_share"], (int, float)) or not 0 <= t["eval_share"] <= 1:
        raise UsageError("config train.eval_share must be a fraction in [0, 1] (1: no cap on periodic evaluations)")
    if t["compile_target"] not in TARGET_COMPILE:
        raise UsageError(f"config train.compile_target {t['compile_target']!r}: use one of {', '.join(TARGET_COMPILE)} "
                         "(layers: the online target's decoder layers compiled; auto: on CUDA)")
    if not isinstance(t["target_groups"], int) or isinstance(t["target_groups"], bool) \
            or not 1 <= t["target_groups"] <= 64:
        raise UsageError("config train.target_groups must be an integer in 1..64 (the padded batches the online "
                         "target runs a packed row as; 1: one)")
    if isinstance(gib := t["taps_cache_gib"], bool) or not isinstance(gib, (int, float)) or not 0 <= gib <= 4096:
        raise UsageError("config train.taps_cache_gib must be a number of GiB in [0, 4096] (the online target's "
                         "output kept on its device across epochs; 0: off)")
    if gib and cfg["hidden"]["mode"] != "online":
        raise UsageError("config train.taps_cache_gib needs hidden.mode=online (an offline run reads its hidden states "
                         "from files); set it to 0 or use online")
    if not isinstance(t["compile_cache"], str):
        raise UsageError("config train.compile_cache must be a file path (torch.compile's artifacts) or \"\" (none)")
    if t["loss_impl"] not in LOSS_IMPLS:
        raise UsageError(f"config train.loss_impl {t['loss_impl']!r}: use one of {', '.join(LOSS_IMPLS)} (fused: "
                         "speculators' Triton kernels, CUDA only)")
    if t["loss_impl"] == "fused" and t["device"] == "cpu":
        raise UsageError("config train.loss_impl fused runs on CUDA only; use eager (or auto) with train.device=cpu")
    config_numbers.check_acceptance(cfg, DTYPE_NAMES)
    ws = t["warm_start"]
    if t["warm_mode"] not in WARM_MODES:
        raise UsageError(f"config train.warm_mode {t['warm_mode']!r}: use resume (the same run continued), extend "
                         "(fresh data: its epochs after the warm step, the schedule extended by them) or restart "
                         "(extend with the LR schedule begun anew at the warm step)")
    if ws is not None and not any((repo_path(ws) / f).is_file() for f in ("manifest.json", "heads.json")):
        raise UsageError(f"config train.warm_start {ws}: neither an export folder (manifest.json) nor shipped weights "
                         "(heads.json); give e.g. runs/<config>/export or weights/smollm2-135m")
    grow.check_warm(cfg)


def init_export(cfg: dict, name: str) -> Path | None:
    """models.NAME.init_from as an exported drafter folder (a path, absolute or relative to the repository), or
    None when it names a model of this config (or is unset)."""
    src = cfg["models"][name]["init_from"]
    return None if src is None or src in cfg["models"] else repo_path(src)


def check_init_export(cfg: dict, name: str) -> None:
    """An init_from folder is a dflash export (config.json as the export stage and training.ship write it) whose
    depth and block size are this model's and whose taps are the hidden stage's, checked before anything loads."""
    where, m, d = f"config models.{name}", cfg["models"][name], init_export(cfg, name)
    f = d / "config.json"
    if not f.is_file():
        raise UsageError(f"{where}: init_from {m['init_from']!r} names no model of this config "
                         f"({', '.join(cfg['models'])}) and no exported drafter folder ({f} is missing)")
    try:
        spec = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: init_from {f}: invalid JSON ({e.msg}); export the drafter again") from None
    if spec.get("speculators_model_type") != "dflash":
        raise UsageError(f"{where}: init_from {d} is a {spec.get('speculators_model_type')!r} export; give a dflash "
                         "drafter's folder (e.g. runs/X/export/drafter or weights/smollm2-135m/drafter)")
    layer = spec.get("transformer_layer_config") or {}
    theirs = {"num_layers": layer.get("num_hidden_layers"), "block_size": spec.get("block_size"),
              "intermediate_size": layer.get("intermediate_size")}
    grow.check_sizes(where, m, theirs, str(d), folder=True)
    grow.check_layer_types(where, spec, str(d))
    grow.check_taps(where, m, spec.get("aux_hidden_state_layer_ids"), cfg["hidden"].get("layer_ids"), str(d),
                    "hidden.layer_ids is")


def train_order(cfg: dict) -> list[str]:
    """Models in an order where every init_from source trains first."""
    order, seen = [], set()

    def visit(n):
        if n in seen:
            return
        src = cfg["models"][n]["init_from"]
        if src is not None and src in cfg["models"]:  # an exported folder trains nothing first
            visit(src)
        seen.add(n)
        order.append(n)

    for n in cfg["models"]:
        visit(n)
    return order


def fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


ADDED_LATER = {"warm_mode": "resume"}  # train keys that change the model, at the value that ran before they existed
RUN_CONTROL = ("stop_after_step", "cut_at_step", "eval_every", "eval_prompts", "eval_k", "eval_max_new_tokens",
               "num_workers", "device", "max_minutes", "on_deadline", "val_batches", "eval_max_seconds", "eval_share", "log_every",
               "compile", "fit_box", "fit_probe_steps", "fit_reserve", "rows_in_memory", "profile_steps", "profile_start",
               "compile_target", "target_groups", "taps_cache_gib", "compile_cache", "flex_kernel_options")


def model_fingerprint(cfg: dict, name: str) -> str:
    """A checkpoint's training (model, train less run control and keys added later at their old value, target,
    data); a resume with another one is refused."""
    train = {k: v for k, v in cfg["train"].items() if k not in RUN_CONTROL and ADDED_LATER.get(k, ...) != v}
    model = {k: v for k, v in cfg["models"][name].items() if k != "max_minutes"  # a box is run control
             and MODEL_ADDED_LATER.get(k, ...) != v}  # added later: the keys of models trained before
    init = init_export(cfg, name)
    if init is not None:  # the folder's content, not its path
        model["init_from"] = export_digest(init)
    if train.get("warm_start"):  # likewise: this model's warm-start folder (content and step), or none there
        from training.warm import identity
        train["warm_start"] = identity(cfg, name)
    return fingerprint({"model": model, "train": train, "target": cfg["target"], "seed": cfg["seed"],
                        "hidden": cfg["hidden"]})
