"""From a RunConfig to the run plan (checked configs and arms, no weights), then to runnable arms (weights loaded).

`prepare` does every check that needs only configs, file headers and refiner checkpoints, so that bad input fails
before the target is loaded; `build_arms` loads drafter weights and refiner heads. Arms that need different
drafter weights (the base z-lab drafter, each refiner's co-trained drafter) share one drafter module; their
weights are swapped in place before each arm runs (`Arm.activate`).
"""
from __future__ import annotations

from dataclasses import dataclass

from harness.protocol.algorithms import (DFlashConfig, DFlashDrafter, MARKOV, MarkovRefiner,
                                         RefinerCheckpoint, SpyreXPressRefiner, XPRESS, XPressRefiner,
                                         check_dflash_checkpoint, load_dflash, load_refiner_checkpoint,
                                         markov_head_from_state, read_dflash_config, resolve_refiner_path,
                                         validate_against, validate_topc, xpress_head_from_state)
from core.checkpoints import local_model_dir
from harness.protocol.config import RunConfig
from harness.protocol.plan import ArmSpec, RunPlan, check_resume_arms, check_resume_weights
from harness.protocol.data import validate_dataset_args
from core.devices import Backend, resolve_backend
from core.errors import UsageError
from harness.decode.graphs import CompiledRefiner, check_use_graph
from harness.protocol.rounds import default_rounds, validate_rounds
from harness.decode.hf_overrides import parse_overrides
from harness.decode.loading import load_target_config
from harness.protocol.spyre_contract import check_models, is_spyre


@dataclass
class Arm:
    spec: ArmSpec
    block_size: int
    drafter: object | None = None
    refiner: object | None = None
    state: dict | None = None  # drafter weights to swap in before this arm runs (None: leave as is)

    @property
    def name(self) -> str:
        return self.spec.name

    def activate(self) -> None:
        if self.state is not None:
            self.drafter.model.load_state_dict(self.state, strict=True)


def prepare(cfg: RunConfig, device: str | None = None, folder: str | None = None,
            resume: str | None = None) -> RunPlan:
    """The run's plan (harness.protocol.plan), from configs, file headers and refiner checkpoints alone.
    `device`: this rank's device (default --device); `folder` / `resume`: the results folder and the folder
    continued (the runner picks them first; a plan made for a check has none)."""
    device = cfg.device if device is None else device
    validate_dataset_args(cfg.dataset, cfg.data_dir, cfg.max_samples)
    backend = resolve_backend(device, cfg.dtype)
    check_use_graph(cfg.use_graph, backend.kind)
    place = dict(device=device, folder=folder, resume=cfg.resume if resume is None else resume)
    plan = _prepare_random(cfg, backend, place) if cfg.random_weights else _prepare_models(cfg, backend, place)
    if plan.resume:  # before any model loads: the rows already written must come from the weights and arms planned
        if not cfg.random_weights:  # (random weights: the preset's, with fixed seeds)
            check_resume_weights(plan.resume, plan.weights)
        check_resume_arms(plan.resume, plan.arm_names)
    return plan


def _prepare_models(cfg: RunConfig, backend: Backend, place: dict) -> RunPlan:
    """The plan of a run on named models: their configs, the drafter's and the refiners' headers read and checked."""
    tcfg = load_target_config(cfg.model_name_or_path, parse_overrides(cfg.hf_overrides))
    limit = context_limit(cfg, tcfg)
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
        check_scripted(cfg, block)
        ckpts = _refiner_checkpoints(cfg, dcfg, tcfg, block)
    spyre, passes, topc = None, cfg.xpress_refine_passes, cfg.xpress_topc
    if is_spyre(place["device"]):  # the serving contract, from configs and checkpoint headers: still nothing loaded
        spyre = check_models(cfg, tcfg, block, ckpts.get(XPRESS))
        passes, topc = spyre.passes, spyre.shortlist
    k_list = cfg.k_list if cfg.fair_k_list is not None else [passes]
    arms = plan_arms(cfg, ckpts, passes, topc, k_list)
    rounds, warmup, note = _rounds(cfg, len(arms))
    return RunPlan(cfg, backend, tcfg, dcfg, block, limit, ckpts, tuple(arms), rounds, warmup, passes, topc, note,
                   draft_path, spyre, **place)


def check_scripted(cfg: RunConfig, block: int) -> None:
    """--scripted-accept N forces N drafts a step; a block holds block - 1 of them, so a larger N is refused rather
    than silently capped."""
    if cfg.scripted_accept is not None and cfg.scripted_accept > block - 1:
        raise UsageError(f"--scripted-accept {cfg.scripted_accept}: block {block} holds at most {block - 1} drafts a "
                         f"step; use --scripted-accept {block - 1} or less")


def _rounds(cfg: RunConfig, n_arms: int) -> tuple[int, int, str | None]:
    warmup = cfg.fair_warmup_rounds if cfg.fair else 0
    rounds = (cfg.fair_interleave or default_rounds(n_arms, warmup)) if cfg.fair else 1
    note = validate_rounds(rounds, warmup, n_arms)
    return rounds, warmup, note if cfg.fair else None  # one round: no rotation to balance


def context_limit(cfg: RunConfig, tcfg) -> int:
    """--max-model-len, or the target's max_position_embeddings; above those positions, which the model never saw,
    refused (its outputs there would be measured as if they were its own)."""
    known = int(getattr(tcfg, "max_position_embeddings", 0) or 0)
    if cfg.max_model_len and known and cfg.max_model_len > known:
        raise UsageError(f"--max-model-len {cfg.max_model_len}: above the target's max_position_embeddings "
                         f"({known}), positions it was never trained at; pass at most {known} (a target extended "
                         f"by rope scaling: raise its max_position_embeddings with --hf-overrides)")
    limit = cfg.max_model_len or known
    if limit < 2:
        raise UsageError("the target config has no max_position_embeddings; pass --max-model-len")
    return limit


@dataclass(frozen=True)
class RandomHead:
    """--random-weights: a refiner built from the preset's config, standing in for a checkpoint in plan_arms (no
    weights, so no co-trained drafter of its own)."""
    kind: str
    draft_state: None = None


def _prepare_random(cfg: RunConfig, backend: Backend, place: dict) -> RunPlan:
    """--random-weights: every arm from one preset's random models (no configs or checkpoints to check); the arms
    are plan_arms' with both refiners in paired rounds and xPress outside them (none under --drafter-only)."""
    from harness.protocol.presets import hf_config, preset
    tcfg = hf_config(preset(cfg.random_weights))
    limit = context_limit(cfg, tcfg)
    block, k, topc = cfg.block_size or 16, cfg.xpress_refine_passes, cfg.xpress_topc
    if cfg.run_spec:
        check_scripted(cfg, block)
    heads = {} if cfg.drafter_only else {h: RandomHead(h) for h in ((XPRESS, MARKOV) if cfg.fair else (XPRESS,))}
    arms = plan_arms(cfg, heads, k, topc, cfg.k_list)
    rounds, warmup, note = _rounds(cfg, len(arms))
    return RunPlan(cfg, backend, tcfg, None, block, limit, {}, tuple(arms), rounds, warmup, k, topc, note, **place)


def _compiled(refiner, cfg: RunConfig, watch=None):
    """--compile-refiner wraps the refinement step in torch.compile; --compile-all does so where it measured
    faster. `watch` (a harness.decode.compiling.CompileWatch) compiles with --compile-backend and counts the cost.
    --use-graph needs no wrapper: the loop captures the whole step, refinement included."""
    if refiner is None or not (cfg.compile_refiner or cfg.compile_all):
        return refiner
    if not cfg.compile_refiner and not getattr(refiner, "compile_helps", True):
        return refiner  # --compile-all: only where compiling measured faster
    return CompiledRefiner(refiner, watch=watch)


def build_random_arms(plan: RunPlan, models, watch=None) -> list[Arm]:
    cfg = plan.config
    def refiner(s):
        if s.method == "xpress" and cfg.refine_numerics == "spyre":
            return _spyre_refiner(models.xpress_head, s.K, plan)
        return models.refiner(s.method, s.K or 0, plan.topc)
    return [Arm(s, 1 if s.method == "ar" else plan.block_size, None if s.method == "ar" else models.drafter,
                _compiled(refiner(s), cfg, watch)) for s in plan.arms]


def _spyre_refiner(head, k: int, plan: RunPlan):
    """--refine-numerics spyre: the xPress refinement as the Spyre card runs it (refiners.spyre_numerics)."""
    return SpyreXPressRefiner(head, k, topc=plan.topc, prev_anchor=plan.config.xpress_prev_anchor)


def _refiner_checkpoints(cfg: RunConfig, dcfg: DFlashConfig, tcfg, block: int) -> dict[str, RefinerCheckpoint]:
    paths = {XPRESS: resolve_refiner_path(cfg.xpress_refiner_path),  # an env variable was read by the CLI
             MARKOV: resolve_refiner_path(cfg.markov_refiner_path)}
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


def _own_drafter(ck) -> str | None:
    """The refiner kind whose co-trained drafter an arm of `ck` runs with (ArmSpec.weights), or None: the base one."""
    return ck.kind if ck.draft_state else None


def plan_arms(cfg: RunConfig, ckpts: dict, passes: int, topc: int, k_list: list[int]) -> list[ArmSpec]:
    """The arms of a run; `ckpts`: the refiners by kind (RefinerCheckpoint, or RandomHead); `passes`, `topc`,
    `k_list`: K, C and the K values as resolved (Spyre's contract). An arm's `weights` names its refiner where that
    refiner carries a co-trained drafter of its own, which the arm's drafts then come from."""
    arms = [ArmSpec("AR", "ar")] if cfg.run_ar else []
    if not cfg.run_spec:
        return arms
    xp, mk = ckpts.get(XPRESS), ckpts.get(MARKOV)
    if cfg.fair:
        arms.append(ArmSpec("drafter-only", "drafter-only"))
        if cfg.cotrained_drafter_only:
            arms += cotrained_arms(ckpts)
        if mk:
            arms.append(ArmSpec("Markov", "markov", weights=_own_drafter(mk)))
        if xp:
            arms += [ArmSpec(_xpress_name(k, topc), "xpress", k, _own_drafter(xp)) for k in k_list]
        return arms
    ck = xp or mk
    if ck is None:
        return arms + [ArmSpec("drafter-only", "drafter-only")]
    if cfg.drafter_only or (ck is xp and passes == 0):  # the refiner's own drafter alone, where it carries one
        return arms + [ArmSpec("drafter-only (co-trained)" if _own_drafter(ck) else "drafter-only",
                               "drafter-only", weights=_own_drafter(ck))]
    if ck is xp:
        return arms + [ArmSpec(_xpress_name(passes, topc), "xpress", passes, _own_drafter(xp))]
    return arms + [ArmSpec("Markov", "markov", weights=_own_drafter(mk))]


COTRAINED_ARMS = {XPRESS: "drafter-only (xPress's drafter)", MARKOV: "drafter-only (Markov's drafter)"}


def cotrained_arms(ckpts: dict[str, RefinerCheckpoint]) -> list[ArmSpec]:
    """--cotrained-drafter-only: each checkpoint's co-trained drafter alone (its `draft_state`), one arm each; the base
    drafter's arm keeps the name "drafter-only" and stays every gain's reference (report._pick, comparisons.optimal).
    A checkpoint with no drafter of its own (a head trained on a frozen drafter) adds none; none at all is refused."""
    own = [k for k in (XPRESS, MARKOV) if ckpts.get(k) is not None and ckpts[k].draft_state]
    if not own:
        given = ", ".join(f"{ckpts[k].source} ({k})" for k in (XPRESS, MARKOV) if ckpts.get(k) is not None)
        raise UsageError(f"--cotrained-drafter-only: no refiner checkpoint given carries a drafter of its own ({given}: "
                         "heads trained on a frozen drafter); their drafter is the base one, which the drafter-only "
                         "arm runs already; drop the flag")
    return [ArmSpec(COTRAINED_ARMS[k], "drafter-only", weights=k) for k in own]


def _device_state(model, tensors: dict, backend: Backend) -> dict:
    wanted = model.state_dict()
    return {k: tensors[k].to(device=backend.device, dtype=wanted[k].dtype) for k in wanted}


def build_arms(plan: RunPlan, target, watch=None) -> list[Arm]:
    cfg, backend = plan.config, plan.backend
    specs = plan.arms
    if not any(s.method != "ar" for s in specs):
        return [Arm(s, 1) for s in specs]
    model = load_dflash(plan.draft_path, plan.draft_config, backend)
    drafter = DFlashDrafter(model, target.embed, target.lm_head, backend, block_size=plan.block_size,
                            ops=target.ops.proposing)
    def key(spec):  # the weight set an arm runs with: a refiner's co-trained drafter, or the base one (None)
        ck = plan.refiners.get(spec.weights) if spec.weights else None
        return spec.weights if ck is not None and ck.draft_state else None

    keys = {key(s) for s in specs if s.method != "ar"}
    states = {k: (_device_state(model, plan.refiners[k].draft_state, backend) if k else
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
                ck = plan.refiners[XPRESS]
                heads["xpress"] = xpress_head_from_state(ck.head_state, mixer=ck.mixer, device=backend.device,
                                                         dtype=backend.dtype, fold=not cfg.no_fold_mixer)
            refiner = (_spyre_refiner(heads["xpress"], s.K, plan) if cfg.refine_numerics == "spyre" else
                       XPressRefiner(heads["xpress"], s.K, prev_anchor=cfg.xpress_prev_anchor, topc=plan.topc,
                                     ops=target.ops.proposing))
        elif s.method == "markov":
            ck = plan.refiners[MARKOV]  # a gated/rnn head (DSpark, speculators) carries its layer's tensors too
            refiner = MarkovRefiner(markov_head_from_state(ck.head_state, ck.variant, device=backend.device,
                                                           dtype=backend.dtype),
                                    low_precision_sampling=cfg.compat_reference, ops=target.ops.proposing)
        arms.append(Arm(s, plan.block_size, drafter, _compiled(refiner, cfg, watch), states.get(key(s))))
    return arms
