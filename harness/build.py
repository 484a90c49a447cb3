"""From a RunConfig to checked configs (no weights) and then to the arms of a run (weights loaded).

`prepare` does every check that needs only configs, file headers and refiner checkpoints, so that bad input fails
before the target is loaded; `build_arms` loads drafter weights and refiner heads.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from drafters.dflash import DFlashConfig, DFlashDrafter, check_dflash_checkpoint, load_dflash, read_dflash_config
from harness.config import RunConfig
from harness.data import validate_dataset_args
from harness.devices import Backend, resolve_backend
from harness.errors import UsageError
from harness.graphs import AcceleratedRefiner
from harness.target import load_target_config
from refiners.formats import (ENV_VARS, MARKOV, XPRESS, RefinerCheckpoint, load_refiner_checkpoint,
                              resolve_refiner_path, validate_against)
from refiners.markov import MarkovRefiner, markov_head_from_state
from refiners.xpress import XPressRefiner, validate_topc, xpress_head_from_state


@dataclass
class Arm:
    name: str
    block_size: int
    drafter: object | None = None
    refiner: object | None = None
    results: list = field(default_factory=list)  # per sample, per turn: Generation


@dataclass
class Prepared:
    backend: Backend
    target_config: object
    draft_config: DFlashConfig | None
    block_size: int
    max_model_len: int
    refiner: RefinerCheckpoint | None


def prepare(cfg: RunConfig) -> Prepared:
    validate_dataset_args(cfg.dataset, cfg.data_dir, cfg.max_samples)
    backend = resolve_backend(cfg.device, cfg.dtype)
    if cfg.use_graph and backend.kind != "cuda":
        raise UsageError("--use-graph captures CUDA graphs; it needs --device cuda")
    tcfg = load_target_config(cfg.model_name_or_path)
    limit = cfg.max_model_len or int(getattr(tcfg, "max_position_embeddings", 0) or 0)
    if limit < 2:
        raise UsageError("the target config has no max_position_embeddings; pass --max-model-len")
    if not cfg.run_spec:
        return Prepared(backend, tcfg, None, 1, limit, None)
    dcfg = read_dflash_config(cfg.draft_name_or_path)
    dcfg.check_target(tcfg, f"drafter {cfg.draft_name_or_path}")
    check_dflash_checkpoint(cfg.draft_name_or_path, dcfg)
    block = cfg.block_size or dcfg.block_size
    ckpt = _refiner_checkpoint(cfg, dcfg, tcfg, block)
    return Prepared(backend, tcfg, dcfg, block, limit, ckpt)


def _refiner_checkpoint(cfg: RunConfig, dcfg: DFlashConfig, tcfg, block: int) -> RefinerCheckpoint | None:
    xp = resolve_refiner_path(cfg.xpress_refiner_path, ENV_VARS[XPRESS])
    mk = resolve_refiner_path(cfg.markov_refiner_path, ENV_VARS[MARKOV])
    if xp and mk:
        raise UsageError("xPress and Markov checkpoints were both given; one run compares one refiner with AR "
                         "and drafter-only (pass one of --xpress-refiner-path / --markov-refiner-path)")
    if cfg.xpress_topc:
        try:
            validate_topc(cfg.xpress_topc, tcfg.vocab_size)
        except ValueError as e:
            raise UsageError(f"--xpress-topc: {e}") from None
    path, kind = (xp, XPRESS) if xp else (mk, MARKOV) if mk else (None, None)
    if path is None:
        return None
    ckpt = load_refiner_checkpoint(path, kind, trust_pickle=cfg.trust_pickle)
    validate_against(ckpt, tcfg.vocab_size, dcfg.hidden_size, block if kind == XPRESS else None,
                     dcfg.expected_shapes())
    return ckpt


def spec_arm_name(cfg: RunConfig, ckpt: RefinerCheckpoint | None) -> str:
    if ckpt is None or cfg.drafter_only or (ckpt.kind == XPRESS and cfg.xpress_refine_passes == 0):
        return "drafter-only" if ckpt is None else "drafter-only (co-trained)"
    if ckpt.kind == XPRESS:
        suffix = f", C={cfg.xpress_topc}" if cfg.xpress_topc else ""
        return f"xPress(K={cfg.xpress_refine_passes}{suffix})"
    return "Markov"


def build_arms(cfg: RunConfig, prep: Prepared, target) -> list[Arm]:
    arms = [Arm("AR", 1)] if cfg.run_ar else []
    if not cfg.run_spec:
        return arms
    backend, ckpt = prep.backend, prep.refiner
    model = load_dflash(cfg.draft_name_or_path, prep.draft_config, backend)
    if ckpt is not None and ckpt.draft_state:
        # The refiner was co-trained with its own drafter weights; they replace the base drafter's.
        wanted = {k: v for k, v in ckpt.draft_state.items() if k in model.state_dict()}
        model.load_state_dict(wanted, strict=True)
    drafter = DFlashDrafter(model, target.embed, target.lm_head, backend, block_size=prep.block_size)
    name = spec_arm_name(cfg, ckpt)
    refiner = None
    if not name.startswith("drafter-only"):
        if ckpt.kind == XPRESS:
            head = xpress_head_from_state(ckpt.head_state, mixer=ckpt.mixer, device=backend.device,
                                          dtype=backend.dtype, fold=not cfg.no_fold_mixer)
            refiner = XPressRefiner(head, cfg.xpress_refine_passes, prev_anchor=cfg.xpress_prev_anchor,
                                    topc=cfg.xpress_topc)
        else:
            refiner = MarkovRefiner(markov_head_from_state(ckpt.head_state, device=backend.device,
                                                           dtype=backend.dtype))
        if cfg.use_graph or cfg.compile_refiner:
            refiner = AcceleratedRefiner(refiner, use_graph=cfg.use_graph, compile=cfg.compile_refiner)
    return arms + [Arm(name, prep.block_size, drafter, refiner)]
