"""card.json: every number the model card gives, gathered from a pipeline run's files and rounded as the card shows
it (τ to 3 decimals, seconds to 1, losses to 4), so that the card (training/card_md.py) prints them as they are.

    {"title", "data": {"prompts": {train, selection, heldout, magpie_generated, dropped, sources}, "responses":
     {sequences, response_tokens, prompt_tokens}, "hidden": {sequences, tokens, mode, dtype, layer_ids}},
     "stages": {stage: {seconds[, remeasured_seconds]}}, "models": [{model, steps, planned_steps, truncated,
     first_loss, last_loss_mean25, val_loss_per_epoch, median_step_ms, box: {...}, selection: {...}, heldout: {...},
     recipe: {...} (the model's settings as export/manifest.json records them; null without that file)}],
     "shipped": {drafter, xpress, markov, total_mb, markov_choice[, drafter_from, drafter_step]} or null}
A card over several runs (training/card_lineage.py) is {"title", "lineage": [{"name", "records", "card"}],
"shipped"}, each "card" one run's record as above (its "shipped" null).
A record the run lacks (a stage not run, a model without box.json or acceptance.json) is null, and the card says so.
"""
from __future__ import annotations

import json
from pathlib import Path

from core.errors import UsageError
from training.config import RANK_KEY

BOX_KEYS = ("wall_s", "train_wall_s", "unaccounted_s", "steps_share", "steps_per_s", "packed_tokens", "loss_tokens",
            "tokens_per_s", "box_s", "steps", "first_step", "last_step", "steady_tokens_per_s", "device", "compile")


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _round(v, digits: int):
    return round(v, digits) if isinstance(v, float) else v


def _pick(rec: dict | None, keys, digits: int = 1) -> dict | None:
    return None if rec is None else {k: _round(rec.get(k), digits) for k in keys}


def _tau(rec: dict | None) -> dict | None:
    if rec is None:
        return None
    # per_prompt stays in acceptance.json (training/compare_tau.py reads it there), out of the card
    return {k: _round(v, 3 if k.startswith("tau_") else 1) for k, v in rec.items() if k not in ("set", "per_prompt")}


def data_record(work: Path) -> dict:
    pm = _json(work / "prompts" / "manifest.json")
    rm = _json(work / "responses" / "manifest.json")
    hm = _json(work / "hidden" / "manifest.json")
    prompts = None if pm is None else {k: pm.get(k) for k in ("train", "selection", "heldout", "magpie_generated",
                                                               "dropped", "sources")}
    if prompts is not None and pm.get("eval_sets"):  # prompts.eval_sets: the sets pinned (training/eval_sets.py)
        prompts["eval_sets"] = pm["eval_sets"]
    if prompts is not None and pm.get("more"):  # prompts.more_magpie: a round drawn after the pool (prompts.py)
        prompts["more"] = {k: pm["more"].get(k) for k in ("round", "generated", "kept", "dropped")}
    return {"prompts": prompts,
            "responses": _pick(rm, ("sequences", "response_tokens", "prompt_tokens", "key")),
            "hidden": _pick(hm, ("sequences", "tokens", "mode", "dtype", "layer_ids"))}


def model_record(d: Path, summary: dict) -> dict:
    box = _json(d / "box.json")
    acc = _json(d / "acceptance.json") or {}
    out = {k: _round(summary.get(k), 4) for k in ("model", "steps", "planned_steps", "truncated", "first_loss",
                                                   "last_loss_mean25", "val_loss_per_epoch", "median_step_ms")}
    out["box"] = None if box is None else {**_pick(box, BOX_KEYS, 1),
                                           "steps_share": _round(box.get("steps_share"), 3),
                                           "parts_s": {k: _round(v, 1) for k, v in box["parts_s"].items()}}
    if box is not None:
        first, steps_s, wall = box.get("first_step_s"), box["parts_s"].get("steps"), box.get("wall_s")
        if first is not None and steps_s is not None and wall:
            # the process's first step is mostly compile: the box's share in steps after it (training/box.py)
            out["box"]["first_step_s"] = _round(first, 1)
            out["box"]["steady_steps_share"] = round((steps_s - first) / wall, 3)
        if box.get("epochs"):  # per pass of the training loop (training/box.py)
            out["box"]["epochs"] = [{k: _round(v, 1) for k, v in e.items()} for e in box["epochs"]]
        if box.get("taps_cache"):  # train.taps_cache_gib (training/online.py TapsCache)
            out["box"]["taps_cache"] = box["taps_cache"]
        if box.get("earlier"):  # the processes this one continued (a stop with a checkpoint, an interrupt)
            out["box"]["earlier"] = [{"status": e.get("status"), "steps": e.get("steps"),
                                      "wall_s": _round(e.get("wall_s"), 1)} for e in box["earlier"]]
    fit = (box or {}).get("fit") or {}
    changes = plan_changes(fit)
    if changes:  # a second fit, or the rate probes after the fit, moved the fit's plan (training/fit.py)
        out["planned_before_fit"], out["first_fit"] = fit["planned_steps"], changes[0][2]
        out["plan_changes"] = [[by, steps] for _, by, _, steps in changes]
    elif fit.get("planned_steps") not in (None, fit.get("fitted_steps")):  # the box fit shortened the plan
        out["planned_before_fit"] = fit["planned_steps"]
    out["selection"], out["heldout"] = _tau(acc.get("selection")), _tau(acc.get("heldout"))
    if _bench(acc):
        out["bench"] = _bench(acc)
    warm = _json(d / "acceptance_warm.json")  # a warm-started drafter's start, measured alike (training/evaluate.py)
    if warm is not None:
        out["warm_start"] = {"global_step": warm.get("global_step"), "grown": bool(warm.get("grown")),
                             "folder": warm.get("warm_start"), "selection": _tau(warm.get("selection")),
                             "heldout": _tau(warm.get("heldout")), "paired": paired_with_start(warm, acc)}
        if _bench(warm):
            out["warm_start"]["bench"] = _bench(warm)
    return out


def plan_changes(fit: dict) -> list[tuple[int, str, int, int]]:
    """What moved the fit's plan after it, in step order: (step, "refit" | "probes", plan before, plan after) for
    the next pass's second fit (where it changed the plan; an older record kept the plan when it found a shorter one)
    and each shortening by the rate probes after the fit."""
    refit = fit.get("refit") or {}
    out = [(refit["probe_steps"][1], "refit", refit["before"], refit["fitted_steps"])] \
        if refit.get("before") is not None and refit["fitted_steps"] != refit["before"] else []
    out += [(s["probe_steps"][1], "probes", s["before"], s["fitted_steps"]) for s in fit.get("shortened") or []]
    return sorted(out)


def _bench(acc: dict) -> dict:
    """acceptance.bench's sets ({"gsm8k": ...} from "bench:gsm8k"): the benchmarks' fixed prompts, the same in
    every run, where the selection and held-out sets change with a pool drawn anew."""
    return {k[len("bench:"):]: _tau(v) for k, v in acc.items() if k.startswith("bench:") and isinstance(v, dict)}


def paired_with_start(warm: dict, acc: dict) -> list[dict]:
    """Drafter-only tau of the trained model over its warm start's, paired over each set's prompts (compare_tau);
    a set that cannot pair (measured before per-prompt counts were kept) is left out."""
    from training.compare_tau import pair
    out = []
    for s in ("selection", "heldout", *sorted(k for k in acc if k.startswith("bench:"))):
        if isinstance(warm.get(s), dict) and isinstance(acc.get(s), dict):
            try:
                r = pair(warm[s], acc[s], "tau_drafter", "tau_drafter", s)
            except UsageError:
                continue
            out.append({"set": s, "prompts": r["prompts"], "ratio": round(r["ratio"], 3),
                        "ratio_ci95": [round(x, 3) for x in r["ratio_ci95"]]})
    return out


def shipped_record(ship_dir: Path | None) -> dict | None:
    """training.ship's manifest: SHIP_DIR/manifest.json, or SHIP_DIR itself when it is that file (a copy kept under
    another name, e.g. heads.json beside weights whose manifest.json is the drafter's export)."""
    if ship_dir is None:
        return None
    m = _json(ship_dir if ship_dir.is_file() else ship_dir / "manifest.json")
    if m is None or "shipped" not in m:
        raise UsageError(f"card: --ship {ship_dir} is not training.ship's manifest (nor a folder holding it as "
                         f"manifest.json)")
    rec = {**m["shipped"], "total_mb": round(m["total_bytes"] / 1e6, 1), "markov_choice": m["markov_choice"]}
    if m.get("drafter_from"):
        rec["drafter_from"] = m["drafter_from"]["init_from"]
        rec["drafter_step"] = (m["drafter_from"].get("train_state") or {}).get("global_step")
    return rec


def recipe_record(spec: dict | None) -> dict | None:
    """What a model was trained from and how, from its config as the export recorded it: the folder it started
    from, whether its drafter backbone trained (a drafter), stayed frozen (a head on a drafter) or was co-trained with
    the head at lr x backbone_lr_scale (training/cotrain.py), a head's rank (xpress_rank, markov_rank: the export's
    config carries both heads' defaults, so only the model's own is read), its loss (loss_fn: a name or a mapping of
    names to weights) and how it weighs a block's slots (per_position_loss_weight: exponential decay at gamma, which
    a record from before the field existed used, or D-PACE at dpace_alpha; training/loss_spec.py), its lr (null:
    train.lr), epochs and time box, and for xPress its MLP's width over its rank
    (xpress_mlp_ratio), its loss's consistency rounds (consistency_passes: the free-running passes after the
    teacher-forced one) and their weight, and the base-anchor weight (the base-anchor term counts only while the
    drafter trains with the head)."""
    if spec is None:
        return None
    head = spec.get("type") != "dflash"
    if not head:
        backbone = "trained"
    elif spec.get("freeze_backbone"):
        backbone = "frozen"
    else:
        backbone = f"co-trained at lr x {spec.get('backbone_lr_scale') or 1}"
    rank = RANK_KEY.get(spec.get("type"))
    out = {"type": spec.get("type"), "init_from": spec.get("init_from"), "backbone": backbone,
           "rank": spec.get(rank) if rank else None, "loss": loss_text(spec.get("loss_fn")), "lr": spec.get("lr"),
           "epochs": spec.get("epochs"), "max_minutes": spec.get("max_minutes"), "position_weights": positions(spec)}
    if spec.get("type") == "xpress":
        out["mlp_ratio"] = spec.get("xpress_mlp_ratio")
        out["consistency_passes"] = spec.get("consistency_passes")
        out["consistency_weight"] = spec.get("consistency_weight")
        out["base_anchor_weight"] = spec.get("base_anchor_weight") if backbone.startswith("co-trained") else None
    return out


def positions(spec: dict) -> str | None:
    """The slot weighting as the card prints it; None where the record has no gamma (nothing is guessed)."""
    from training.config import MODEL_ADDED_LATER
    how = spec.get("per_position_loss_weight", MODEL_ADDED_LATER["per_position_loss_weight"])
    if how == "dpace":
        return f"D-PACE, alpha {spec.get('dpace_alpha')}"
    return f"exp decay, gamma {spec['gamma']}" if spec.get("gamma") is not None else None


def loss_text(spec) -> str | None:
    """models.<name>.loss_fn as the card prints it: a name as it is, a mapping ('{"ce": 0.1, "tv": 0.9}', the JSON
    string training/loss_spec.py leaves) as "ce 0.1 + tv 0.9"."""
    from training.loss_spec import mapping
    if not isinstance(spec, str):
        return None
    weights = mapping(spec)
    return " + ".join(f"{k} {w}" for k, w in weights.items()) if weights is not None else spec


def card_record(work: Path, summary: list[dict], ship_dir: Path | None = None, title: str | None = None) -> dict:
    from training.stages import read
    specs = (_json(work / "export" / "manifest.json") or {}).get("models")
    models = []
    for s in summary:
        rec = model_record(work / "train" / s["model"], s)
        if specs is not None:
            rec["recipe"] = recipe_record(specs.get(s["model"]))
        models.append(rec)
    return {"title": title or work.resolve().name, "data": data_record(work), "stages": read(work),
            "models": models, "shipped": shipped_record(ship_dir)}


def write_card(rec: dict, path: Path, markdown: Path | None = None) -> None:
    path.write_text(json.dumps(rec, indent=1) + "\n")
    if markdown is not None:
        from training.card_md import render
        markdown.write_text(render(rec))


def render_file(card_json: Path, markdown: Path) -> None:
    from training.card_md import render
    if not card_json.is_file():
        raise UsageError(f"card: --from-json {card_json}: no such file (python -m training.card --train ... writes it)")
    rec = _json(card_json)
    if not isinstance(rec, dict) or not ("models" in rec or "lineage" in rec):
        raise UsageError(f"card: --from-json {card_json} is not a card.json (python -m training.card --train ... "
                         "writes one beside the records)")
    markdown.write_text(render(rec))
