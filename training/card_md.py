"""The model card's Markdown, generated from card.json (training/card_data.py): every number in it is one of
card.json's, printed as it is there; a record the run lacks prints as "n/a"."""
from __future__ import annotations

import json

PARTS = ("startup", "steps", "validation", "held_out", "checkpoints", "finish", "export")
SET_NAMES = {"selection": "selection", "heldout": "held-out"}


def fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, list):
        return ", ".join(fmt(x) for x in v) or "none"
    if isinstance(v, dict):
        return ", ".join(f"{k.replace('_', ' ')} {fmt(x)}" for k, x in v.items()) or "none"
    return str(v)


def table(head: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + \
        ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows] + [""]


def data_section(d: dict) -> list[str]:
    out = ["## Data", ""]
    p, r, h = d.get("prompts"), d.get("responses"), d.get("hidden")
    if p is None:
        out += ["- **Prompts**: n/a (no prompts manifest among this run's records)"]
    else:
        out += [f"- **Prompts**: {fmt(p['train'])} train, {fmt(p['selection'])} selection (every choice reads "
                f"these), {fmt(p['heldout'])} held-out (reported only). Magpie prompts generated: "
                f"{fmt(p['magpie_generated'])}. Dropped by the filters: {fmt(p['dropped'])}.", ""]
        if p.get("more"):
            m = p["more"]
            out += [f"- **More Magpie prompts** (round {m['round']}, drawn after the pool, train only): "
                    f"{fmt(m['generated'])} generated, {fmt(m['kept'])} kept. Dropped by the filters: "
                    f"{fmt(m['dropped'])}.", ""]
        sources = p.get("sources") or {}
        names = sorted({g for part in sources.values() for g in part})
        out += table(["source", "train", "selection", "held-out"],
                     [[g] + [sources.get(s, {}).get(g, 0) for s in ("train", "selection", "heldout")]
                      for g in names])
    out += [f"- **Responses**: " + ("n/a" if r is None else
                                    f"{fmt(r['sequences'])} sequences, {fmt(r['response_tokens'])} response tokens, "
                                    f"{fmt(r['prompt_tokens'])} prompt tokens."),
            f"- **Hidden states**: " + ("n/a" if h is None else
                                        f"{fmt(h['sequences'])} sequences, {fmt(h['tokens'])} tokens, mode "
                                        f"{fmt(h['mode'])}, {fmt(h['dtype'])}, target layers {fmt(h['layer_ids'])}."),
            ""]
    return out


def training_section(models: list[dict], where: str | None = None) -> list[str]:
    where = where or "Loss curves: `loss_curves.png`; per-step records: `<model>.metrics.jsonl.gz`."
    out = ["## Training", "", where, ""]
    out += table(["model", "step reached", "planned", "steps this run (from step)", "cut by the time box",
                  "first loss", "last loss (mean of the last 25 logged steps)", "validation loss per epoch",
                  "median step ms"],
                 [[m["model"], m["steps"], planned(m), this_run(m.get("box") or {}), m["truncated"],
                   m["first_loss"], m["last_loss_mean25"], m["val_loss_per_epoch"], m["median_step_ms"]]
                  for m in models])
    recipes = [(m["model"], m["recipe"]) for m in models if m.get("recipe")]
    if recipes:  # training/card_data.py recipe_record; records without export/manifest.json have none
        out += ["Recipe (the models' settings as the export recorded them; rank n/a: a drafter; MLP ratio: the "
                "xPress MLP's width over its rank (n/a: not xPress, or a record made before the card read it); "
                "loss: models.<name>.loss_fn (n/a: not recorded); slot weights: how the loss weighs a block's "
                "slots (models.<name>.per_position_loss_weight; training/loss_spec.py); lr n/a: the run's "
                "train.lr; base-anchor weight n/a: no drafter trained with the head):", ""]
        out += table(["model", "type", "from", "drafter backbone", "rank", "MLP ratio", "loss", "slot weights", "lr",
                      "epochs", "box minutes", "consistency passes", "consistency weight", "base-anchor weight"],
                     [[name, r["type"], r["init_from"] or "random weights", r["backbone"], r.get("rank"),
                       r.get("mlp_ratio"), r.get("loss"), r.get("position_weights"), r["lr"], r["epochs"],
                       r["max_minutes"], r.get("consistency_passes"), r.get("consistency_weight"),
                       r.get("base_anchor_weight")]
                      for name, r in recipes])
    return out


def planned(m: dict) -> str:
    """The plan the model finished; where the box fit (training/fit.py) shortened it, the plan before the fit too,
    and what the next pass's second fit and the rate probes after the fit made of it, in order."""
    before, first, final = m.get("planned_before_fit"), m.get("first_fit"), m["planned_steps"]
    if before is None:
        return str(final)
    changes = m.get("plan_changes")
    if changes is None and first is not None:  # a card.json from before plan_changes: a second fit lengthened it
        changes = [["refit", final]]
    text = f"fitted from {before}" + ("" if first is None else f" to {first}")
    for by, steps in changes or []:
        text += f", then to {steps} by a second fit" if by == "refit" else \
            f", then shortened to {steps} by the rate probes after the fit"
    return f"{final} ({text})"


def this_run(box: dict) -> str:
    """box.json's steps and the step they started from (n/a in records older than those fields), and the earlier
    processes of the same training that this one continued."""
    if box.get("steps") is None:
        return "n/a"
    text = f"{box['steps']} (from {fmt(box.get('first_step'))})"
    earlier = box.get("earlier") or []
    if earlier:
        steps = box["steps"] + sum(e.get("steps") or 0 for e in earlier)
        wall = (box.get("wall_s") or 0) + sum(e.get("wall_s") or 0 for e in earlier)
        text += (f"; {steps} steps in {fmt(round(wall, 1))} s over {len(earlier) + 1} processes "
                 f"({', '.join(str(e.get('status')) for e in earlier)}, then this one)")
    return text


def time_section(stages: dict, models: list[dict]) -> list[str]:
    devices = sorted({str(d) for d in (((m.get("box") or {}).get("device")) for m in models) if d})
    device = ", ".join(devices) if devices else "not recorded (box records before 2026-12-05)"
    compiled = [f"{m['model']} {b['compile']}" for m in models if (b := m.get("box") or {}).get("compile")]
    device += f"; torch.compile (train.compile): {', '.join(compiled)}" if compiled else ""
    out = ["## Device time", "", f"Device: {device}.", "", "Stages (wall seconds of the run that did the work):", ""]
    out += table(["stage", "seconds"], [[s, v.get("seconds")] for s, v in stages.items()]) if stages else \
        ["n/a (no stages.json)", ""]
    out += ["Box accounting per model (train/<model>/box.json, seconds; training/box.py defines the parts):", ""]
    rows = []
    for m in models:
        b = m.get("box") or {}
        parts = b.get("parts_s") or {}
        rows.append([m["model"], b.get("wall_s"), b.get("train_wall_s"), b.get("box_s")] +
                    [parts.get(k) for k in PARTS] +
                    [b.get(k) for k in ("unaccounted_s", "steps_share", "first_step_s", "steady_steps_share",
                                        "steps_per_s", "packed_tokens", "loss_tokens", "tokens_per_s",
                                        "steady_tokens_per_s")])
    out += table(["model", "wall", "train wall", "box"] + list(PARTS) +
                 ["unaccounted", "steps share", "first step", "steady steps share", "steps/s", "packed tokens",
                  "loss tokens", "packed tokens/s", "steady packed tokens/s"], rows)
    out += ["The steps share counts the process's first step, which is mostly compiling (its seconds: first step); "
            "the steady steps share leaves it out.", ""]
    per_epoch = box_field(models, "epochs")
    if per_epoch:  # box.json's epochs (training/box.py): the rate of each pass of the training loop
        out += ["Packed tokens/s per pass of the training loop (an epoch; steady: the process's first step left "
                "out), with its steps:", ""]
        out += table(["model", "per pass: steady packed tokens/s (steps)"],
                     [[n, ", ".join(f"{fmt(e['steady_tokens_per_s'])} ({e['steps']})" for e in ep)]
                      for n, ep in per_epoch])
    cached = box_field(models, "taps_cache")
    if cached:  # train.taps_cache_gib (training/online.py TapsCache)
        out += ["The online target's cache (train.taps_cache_gib; counts since the train stage began, as its models "
                "share it; tokens from the cache are tokens the target did not run over):", ""]
        out += table(["model", "budget GiB", "kept GiB", "slabs GiB", "sequences kept", "refused",
                      "tokens from the cache", "tokens computed"],
                     [[n, c["budget_gib"], c["kept_gib"], c.get("slabs_gib"), c["sequences"], c["refused_sequences"],
                       c["hit_tokens"], c["computed_tokens"]] for n, c in cached])
    return out


def box_field(models: list[dict], key: str) -> list[tuple[str, object]]:
    """(model, its box record's KEY) for the models whose box has one."""
    return [(m["model"], v) for m in models if (v := (m.get("box") or {}).get(key))]


def tau_section(models: list[dict], shipped: dict | None, chooses: bool = True,
                same_pool: bool | None = None) -> list[str]:
    """CHOOSES: the run's models were candidates for shipping (False: a run tried on shipped weights, whose
    models were compared with the shipped ones and none replaced them). SAME_POOL (tried runs): whether its prompt
    pool is the shipped runs' last recorded one (pool()), so that its selection and held-out sets are theirs."""
    keys = sorted({k for m in models for _, r in measured_sets(m) for k in (r or {}) if k.startswith("tau_")},
                  key=lambda k: (k != "tau_drafter", k))
    sets = {True: "its selection set is the one the shipped models were chosen on",
            False: "its selection and held-out sets differ from the shipped runs' (the prompts manifest's "
                   "counts, or its pinned sets' digest), so its selection and held-out τ "
                   "are not comparable with theirs",
            None: "whether its selection set is the shipped models' is not recorded"}[same_pool]
    what = "The selection set chooses (the Markov variant shipped)" if chooses else \
        f"Nothing of this run was shipped; {sets}"
    out = ["## Acceptance τ", "",
           "Greedy, the harness's own decode loop (training/acceptance.py), on every final model after training "
           f"(training/evaluate.py). {what}; the held-out set is "
           "reported only and read by no choice. τ = accepted tokens per verify step, the bonus token included."
           + (" A `bench:NAME` set is the first prompts of that benchmark (data/eval, acceptance.bench), the same in "
              "every run, reported only." if any(m.get("bench") for m in models) else "")
           + (" A key ending `_T<T>` (`p` for the point) is that arm sampled at temperature T "
              "(acceptance.sampled_temperatures), each prompt on its own seeded stream, reported only."
              if any("_T" in k for k in keys) else ""), ""]
    rows = []
    for m in models:
        for label, r in measured_sets(m):
            rows.append([m["model"], label] + ([None] * (3 + len(keys)) if r is None else
                                               [r.get("prompts"), r.get("of"), r.get("seconds")] +
                                               [r.get(k) for k in keys]))
    out += table(["model", "set", "prompts", "of", "seconds"] + [k[4:].replace("_", " ") for k in keys], rows)
    for m in models:
        out += warm_start_lines(m)
    if shipped:
        out += shipped_lines(shipped)
    return out


def measured_sets(m: dict) -> list[tuple[str, dict | None]]:
    """(label, τ record) of a model's (or a warm start's) sets: selection, held-out, then acceptance.bench's."""
    return [(label, m.get(s)) for s, label in SET_NAMES.items()] + \
        [(f"bench:{b}", r) for b, r in sorted((m.get("bench") or {}).items())]


def warm_start_lines(m: dict) -> list[str]:
    """A drafter continued from a warm start: that start measured the same way, and the gain paired over prompts."""
    w = m.get("warm_start")
    if not w:
        return []
    sets = "; ".join(f"{label} τ {fmt((r or {}).get('tau_drafter'))}" for label, r in measured_sets(w))
    paired = "; ".join(f"{SET_NAMES.get(p['set'], p['set'])} {fmt(p['ratio'])}x [{fmt(p['ratio_ci95'][0])}, "
                       f"{fmt(p['ratio_ci95'][1])}] over {p['prompts']} prompts" for p in w.get("paired", []))
    start = (f"was grown from `{w.get('folder')}` (step {fmt(w.get('global_step'))}; training/grow.py), which it "
             "equals before its first step; that drafter" if w.get("grown") else
             f"continued a warm start at step {fmt(w.get('global_step'))}")
    return [f"`{m['model']}` {start}, measured the same way on the same prompts: {sets}. Drafter-only τ over the start's, paired over prompts (training/compare_tau.py, "
            f"95% CI): {paired or 'n/a (records without per-prompt counts)'}.", ""]


def shipped_lines(shipped: dict) -> list[str]:
    line = (f"**Shipped**: drafter `{shipped['drafter']}`, xPress `{shipped['xpress']}`, Markov "
            f"`{shipped['markov']}` ({shipped['markov_choice']}); {fmt(shipped['total_mb'])} MB in all.")
    if shipped.get("drafter_from"):
        line += (f" The heads were trained on the drafter `{shipped['drafter_from']}` (step "
                 f"{fmt(shipped.get('drafter_step'))}), which is the one shipped.")
    return [line, ""]


def totals_section(runs: list[dict]) -> list[str]:
    """One row a run: the responses it generated and what each of its models trained on (box.json's packed tokens,
    this run's steps), then the sums over the lineage. A run that trained on a responses stage an earlier run made
    (carried: the same stage key) generated none: its row names that run, and the sums count the stage once."""
    lines = ["## The lineage in numbers", "",
             "| run | sequences generated | response tokens | models: steps this run, packed tokens |",
             "|---|---|---|---|"]
    seqs = toks = 0
    packed: dict = {}
    made_by: dict = {}
    for r in runs:
        resp = (r["card"]["data"] or {}).get("responses") or {}
        key = resp.get("key")
        if key is not None and key in made_by:  # the two generated-data cells of this run's row
            generated = [f"none: `{made_by[key]}`'s ({fmt(resp.get('sequences'))}, carried)", "none"]
        else:
            made_by.setdefault(key, r["name"])
            seqs, toks = seqs + resp.get("sequences", 0), toks + resp.get("response_tokens", 0)
            generated = [fmt(resp.get("sequences")), fmt(resp.get("response_tokens"))]
        trained = []
        for m in r["card"]["models"]:
            box = m.get("box") or {}
            if box.get("packed_tokens") is not None:
                packed[m["model"]] = packed.get(m["model"], 0) + box["packed_tokens"]
            trained.append(f"{m['model']}: {fmt(box.get('steps'))}, {fmt(box.get('packed_tokens'))}")
        lines.append(" | ".join([f"| `{r['name']}`", *generated, "; ".join(trained) or "none"]) + " |")
    lines.append(f"| all | {seqs} | {toks} | " + "; ".join(f"{k}: {v}" for k, v in packed.items()) + " |")
    return lines + ["", "A model name trained in several runs sums its packed tokens over them: one model's total only "
                    "where each run continued the one before (the training tables' \"from step\" say which).", ""]


def render_lineage(rec: dict) -> str:
    """A card over several runs (training/card_lineage.py): the shipped files, then each run's sections, one level
    down, in the order the runs were made."""
    runs = rec["lineage"]
    lines = [f"# Model card: {rec['title']}", "",
             "Generated by `python -m training.card --lineage ...` from `card.json` (every number below is one of its "
             f"values). These weights were made by {len(runs)} runs in turn: "
             + ", ".join(f"`{r['name']}` (records: `{r['records']}`)" for r in runs)
             + ". Each run's models are listed as it trained them, kept or not.", ""]
    if rec.get("shipped"):
        lines += shipped_lines(rec["shipped"])
    lines += totals_section(runs)
    for r in runs:
        lines += run_section(r)
    if rec.get("tried"):
        lines += ["## Tried on these weights, not shipped", "",
                  "Runs made after these files were shipped, on them or on an earlier tried run's export (each "
                  "training table's \"from step\" says which), whose models did not replace them: "
                  + ", ".join(f"`{r['name']}`" for r in rec["tried"]) + ". They are outside the count and the totals "
                  "above; each is listed as it trained its models.", ""]
        shipped_pool = next((p for p in map(pool, reversed(runs)) if p), None)  # the last run that recorded one
        for r in rec["tried"]:
            mine = pool(r)
            lines += run_section(r, tried=True, same_pool=None if not shipped_pool or not mine else mine == shipped_pool)
    return "\n".join(lines).rstrip() + "\n"


def pool(run: dict) -> tuple | None:
    """What a run's prompts manifest says of its selection and held-out sets: the pinned files' digest
    (prompts.eval_sets), else the pool's counts, drops and sources by split; None where not recorded. Two runs whose
    pools differ here drew different sets: the Magpie prompts are generated, and a change of engine numerics (the
    responses attention, the top-p cut) generates others. A run pinned to the files an unpinned run wrote reads as
    differing here: the unpinned manifest has no digest of its sets to compare."""
    p = (run["card"]["data"] or {}).get("prompts") or {}
    if p.get("eval_sets"):
        return ("pinned", p["eval_sets"]["digest"])
    return None if not p.get("train") else tuple(json.dumps(p.get(k), sort_keys=True)
                                                for k in ("train", "selection", "heldout", "dropped", "sources"))


def run_section(r: dict, tried: bool = False, same_pool: bool | None = None) -> list[str]:
    c = r["card"]
    body = data_section(c["data"]) + training_section(
        c["models"], f"Loss curves: `loss_curves_{r['name']}.png`; per-step records: `{r['records']}`.")
    body += time_section(c["stages"], c["models"]) + tau_section(c["models"], None, chooses=not tried,
                                                                  same_pool=same_pool)
    return [f"## {'Tried run' if tried else 'Run'} `{r['name']}`", ""] + ["#" + x if x.startswith("## ") else x for x in body]


def render(rec: dict) -> str:
    if "lineage" in rec:
        return render_lineage(rec)
    lines = [f"# Model card: {rec['title']}", "",
             "Generated by `python -m training.card` from `card.json` (every number below is one of its values).", ""]
    lines += data_section(rec["data"])
    lines += training_section(rec["models"])
    lines += time_section(rec["stages"], rec["models"])
    lines += tau_section(rec["models"], rec.get("shipped"))
    return "\n".join(lines).rstrip() + "\n"
