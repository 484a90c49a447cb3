"""After training: every finished model's greedy tau on the whole selection set and the whole held-out set, in
train/<model>/acceptance.json (skipped when that file matches the model's final checkpoint, the prompts and the
settings).

    {"key": ..., "final": "3", "global_step": 120,
     "selection": {"set": "selection", "of": 32, "prompts": 32, "tau_drafter": 2.1, "tau_markov": 2.2, "seconds": 9.1},
     "heldout":   {"set": "heldout",   "of": 64, "prompts": 64, ...}}

training/ship.py chooses on "selection" only; "heldout" is reported (the card, the ship manifest) and read by no
choice. Each of the two has "by_source": the pooled tau of each prompt source (training/domains.py group_of).
`acceptance.bench` names benchmark datasets (data/eval files, the protocol's subset and rendering,
harness.protocol.data) measured the same way, as "bench:<name>": what the harness's tables will see, reported and
read by no choice. Caps: acceptance.selection_max_seconds / heldout_max_seconds / bench_max_seconds (0: every
prompt); `prompts` says how many were measured. acceptance.dtype and the decode's CUDA graphs are recorded beside
them. train.eval_prompts=0 turns acceptance off here as during training.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from training.config import fingerprint, model_fingerprint, repo_path
from training.overlap import read_jsonl
from training.store import read_manifest, write_json

FILE = "acceptance.json"
SETS = ("selection", "heldout")


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


def eval_key(cfg: dict, name: str, final: Path) -> str:
    from training.prompts import out_dir
    tc = cfg["train"]
    return fingerprint({"model": model_fingerprint(cfg, name), "final": final.name,
                        "prompts": read_manifest(out_dir(cfg))["key"], "acceptance": cfg["acceptance"],
                        "max_new_tokens": tc["eval_max_new_tokens"], "k": tc["eval_k"]})


def measure(held, final: Path, ids: dict, caps: dict, groups: dict) -> dict:
    from safetensors.torch import load_file
    cfg_dict = json.loads((final / "config.json").read_text())
    state = load_file(str(final / "model.safetensors"), device=str(held.backend.device))
    out = {}
    for s in ids:
        t = time.perf_counter()
        r = held.measure(cfg_dict, state, caps[s], ids[s], groups.get(s))
        out[s] = {"set": s, "of": len(ids[s]), **r, "seconds": round(time.perf_counter() - t, 3)}
    return out


def kept(rec: dict, key: str) -> bool:
    """An acceptance.json to keep: the same model, prompts and settings, with every set's per-prompt counts (one
    written before they were kept is measured again, so that it can be paired: training/compare_tau.py)."""
    sets = [v for v in rec.values() if isinstance(v, dict) and "prompts" in v]
    return rec.get("key") == key and all("per_prompt" in v for v in sets)


def run(cfg: dict, names: list[str], make_held) -> dict:
    """`make_held(prompt_ids)`: a training.acceptance.HeldOut over every prompt given (built once, if needed)."""
    from training.train import final_dir, model_dir
    if not cfg["train"]["eval_prompts"]:
        return {}
    todo = {}
    for n in names:
        final = final_dir(cfg, n)
        if final is None:
            continue
        f = model_dir(cfg, n) / FILE
        key = eval_key(cfg, n, final)
        if f.is_file() and kept(json.loads(f.read_text()), key):
            continue
        todo[n] = (final, key)
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
    for n, (final, key) in todo.items():
        m = json.loads((model_dir(cfg, n) / "manifest.json").read_text())
        rec = {"key": key, "final": final.name, "global_step": m.get("global_step"), **label,
               **measure(held, final, ids, caps, groups)}
        write_json(model_dir(cfg, n) / FILE, rec)
        done[n] = rec
        print(f"acceptance {n}: " + "; ".join(
            f"{s} ({rec[s]['prompts']} of {rec[s]['of']}) " +
            ", ".join(f"{k}={v:.3f}" for k, v in rec[s].items() if k.startswith("tau_")) for s in ids), flush=True)
    return done
