"""The lines a run prints before its first decode: what runs, on what, with which sampling and refiners."""
from __future__ import annotations

import dataclasses

from harness.protocol import report


def label(cfg) -> str | None:
    """The run's weights label (harness.protocol.report.weights_label), for config.json and the console."""
    return report.weights_label(dataclasses.asdict(cfg))


def describe(plan: RunPlan, models: Models, settings: DecodeSettings, samples, out) -> None:
    cfg, backend = plan.config, plan.backend
    if label(cfg):
        print(f"[{label(cfg)}] preset={cfg.random_weights or '-'} scripted_accept={cfg.scripted_accept}", file=out)
    print(f"[run] target={cfg.model_name_or_path or cfg.random_weights} device={backend.device} dtype={backend.dtype} "
          f"kernels={models.target.kernels} block={plan.block_size} stop_ids={list(models.stops)} "
          f"max_model_len={plan.max_model_len} samples={len(samples)} arms={plan.arm_names} rounds={plan.rounds} "
          f"(first {plan.warmup_rounds} excluded) folder={plan.folder}", file=out)
    if plan.rotation_note:
        print(f"[rounds] {plan.rotation_note}", file=out)
    trained = plan.draft_config.block_size if plan.draft_config else None
    if trained and plan.block_size < trained:
        print(f"[note] block {plan.block_size} is smaller than the drafter's trained block {trained}: allowed (the "
              f"drafter fills only the first {plan.block_size - 1} of its {trained - 1} draft slots), but tau is "
              "not the drafter's published setting", file=out)
    other = verifier_mismatch(cfg.draft_name_or_path if plan.draft_config else None, models.target.config)
    if other:
        print(f"[note] {other}", file=out)
    for ck in plan.refiners.values():
        mixer = (f" mixer={ck.mixer} (fold={'no' if cfg.no_fold_mixer else 'after cast to ' + str(backend.dtype)})"
                 if ck.kind == "xpress" else "")
        print(f"[refiner] {ck.kind} from {ck.source}: rank={ck.rank} step={ck.step}{mixer} "
              f"co-trained drafter={'yes' if ck.draft_state else 'no'}", file=out)
    tp, dp = settings.target_params, settings.draft_params
    verification = ("greedy" if tp.greedy else "rejection sampling (q = the drafts' real distribution)"
                    if not dp.greedy else "exact match against a sampled target")
    print(f"[sampling] T={tp.temperature} Td={dp.temperature} top_k={tp.top_k or 'off'} "
          f"top_p={tp.top_p if tp.top_p < 1 else 'off'} draft noise={settings.draft_noise if not dp.greedy else '-'} "
          f"verification={verification} rng={'one global stream' if cfg.compat_reference else 'per (prompt, turn, round)'}",
          file=out)


def verifier_mismatch(draft_path, target_config) -> str | None:
    """The drafter's config names the verifier it was trained for (speculators' `speculators_config.verifier`);
    another architecture of the same shapes passes every shape check, and its τ is then a foreign drafter's."""
    import json
    import os
    if not draft_path or not os.path.isfile(os.path.join(draft_path, "config.json")):
        return None
    try:
        saved = json.loads(open(os.path.join(draft_path, "config.json"), encoding="utf-8").read())
    except ValueError:
        return None
    trained = ((saved.get("speculators_config") or {}).get("verifier") or {}).get("architectures") or []
    target = list(getattr(target_config, "architectures", None) or [])
    if trained and target and not set(trained) & set(target):
        return (f"the drafter was trained for a {', '.join(trained)} verifier and this target is "
                f"{', '.join(target)}: the shapes fit, but τ measures a drafter made for another model")
    return None
