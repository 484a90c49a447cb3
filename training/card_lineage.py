"""A model card over a lineage of runs: weights that several pipeline runs made in turn (a drafter trained from
random weights, then warm-started in a later session, then heads trained on it with the backbone frozen), each
run's card (training/card_data.py) from the records it brought back, in the order they ran.

    python -m training.card --lineage run2=results/perf/training_scale_h200_32k \
        --lineage run3=results/perf/training_scale_h200_run3 --lineage heads=results/perf/training_scale_h200_heads \
        --ship weights/smollm2-135m/heads.json --out results/smollm2-135m/training \
        --markdown weights/smollm2-135m/CARD.md --title "SmolLM2-135M"

A run's DIR is either its workdir (train/<model>/manifest.json, metrics.jsonl, box.json, acceptance.json; the
stage manifests, export/manifest.json) or the flat records folder that results/perf keeps of it
(<model>_manifest.json, <model>_metrics.jsonl.gz, <model>_box.json, <model>_acceptance.json, <stage>_manifest.json,
stages.json, export_manifest.json).
OUT gets card.json ({"title", "lineage": [{"name", "records", "card"}], "shipped"}) and loss_curves_<name>.png;
the per-step records stay where they are (each run names its folder).
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from core.errors import UsageError

MODEL_FILES = ("manifest.json", "metrics.jsonl.gz", "metrics.jsonl", "box.json", "acceptance.json",
               "acceptance_warm.json")
STAGE_MANIFESTS = ("prompts", "responses", "hidden")


def parse(spec: str) -> tuple[str, Path]:
    name, sep, folder = spec.partition("=")
    if not sep or not name or not folder:
        raise UsageError(f"card: --lineage {spec!r}: give NAME=DIR (e.g. run3=results/perf/training_scale_h200_run3)")
    d = Path(folder)
    if not d.is_dir():
        raise UsageError(f"card: --lineage {name}={folder}: no such folder")
    return name, d


def as_workdir(records: Path, into: Path) -> Path:
    """A workdir layout of RECORDS: itself when it is one, else the flat files copied into INTO's layout."""
    if (records / "train").is_dir():
        return records
    models = sorted(p.name[:-len("_manifest.json")] for p in records.glob("*_manifest.json")
                    if (records / (p.name[:-len("_manifest.json")] + "_metrics.jsonl.gz")).is_file())
    if not models:
        raise UsageError(f"card: {records} holds neither train/<model>/ nor <model>_manifest.json with "
                         f"<model>_metrics.jsonl.gz: not a run's records")
    for m in models:
        d = into / "train" / m
        d.mkdir(parents=True)
        for f in MODEL_FILES:
            src = records / f"{m}_{f}"
            if src.is_file():
                shutil.copy(src, d / f)
    for s in STAGE_MANIFESTS:
        src = records / f"{s}_manifest.json"
        if src.is_file():
            (into / s).mkdir(parents=True, exist_ok=True)
            shutil.copy(src, into / s / "manifest.json")
    if (records / "stages.json").is_file():
        shutil.copy(records / "stages.json", into / "stages.json")
    if (records / "export_manifest.json").is_file():  # the models' settings (the card's recipe table)
        (into / "export").mkdir(parents=True, exist_ok=True)
        shutil.copy(records / "export_manifest.json", into / "export" / "manifest.json")
    return into


def build(specs: list[str], out: Path, ship: Path | None, markdown: Path | None, title: str | None,
          tried: list[str] | None = None) -> dict:
    """The card of the lineage SPECS; TRIED: runs made on the shipped weights whose models were not shipped (a
    recipe that lost), listed after the lineage with the same sections and left out of its count and totals."""
    from training.card_curves import plot, read_models
    from training.card_data import card_record, shipped_record, write_card
    runs, extra = [parse(s) for s in specs], [parse(s) for s in tried or []]
    names = [n for n, _ in runs + extra]
    if len(set(names)) != len(names):
        raise UsageError(f"card: --lineage and --tried names must differ, got {names}")
    shipped = shipped_record(ship)
    records_of: dict = {"lineage": [], "tried": []}
    curves_of = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, group in (("lineage", runs), ("tried", extra)):
            for name, records in group:  # every run read and checked before anything is written
                work = as_workdir(records, Path(tmp) / name)
                models = read_models(work / "train")
                named, summary = {d.name: c for d, _, c, _ in models}, [s for *_, s in models]
                curves_of[name] = named
                records_of[kind].append({"name": name, "records": str(records),
                                         "card": card_record(work, summary, None, name)})
    out.mkdir(parents=True, exist_ok=True)
    for name, named in curves_of.items():
        plot(named, out / f"loss_curves_{name}.png", f"{name}: speculators training losses")
    card = {"title": title or out.resolve().name, "lineage": records_of["lineage"], "shipped": shipped,
            **({"tried": records_of["tried"]} if extra else {})}
    write_card(card, out / "card.json", markdown)
    return card
