"""Stage wall times: <workdir>/stages.json, {stage: {"seconds": s}}, for the model card (training/card.py).

A stage's time is recorded when the call wrote its records (a stage that was up to date keeps the time of the run
that did the work); a stage finished over several calls (an interrupted run resumed) records the call that
finished it. The train stage's time includes the selection/held-out evaluation after training
(training/evaluate.py); each model's own parts are in train/<model>/box.json. A call that only measured acceptance
again (a record from before per-prompt counts, or a new warm-start record) keeps the training call's seconds and
records its own as "remeasured_seconds" beside them (alone, when no call that trained recorded its seconds).
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

FILE = "stages.json"
RECORDS = {"prompts": ("prompts/manifest.json",), "responses": ("responses/manifest.json",),
           "hidden": ("hidden/manifest.json",), "export": ("export/manifest.json",),
           "train": ("train/*/manifest.json", "train/*/box.json")}
MEASURES = {"train": ("train/*/acceptance*.json",)}  # written after training, and alone when measured again


def _stamps(work: Path, stage: str, records: dict = RECORDS) -> dict:
    return {str(f): f.stat().st_mtime_ns for pattern in records.get(stage, ()) for f in work.glob(pattern)}


def read(work: Path) -> dict:
    f = work / FILE
    return json.loads(f.read_text()) if f.is_file() else {}


@contextlib.contextmanager
def stage_clock(work: Path, stage: str):
    before, measured, t = _stamps(work, stage), _stamps(work, stage, MEASURES), time.perf_counter()
    yield
    seconds = round(time.perf_counter() - t, 1)
    rec = read(work)
    if _stamps(work, stage) != before:
        rec[stage] = {"seconds": seconds}
    elif _stamps(work, stage, MEASURES) != measured:  # no training seconds recorded: these are not them
        rec[stage] = {**rec.get(stage, {}), "remeasured_seconds": seconds}
    else:
        return
    (work / FILE).write_text(json.dumps(rec, indent=1) + "\n")
