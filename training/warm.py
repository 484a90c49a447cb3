"""Warm start (`train.warm_start` = an export folder, e.g. what a time-boxed session brought back, or a shipped
weights folder, whose ship manifest names the model each slot holds): each model with a folder there starts from
its exported weights (bf16, sharded) and continues the LR schedule from the global step the export recorded in
`<model>/train_state.json` (written by the export stage from the train manifest).

What a warm restart loses against resuming a checkpoint: the optimizer state (AdamW's first and second moments and
their step counts: the new optimizer starts them at zero, so its first updates are bias-corrected as a fresh
Adam's are), the fp32 master weights (the weights are the bf16 export's, rounded to 2^-9 relative), and the
metrics history and best-validation record of the earlier session. Kept: the weights, the step, and so the LR
schedule, the data position (epoch and in-epoch step follow from the step and the same data) and the anchor draws
(reseeded from the seed and the step).

`train.warm_mode`: `resume` (the default) is the above, the same run on the same data continued: the run's total is
its epochs times the steps an epoch, counted from step 0, and it starts where the step puts it in the data. `extend`
is for a model continued on fresh data: its epochs run from the data's start, after the warm step, so the total is
the warm step plus the epochs' steps, and the LR continues at the warm step of that longer schedule (a cosine's
remaining decay stretched over the new epochs; its warmup, a share of the longer total, is normally long past).
`restart` is `extend` with the LR schedule begun anew at the warm step: its warmup (its ratio of this run's steps)
from 0 to the configured LR, then its decay to 0 at the run's end, as a run from scratch over these steps would have;
an `extend` run's LR is the tail of the first run's decay, which a box fitted shorter than planned takes to nearly 0
(the gsm8k run of 2026-12-05 began at 2.2e-4 of 6e-4 and was under 4.5e-5 from its 400th step on). The step the
schedule began at is recorded (`schedule_start`) beside `data_start`, so a restart run cut short resumes on its own
schedule. With `resume`, a warm step at or past the total is refused at the train stage (nothing left to train). Every
manifest and export records `data_start`, the step where its data's epoch 0 began (the warm step of an extend run,
else 0), so an extend run cut short continues with `resume` where it was in its data and schedule.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from core.errors import UsageError

STATE = "train_state.json"


def source(cfg: dict, name: str) -> Path | None:
    """The folder models.NAME starts from: `<warm_start>/NAME` (a path absolute or relative to the repository), or,
    in a shipped weights folder (training.ship's output: weights/smollm2-135m), the slot its ship manifest says held
    a model of that name (`markov/` for the model `markov_gated`), so shipped heads continue on another drafter under
    their own names. A slot that held a model of another name is not NAME's, even when named NAME, so no two models
    start from one folder."""
    root = cfg["train"]["warm_start"]
    if not root:
        return None
    from training.store import repo_path
    root = repo_path(root)
    shipped = ship_map(root)
    own = shipped.get(name)
    mine = [name] if own is None or own == name or "/" in str(own) else []  # a path: the drafter ship took from
    for d in (root / slot for slot in mine + [s for s, m in shipped.items() if m == name and s != name]):
        if (d / "config.json").is_file():
            return d
    return None


SHIP_MANIFESTS = ("heads.json", "manifest.json")  # a shipped folder's (weights/smollm2-135m), then ship's own output's


def ship_map(root: Path) -> dict:
    """{slot: the model ship filled it from} of a shipped folder's manifest, or {} for an export folder (whose
    manifest.json has no "shipped"). One that cannot be read is refused: ignoring it would train a head from scratch
    that was meant to continue."""
    for f in SHIP_MANIFESTS:
        path = root / f
        if not path.is_file():
            continue
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"train.warm_start: {path} does not read as JSON ({e}); copy the shipped folder "
                             "again") from None
        shipped = doc.get("shipped") if isinstance(doc, dict) else None
        if shipped is None:
            continue
        if not isinstance(shipped, dict) or any(not isinstance(s, str) or "/" in s or s in ("", ".", "..")
                                                for s in shipped):
            raise UsageError(f"train.warm_start: {path}'s \"shipped\" must map slot folders of {root} to model "
                             f"names (training.ship writes it), not {shipped!r}")
        return shipped
    return {}


def identity(cfg: dict, name: str) -> list | None:
    """What a model's fingerprint holds of its warm start: the folder's content digest and step (not its path, so
    another export copied to the same path trains again), or None when the export has no folder for this model."""
    from training.store import export_digest
    d = source(cfg, name)
    return None if d is None else [export_digest(d), train_state(d).get("global_step")]


def train_state(d: Path) -> dict:
    f = d / STATE
    if not f.is_file():
        raise UsageError(f"train.warm_start: {d} has no {STATE} (an export from before warm starts existed); "
                         "re-export it or train from scratch")
    return json.loads(f.read_text())


def starts(mode: str, warm_step: int, d: Path | None) -> tuple[int, int]:
    """The global steps where this run's data and its LR schedule begin: extend, the warm step and the warmed run's
    schedule start; restart, the warm step for both; resume, where the warmed run's began (0 in exports from before
    they were recorded)."""
    state = train_state(d) if d is not None else {}
    if warm_step > 0 and mode != "resume":  # extend keeps the schedule the export's run had (a restart's too)
        return warm_step, warm_step if mode == "restart" else int(state.get("schedule_start", 0))
    return int(state.get("data_start", 0)), int(state.get("schedule_start", 0))


def load(model, d: Path, name: str) -> int:
    """The exported tensors into `model` (each must be one of its own, same shape); returns the recorded step."""
    from core.checkpoints import read_tensors, shard_files
    step = int(train_state(d)["global_step"])
    tensors = read_tensors(shard_files(d, f"train.warm_start {name}"))
    own = model.state_dict()
    for k, v in tensors.items():
        if k not in own or own[k].shape != v.shape:
            raise UsageError(f"train.warm_start: {d}'s tensor {k} {tuple(v.shape)} does not fit models.{name} "
                             f"({tuple(own[k].shape) if k in own else 'no such tensor'})")
    with torch.no_grad():
        for k, v in tensors.items():
            own[k].copy_(v.to(own[k].dtype))
    return step
