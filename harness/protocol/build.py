"""From a RunConfig to checked configs and a plan of arms (no weights), then to runnable arms (weights loaded).

`prepare` does every check that needs only configs, file headers and refiner checkpoints, so that bad input fails
before the target is loaded; `build_arms` loads drafter weights and refiner heads. Arms that need different
drafter weights (the base z-lab drafter, each refiner's co-trained drafter) share one drafter module; their
weights are swapped in place before each arm runs (`Arm.activate`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


from harness.protocol.algorithms import (DFlashConfig, DFlashDrafter, ENV_VARS, MARKOV, MarkovRefiner,
                                         RefinerCheckpoint, SpyreXPressRefiner, XPRESS, XPressRefiner,
                                         check_dflash_checkpoint, load_dflash, load_refiner_checkpoint,
                                         markov_head_from_state, read_dflash_config, resolve_refiner_path,
                                         validate_against, validate_topc, xpress_head_from_state)
from core.checkpoints import local_model_dir
from harness.protocol.config import RunConfig
from harness.protocol.data import validate_dataset_args
from core.devices import Backend, resolve_backend
from core.errors import UsageError
from harness.decode.graphs import CompiledRefiner
from harness.protocol.rounds import default_rounds, validate_rounds
from harness.decode.hf_overrides import parse_overrides
from harness.decode.loading import load_target_config
from harness.protocol.spyre_contract import check_models, is_spyre


@dataclass(frozen=True)
class ArmSpec:
    name: str
    method: str               # ar | drafter-only | markov | xpress
    K: int | None = None
    weights: str | None = None  # None: the base drafter; else the refiner kind whose co-trained drafter it uses


@dataclass
class Arm:
    spec: ArmSpec
    block_size: int
    drafter: object | None = None
    refiner: object | None = None
    state: dict | None = None  # drafter weights to swap in before this arm runs (None: leave as is)
    results: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    def activate(self) -> None:
        if self.state is not None:
            self.drafter.model.load_state_dict(self.state, strict=True)


@dataclass
class Prepared:
    backend: Backend
    target_config: object
    draft_config: DFlashConfig | None
    block_size: int
    max_model_len: int
    refiners: dict[str, RefinerCheckpoint]
    arms: list[ArmSpec]
    rounds: int
    warmup_rounds: int
    rotation_note: str | None = None
    draft_path: str | None = None  # the drafter's local directory (a hub id resolved to the HF cache)
    config: RunConfig | None = None  # the run config with Spyre's resolved K and C (None: as given)
    spyre: object | None = None      # harness.protocol.spyre_contract.SpyrePlan on --device spyre


def prepare(cfg: RunConfig) -> Prepared:
    validate_dataset_args(cfg.dataset, cfg.data_dir, cfg.max_samples)
    backend = resolve_backend(cfg.device, cfg.dtype)
    if cfg.use_graph and backend.kind != "cuda":
        raise UsageError("--use-graph captures CUDA graphs; it needs --device cuda")
    if cfg.random_weights:
        return _prepare_random(cfg, backend)
    tcfg = load_target_config(cfg.model_name_or_path, parse_overrides(cfg.hf_overrides))
    limit = cfg.max_model_len or int(getattr(tcfg, "max_position_embeddings", 0) or 0)
    if limit < 2:
        raise UsageError("the target config has no max_position_embeddings; pass --max-model-len")
    dcfg, block, ckpts, draft_path = None, 1, {}, None
    if cfg.run_spec:
        draft_path = local_model_dir(cfg.draft_name_or_path, "--draft-name-or-path")
        dcfg = read_dflash_config(draft_path)
        dcfg.check_target(tcfg, f"drafter {cfg.draft_name_or_path}")
        check_dflash_checkpoint(draft_path, dcfg)
        if cfg.block_size and cfg.block_size > dcfg.block_size:
            raise UsageError(f"--block-size {cfg.block_size}: the drafter {cfg.draft_name_or_path} was trained with "
                             f"block {dcfg.block_size}, and it never learned the slots past it; use --block-size "
                             f"{dcfg.block_size} or smaller")
        block = cfg.block_size or dcfg.block_size
        ckpts = _refiner_checkpoints(cfg, dcfg, tcfg, block)
    plan = None
    if is_spyre(cfg.device):  # the serving contract, from configs and checkpoint headers: still nothing loaded
        plan = check_models(cfg, tcfg, block, ckpts.get(XPRESS))
        cfg = dataclasses.replace(cfg, xpress_refine_passes=plan.passes, xpress_topc=plan.shortlist)
    arms = plan_arms(cfg, ckpts)
    rounds, warmup, note = _rounds(cfg, len(arms))
    return Prepared(backend, tcfg, dcfg, block, limit, ckpts, arms, rounds, warmup, note, draft_path, cfg, plan)


def _rounds(cfg: RunConfig, n_arms: int) -> tuple[int, int, str | None]:
    warmup = cfg.fair_warmup_rounds if cfg.fair else 0
    rounds = (cfg.fair_interleave or default_rounds(n_arms, warmup)) if cfg.fair else 1
    note = validate_rounds(rounds, warmup, n_arms)
    return rounds, warmup, note if cfg.fair else None  # one round: no rotation to balance


def _prepare_random(cfg: RunConfig, backend: Backend) -> Prepared:
    """--random-weights: every arm from one preset's random models (no configs or checkpoints to check)."""
    from harness.protocol.presets import hf_config, preset
    tcfg = hf_config(preset(cfg.random_weights))
    limit = cfg.max_model_len or tcfg.max_position_embeddings
    if cfg.fair:
        specs = [ArmSpec("AR", "ar"), ArmSpec("drafter-only", "drafter-only"), ArmSpec("Markov", "markov")]
        specs += [ArmSpec(_xpress_name(k, cfg.xpress_topc), "xpress", k) for k in cfg.k_list]
    else:
        specs = [ArmSpec("AR", "ar")] if cfg.run_ar else []
        if cfg.run_spec:
            k = cfg.xpress_refine_passes
            specs.append(ArmSpec("drafter-only", "drafter-only") if cfg.drafter_only or k == 0 else
                         ArmSpec(_xpress_name(k, cfg.xpress_topc), "xpress", k))
    rounds, warmup, note = _rounds(cfg, len(specs))
    return Prepared(backend, tcfg, None, cfg.block_size or 16, limit, {}, specs, rounds, warmup, note)


def _compiled(refiner, cfg: RunConfig, watch=None):
    """--compile-refiner wraps the refinement step in torch.compile; --compile-all does so where it measured
    faster. `watch` (a harness.decode.compiling.CompileWatch) compiles with --compile-backend and counts the cost.
    --use-graph needs no wrapper: the loop captures the whole step, refinement included."""
    if refiner is None or not (cfg.compile_refiner or cfg.compile_all):
        return refiner
    if not cfg.compile_refiner and not getattr(refiner, "compile_helps", True):
        return refiner  # --compile-all: only where compiling measured faster
    return CompiledRefiner(refiner, watch=watch)


def build_random_arms(cfg: RunConfig, prep: Prepared, models, watch=None) -> list[Arm]:
    def refiner(s):
        if s.method == "xpress" and cfg.refine_numerics == "spyre":
            return _spyre_refiner(models.xpress_head, s.K, cfg)
        return models.refiner(s.method, s.K or 0, cfg.xpress_topc)
    return [Arm(s, 1 if s.method == "ar" else prep.block_size, None if s.method == "ar" else models.drafter,
                _compiled(refiner(s), cfg, watch)) for s in prep.arms]


def _spyre_refiner(head, k: int, cfg: RunConfig):
    """--refine-numerics spyre: the xPress refinement as the Spyre card runs it (refiners.spyre_numerics)."""
    return SpyreXPressRefiner(head, k, topc=cfg.xpress_topc, prev_anchor=cfg.xpress_prev_anchor)


def _refiner_checkpoints(cfg: RunConfig, dcfg: DFlashConfig, tcfg, block: int) -> dict[str, RefinerCheckpoint]:
    paths = {XPRESS: resolve_refiner_path(cfg.xpress_refiner_path, ENV_VARS[XPRESS]),
             MARKOV: resolve_refiner_path(cfg.markov_refiner_path, ENV_VARS[MARKOV])}
    if all(paths.values()) and not cfg.fair:
        raise UsageError("xPress and Markov checkpoints were both given; outside the paired protocol a run compares "
                         "one refiner with AR and drafter-only (add --fair-interleave, or pass only one path)")
    if cfg.xpress_topc:
        try:
            validate_topc(cfg.xpress_topc, tcfg.vocab_size)
        except ValueError as e:
            raise UsageError(f"--xpress-topc: {e}") from None
    out = {}
    for kind, path in paths.items():
        if path:
            ckpt = load_refiner_checkpoint(path, kind, trust_pickle=cfg.trust_pickle)
            validate_against(ckpt, tcfg.vocab_size, dcfg.hidden_size, block if kind == XPRESS else None,
                             dcfg.expected_shapes())
            out[kind] = ckpt
    return out


def _xpress_name(k: int, topc: int) -> str:
    return f"xPress(K={k}, C={topc})" if topc else f"xPress(K={k})"  # --refine-numerics is in the run config


def plan_arms(cfg: RunConfig, ckpts: dict[str, RefinerCheckpoint]) -> list[ArmSpec]:
    arms = [ArmSpec("AR", "ar")] if cfg.run_ar else []
    if not cfg.run_spec:
        return arms
    xp, mk = ckpts.get(XPRESS), ckpts.get(MARKOV)
    if cfg.fair:
        arms.append(ArmSpec("drafter-only", "drafter-only"))
        if mk:
            arms.append(ArmSpec("Markov", "markov", weights=MARKOV))
        if xp:
            arms += [ArmSpec(_xpress_name(k, cfg.xpress_topc), "xpress", k, XPRESS) for k in cfg.k_list]
        return arms
    ck = xp or mk
    if ck is None:
        return arms + [ArmSpec("drafter-only", "drafter-only")]
    if cfg.drafter_only or (ck is xp and cfg.xpress_refine_passes == 0):
        return arms + [ArmSpec("drafter-only (co-trained)", "drafter-only", weights=ck.kind)]
    if ck is xp:
        return arms + [ArmSpec(_xpress_name(cfg.xpress_refine_passes, cfg.xpress_topc), "xpress",
                               cfg.xpress_refine_passes, XPRESS)]
    return arms + [ArmSpec("Markov", "markov", weights=MARKOV)]


def _device_state(model, tensors: dict, backend: Backend) -> dict:
    wanted = model.state_dict()
    return {k: tensors[k].to(device=backend.device, dtype=wanted[k].dtype) for k in wanted}


def build_arms(cfg: RunConfig, prep: Prepared, target, watch=None) -> list[Arm]:
    backend = prep.backend
    specs = prep.arms
    if not any(s.method != "ar" for s in specs):
        return [Arm(s, 1) for s in specs]
    model = load_dflash(prep.draft_path, prep.draft_config, backend)
    drafter = DFlashDrafter(model, target.embed, target.lm_head, backend, block_size=prep.block_size,
                            ops=target.ops)
    def key(spec):  # the weight set an arm runs with: a refiner's co-trained drafter, or the base one (None)
        ck = prep.refiners.get(spec.weights) if spec.weights else None
        return spec.weights if ck is not None and ck.draft_state else None

    keys = {key(s) for s in specs if s.method != "ar"}
    states = {k: (_device_state(model, prep.refiners[k].draft_state, backend) if k else
                  {n: t.clone() for n, t in model.state_dict().items()}) for k in keys}
    if len(keys) == 1:  # one set of weights for every arm: load it once, swap nothing
        only = keys.pop()
        if only:
            model.load_state_dict(states[only], strict=True)
        states = {}
    heads: dict = {}
    arms = []
    for s in specs:
        if s.method == "ar":
            arms.append(Arm(s, 1))
            continue
        refiner = None
        if s.method == "xpress":
            if "xpress" not in heads:
                ck = prep.refiners[XPRESS]
                heads["xpress"] = xpress_head_from_state(ck.head_state, mixer=ck.mixer, device=backend.device,
                                                         dtype=backend.dtype, fold=not cfg.no_fold_mixer)
            refiner = (_spyre_refiner(heads["xpress"], s.K, cfg) if cfg.refine_numerics == "spyre" else
                       XPressRefiner(heads["xpress"], s.K, prev_anchor=cfg.xpress_prev_anchor, topc=cfg.xpress_topc,
                                     ops=target.ops))
        elif s.method == "markov":
            ck = prep.refiners[MARKOV]  # a gated/rnn head (DSpark, speculators) carries its layer's tensors too
            refiner = MarkovRefiner(markov_head_from_state(ck.head_state, ck.variant, device=backend.device,
                                                           dtype=backend.dtype),
                                    low_precision_sampling=cfg.compat_reference, ops=target.ops)
        arms.append(Arm(s, prep.block_size, drafter, _compiled(refiner, cfg, watch), states.get(key(s))))
    return arms
