"""The shipped weights of one finished pipeline run: the drafter, the xPress head and the best Markov head.

    python -m training.ship --workdir runs/smollm2-gpu --out weights/smollm2-135m [--max-mb 80]

Reads the export stage's folders, every trained model's manifest (steps) and its acceptance.json (training/
evaluate.py: τ on the selection set and on the held-out set). The Markov head shipped is the variant with the
highest SELECTION-set τ (ties: the first in the config's order) unless --markov names one, and so is the xPress head
when the run trained several (recipes side by side: K=1's τ) unless --xpress names one; the held-out τ is
reported and read by no choice. Writes OUT/{drafter,xpress,markov}/ and OUT/manifest.json (what was shipped, and
the selection and held-out τ, steps and size of every model tried, each τ under the name of its set), staged and
renamed into place; refuses a total over --max-mb or a file over 16 MiB (the most a
file may be to travel back from the GPU machine).
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from core.errors import Parser, UsageError, cli_exit
from training.store import repo_path, staged, write_json

FILE_LIMIT = 16 * 2**20
# smollm2-gpu's 5-layer drafter (37.4 MB in bf16) with the xPress and a Markov head (16 MB each) is 69.3 MB: the
# 60 MB this was refused on the H200 (2026-12-03); the tracked tree's weights travel apart (device_tree.sh) anyway
MAX_MB = 80.0


def _manifest(work: Path, name: str, file: str = "manifest.json") -> dict:
    f = work / "train" / name / file
    if not f.is_file():
        what = "finished training" if file == "manifest.json" else "selection/held-out acceptance (" + file + ")"
        raise UsageError(f"ship: {name} has no {what} in {work} (run python -m training train)")
    return json.loads(f.read_text())


OWN_KEYS = {"xpress": ("xpress_rank",), "dspark": ("markov_rank", "markov_head_type")}


def tried(work: Path) -> dict:
    """name -> what the export manifest and the training manifest say of each model."""
    export = work / "export" / "manifest.json"
    if not export.is_file():
        raise UsageError(f"ship: {export} is missing; run `python -m training export` first")
    em = json.loads(export.read_text())
    out = {}
    for name, spec in em["models"].items():
        tm, acc = _manifest(work, name), _manifest(work, name, "acceptance.json")
        own = OWN_KEYS.get(spec["type"], ())  # a head's own sizes; a drafter's config carries the heads' defaults
        out[name] = {"type": spec["type"], "num_layers": spec["num_layers"], "block_size": spec["block_size"],
                     **{k: spec.get(k) for k in own}, "init_from": spec.get("init_from"),
                     "global_step": tm.get("global_step"), "planned_steps": tm.get("planned_steps"),
                     "truncated": tm.get("truncated", False), "selection": summary(acc["selection"]),
                     "heldout": summary(acc["heldout"]), "acceptance_step": acc.get("global_step"),
                     "bytes": sum(em["files"][name].values())}
    return out


def summary(rec: dict) -> dict:
    """A set's acceptance record without its per-prompt counts (they stay in the run's acceptance.json, where
    training/compare_tau.py reads them): the shipped manifest says what the set measured, not each prompt."""
    return {k: v for k, v in rec.items() if k != "per_prompt"}


def _train_state(d: Path) -> dict:
    f = d / "train_state.json"
    return {"train_state": json.loads(f.read_text())} if f.is_file() else {}


def choose(models: dict, named: str | None, kind: str) -> str:
    """The head of `kind` (markov: the dspark models; xpress) that ships: `named`, else the one with the highest
    selection-set τ (tau_markov; xPress at K=1), the first in the config's order on a tie."""
    what, mtype, key = {"markov": ("Markov", "dspark", "tau_markov"),
                        "xpress": ("xPress", "xpress", "tau_xpress_K1")}[kind]
    heads = [n for n, m in models.items() if m["type"] == mtype]
    if named:
        if named not in heads:
            raise UsageError(f"ship: --{kind} {named}: not a trained {what} model (have: {', '.join(heads)})")
        return named
    if not heads:
        raise UsageError(f"ship: the run has no {what} ({mtype}) model")
    return max(heads, key=lambda n: (models[n]["selection"].get(key, 0.0), -heads.index(n)))


def external_drafter(models: dict, chosen: dict, drafter: str) -> str:
    """The drafter of a run that trained heads only: the exported folder both shipped heads were initialised from
    and froze (models.X.init_from), when --drafter names no model of the run."""
    heads = [chosen["xpress"], chosen["markov"]]
    inits = {models[h]["init_from"] for h in heads}
    if len(inits) != 1 or None in inits or inits & set(models):
        raise UsageError(f"ship: --drafter {drafter}: no such exported model (have: {', '.join(models)}), and the "
                         f"shipped heads {', '.join(heads)} start from no one exported drafter folder "
                         f"(init_from: {', '.join(str(models[h]['init_from']) for h in heads)})")
    path = inits.pop()
    if not (repo_path(path) / "config.json").is_file():
        raise UsageError(f"ship: the heads' init_from drafter {path} is not here (no config.json); run ship where "
                         "that folder is, or copy it there")
    return path


SHIPPED = ("drafter", "xpress", "markov", "manifest.json")  # what ship writes into --out


def check_out(work: Path, out: Path) -> list[str]:
    """--out, before anything is read: not the workdir, a folder holding it, or one of its stages' folders (ship
    replaces --out whole), and, when it exists, an earlier ship's output. Returns the other entries an earlier
    ship's folder holds (e.g. README.md, CARD.md), which the new one keeps."""
    w, o = work.resolve(), out.resolve()
    if o == w or o in w.parents or (o.parent == w and o.name in ("prompts", "responses", "hidden", "train", "export")):
        raise UsageError(f"ship: --out {out} would replace the workdir {work} or part of it; give another folder")
    if not o.exists():
        return []
    if not o.is_dir():
        raise UsageError(f"ship: --out {out} is a file; give a folder")
    m = o / "manifest.json"
    try:
        shipped = m.is_file() and "shipped" in json.loads(m.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        shipped = False
    if not shipped and any(o.iterdir()):
        raise UsageError(f"ship: --out {out} exists and is not an earlier ship's output (no manifest.json naming what "
                         "it shipped); give a new folder, or remove that one yourself")
    return sorted(p.name for p in o.iterdir() if p.name not in SHIPPED)


def ship(work: Path, out: Path, drafter="drafter", xpress: str | None = None, markov: str | None = None,
         max_mb: float = MAX_MB) -> dict:
    kept = check_out(work, out)
    models = tried(work)
    if drafter in models and models[drafter]["type"] != "dflash":
        raise UsageError(f"ship: --drafter {drafter} is a {models[drafter]['type']} model; give the run's dflash "
                         f"drafter ({', '.join(n for n, m in models.items() if m['type'] == 'dflash') or 'none'})")
    chosen = {"drafter": drafter, "xpress": choose(models, xpress, "xpress"), "markov": choose(models, markov, "markov")}
    folders = {role: work / "export" / name for role, name in chosen.items()}
    external = None
    if drafter not in models:
        external = external_drafter(models, chosen, drafter)
        folders["drafter"], chosen["drafter"] = repo_path(external), external
    files = {role: sorted(f for f in d.iterdir() if f.is_file()) for role, d in folders.items()}
    big = [f for fs in files.values() for f in fs if f.stat().st_size > FILE_LIMIT]
    if big:
        raise UsageError(f"ship: {big[0]} is over 16 MiB; lower export.max_shard_mib and export again")
    total = sum(f.stat().st_size for fs in files.values() for f in fs)
    if total > max_mb * 1e6:
        raise UsageError(f"ship: the shipped weights are {total / 1e6:.1f} MB, over --max-mb {max_mb}; shrink the "
                         "models (num_layers, ranks)")
    with staged(out) as tmp:
        for role, fs in files.items():
            (tmp / role).mkdir()
            for f in fs:
                shutil.copy2(f, tmp / role / f.name)
        manifest = {"shipped": chosen, "total_bytes": total,
                    **({"drafter_from": {"init_from": external, **_train_state(repo_path(external))}}
                       if external else {}),
                    "markov_choice": ("given by --markov" if markov else "the dspark variant with the highest "
                                      "selection-set tau_markov (prompts/selection.jsonl); held-out tau is "
                                      "reported only"),
                    **({"xpress_choice": "given by --xpress" if xpress else "the xpress model with the highest "
                        "selection-set tau_xpress_K1 (prompts/selection.jsonl); held-out tau is reported only"}
                       if xpress or sum(m["type"] == "xpress" for m in models.values()) > 1 else {}),
                    "models": models}
        write_json(tmp / "manifest.json", manifest)
        for name in kept:  # an earlier ship's folder: its other files stay (its card now describes other weights)
            (shutil.copytree if (out / name).is_dir() else shutil.copy2)(out / name, tmp / name)
    print(f"ship: {', '.join(f'{r}={n}' for r, n in chosen.items())}, {total / 1e6:.1f} MB -> {out}")
    if kept:
        print(f"ship: kept {', '.join(kept)} from the folder it replaced; they describe the weights shipped before "
              "(regenerate the card: python -m training.card)")
    return manifest


def main(argv=None) -> int:
    p = Parser(prog="python -m training.ship", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="the pipeline's workdir (holds export/ and train/)")
    p.add_argument("--out", required=True, help="the folder to write: new, or an earlier ship's output (its drafter/, "
                   "xpress/, markov/ and manifest.json replaced, its other files kept)")
    p.add_argument("--drafter", default="drafter")
    p.add_argument("--xpress", default=None,
                   help="ship this xPress model (default: the best selection-set tau at K=1 when there are several)")
    p.add_argument("--markov", default=None, help="ship this Markov model (default: best selection-set tau)")
    p.add_argument("--max-mb", type=float, default=MAX_MB,
                   help=f"refuse a total over this many MB (default {MAX_MB:g})")
    args = p.parse_args(argv)
    return cli_exit(lambda: ship(Path(args.workdir), Path(args.out), args.drafter, args.xpress, args.markov,
                                 args.max_mb))


if __name__ == "__main__":
    sys.exit(main())
