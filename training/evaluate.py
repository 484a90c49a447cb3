"""After training: every finished model's greedy tau on the whole selection set and the whole held-out set, in
train/<model>/acceptance.json (skipped when that file matches the model's final checkpoint, the prompts and the
settings).

    {"key": ..., "final": "3", "global_step": 120,
     "selection": {"set": "selection", "of": 32, "prompts": 32, "tau_drafter": 2.1, "tau_markov": 2.2, "seconds": 9.1},
     "heldout":   {"set": "heldout",   "of": 64, "prompts": 64, ...}}

With acceptance.sampled_temperatures (e.g. [1]) every arm is also measured sampled at each T, as tau_<arm>_T<T>
(training/acceptance.py), reported (the card, compare_tau) and read by no choice.
training/ship.py chooses on "selection" only; "heldout" is reported (the card, the ship manifest) and read by no
choice. Each of the two has "by_source": the pooled tau of each prompt source (training/domains.py group_of).
`acceptance.bench` names benchmark datasets (data/eval files, the protocol's subset and rendering,
harness.protocol.data) measured the same way, as "bench:<name>": what the harness's tables will see, reported and
read by no choice. Caps: acceptance.selection_max_seconds / heldout_max_seconds / bench_max_seconds (0: every
prompt); `prompts` says how many were measured. acceptance.dtype and the decode's CUDA graphs are recorded beside
them. train.eval_prompts=0 turns acceptance off here as during training. A drafter that train.warm_start continued
is also measured as it started, its warm-start export, in train/<model>/acceptance_warm.json (the same sets,
prompts and settings), so `python -m training.compare_tau` pairs the two; so is a drafter grown from an exported
one (models.X.grow: the folder it grew from, which it equals before its first step; "grown": true there).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from training.config import fingerprint, model_fingerprint
from training.overlap import read_jsonl
from training.store import export_digest, read_manifest, repo_path, write_json

FILE = "acceptance.json"
WARM_FILE = "acceptance_warm.json"  # a warm-started drafter's starting weights, measured the same way
SETS = ("selection", "heldout")
# acceptance keys added after records were made, at the value those ran with: left out of a record's key at that
# value, so an earlier record keeps its key (training.config's ADDED_LATER does the same for a model's fingerprint)
ADDED_LATER = {"sampled_temperatures": []}


def read_set(cfg: dict, name: str) -> list[dict]:
    from training.prompts import out_dir
    return read_jsonl(out_dir(cfg) / f"{name}.jsonl")


def bench_rows(cfg: dict) -> dict[str, list[dict]]:
    """{"bench:<name>": rows} for acceptance.bench: the first acceptance.bench_prompts of the protocol's subset of
    <prompts.eval_dir>/<name>.jsonl, first turns, rendered as the protocol renders them ("render": "protocol")."""
    from harness.protocol.data import load_samples
    ac = cfg["acceptance"]
    out = {}
    for name in ac["bench"]:
        samples = load_samples(name, str(repo_path(cfg["prompts"]["eval_dir"])), ac["bench_prompts"])
        out[f"bench:{name}"] = [{"text": s.turns[0], "source": f"bench:{name}:{s.row}", "render": "protocol"}
                                for s in samples]
    return out


def eval_key(cfg: dict, name: str, final: Path, warm: Path | None = None) -> str:
    """What a record measured: the model (or, for WARM, the warm-start export's bytes), the prompts, the settings."""
    from training.prompts import out_dir
    tc = cfg["train"]
    grown = {"grown": True} if cfg["models"][name]["grow"] else {}  # a grown model's start, not a warm start's
    what = {"warm_start": export_digest(warm), **grown} if warm is not None else \
        {"model": model_fingerprint(cfg, name), "final": final.name}
    ac = {k: v for k, v in cfg["acceptance"].items() if ADDED_LATER.get(k, ...) != v}
    return fingerprint({**what, "prompts": read_manifest(out_dir(cfg))["key"], "acceptance": ac,
                        "max_new_tokens": tc["eval_max_new_tokens"], "k": tc["eval_k"]})


def measure(held, final: Path, ids: dict, caps: dict, groups: dict, temperatures=()) -> dict:
    from core.checkpoints import read_tensors, shard_files
    cfg_dict = json.loads((final / "config.json").read_text())
    one = final / "model.safetensors"  # a checkpoint's weights (beside its optimizer's), else an export's shards
    state = read_tensors([one] if one.is_file() else shard_files(final, "acceptance"))
    out = {}
    for s in ids:
        t = time.perf_counter()
        r = held.measure(cfg_dict, state, caps[s], ids[s], groups.get(s), temperatures)
        out[s] = {"set": s, "of": len(ids[s]), **r, "seconds": round(time.perf_counter() - t, 3)}
    return out


def measured(rec: dict) -> list[str]:
    """The sets an acceptance record measured (its entries with a prompt count)."""
    return [s for s, v in rec.items() if isinstance(v, dict) and "prompts" in v]


def kept(rec: dict, key: str) -> bool:
    """An acceptance.json to keep: the same model, prompts and settings, with every set's per-prompt counts (one
    written before they were kept is measured again, so that it can be paired: training/compare_tau.py)."""
    return rec.get("key") == key and all("per_prompt" in rec[s] for s in measured(rec))


def warm_drafters(cfg: dict, names: list[str]) -> dict:
    """{name: the exported folder it started from} for the drafters (dflash) that train.warm_start continued or that
    grew from an exported drafter (training/grow.py: before its first step a grown model computes what that folder
    does): measured beside the model they became, on the same prompts (WARM_FILE), so `python -m
    training.compare_tau train/<name>/acceptance_warm.json train/<name>/acceptance.json` pairs what the run changed.
    Heads are left out: their exports hold the head alone."""
    from training.config import init_export
    from training.warm import source
    out = {}
    for n in names:
        m = cfg["models"][n]
        if m["type"] != "dflash":  # before any folder is looked up: a head's warm folder need not hold a drafter
            continue
        d = source(cfg, n) or (init_export(cfg, n) if m["grow"] else None)
        if d is not None:
            out[n] = d
    return out


def run(cfg: dict, names: list[str], make_held) -> dict:
    """`make_held(prompt_ids)`: a training.acceptance.HeldOut over every prompt given (built once, if needed)."""
    from training.train import final_dir, model_dir
    if not cfg["train"]["eval_prompts"]:
        return {}
    todo = {}  # (name, file): (the folder measured, its key, whether it is a warm start)
    for n in names:
        final = final_dir(cfg, n)
        if final is not None:
            todo[(n, FILE)] = (final, eval_key(cfg, n, final), False)
    for n, src in warm_drafters(cfg, names).items():
        todo[(n, WARM_FILE)] = (src, eval_key(cfg, n, src, warm=src), True)
    todo = {k: v for k, v in todo.items() if not ((f := model_dir(cfg, k[0]) / k[1]).is_file()
                                                 and kept(json.loads(f.read_text()), v[1]))}
    if not todo:
        return {}
    from training.domains import group_of
    rows = {s: read_set(cfg, s) for s in SETS}
    groups = {s: [group_of(r["source"]) for r in v] for s, v in rows.items()}
    rows.update(bench_rows(cfg))
    held, ids = make_held(rows)
    ac = cfg["acceptance"]
    caps = {s: ac[f"{s}_max_seconds"] if s in SETS else ac["bench_max_seconds"] for s in ids}
    label = {"dtype": str(held.backend.dtype).replace("torch.", ""), "cuda_graphs": held.settings.use_graph}
    done = {}
    for (n, file), (final, key, warm) in todo.items():
        if warm:
            from training.warm import STATE
            state = json.loads((final / STATE).read_text()) if (final / STATE).is_file() else {}
            src = {"warm_start": str(final), "global_step": state.get("global_step"),
                   **({"grown": True} if cfg["models"][n]["grow"] else {})}
        else:
            m = json.loads((model_dir(cfg, n) / "manifest.json").read_text())
            src = {"final": final.name, "global_step": m.get("global_step")}
        rec = {"key": key, **src, **label, **measure(held, final, ids, caps, groups, ac["sampled_temperatures"])}
        model_dir(cfg, n).mkdir(parents=True, exist_ok=True)
        write_json(model_dir(cfg, n) / file, rec)
        if not warm:
            done[n] = rec
        print(f"acceptance {n}{' (its warm start, ' + str(final) + ')' if warm else ''}: " + "; ".join(
            f"{s} ({rec[s]['prompts']} of {rec[s]['of']}) " +
            ", ".join(f"{k}={v:.3f}" for k, v in rec[s].items() if k.startswith("tau_")) for s in ids), flush=True)
    return done
