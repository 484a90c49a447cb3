"""Where a training run's wall time went: train/<model>/box.json (and one printed line).

Parts, each timed on its own (on CUDA the device is synchronised at each part's edges, not inside the steps):
    startup      model build, data loaders, the target for hidden.mode=online and the held-out prompts (the stage's
                 shared set-up counts in its first model), the Trainer's set-up (a resume's checkpoint load)
    steps        the training steps: batch fetch, the online target forward, forward, backward, optimizer, logging
    validation   speculators' val_epoch (train.val_batches batches at the end of each epoch)
    held_out     held-out acceptance (train.eval_every, train.eval_max_seconds, train.eval_share)
    checkpoints  speculators' checkpoint saves
    finish       the manifest after training
    export       this model's share of the export stage (added by it)
    profile      only with train.profile_steps: the profiler's summary written (training/profiling.py)
`train_wall_s` runs from the start of the model's set-up (for the stage's first model: the stage's start) to its
box being written; `wall_s` = train_wall_s + export (its export part, timed in the export stage, which runs after
every model has trained); `unaccounted_s` = wall_s - the parts (the gaps between them). Tokens: `packed_tokens` are the real tokens of the packed rows the steps
trained on (`document_ids != -1`, padding excluded; what speculators' profile calls num_tokens) and `loss_tokens`
those with loss_mask 1; tokens_per_s = packed_tokens / steps_s. `first_step_s` is the process's first step (compile,
loader workers, warm-up: 118.9 s of a box on the H200), `steady_steps_per_s` and `steady_tokens_per_s` the rates of
the steps after it (tokens: an average step's share taken out for the first). `epochs`: the same per pass of the
training loop (one an epoch, the resumed one partial), each closed where the device is synchronised anyway (its
validation follows): where the rate changes from epoch to epoch (the online target's cache, train.taps_cache_gib,
serves the epochs after the first) it shows there.
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

PARTS = ("startup", "steps", "validation", "held_out", "checkpoints", "finish", "export")
FILE = "box.json"


class Box:
    def __init__(self, device: torch.device, started: float | None = None):
        self.t0 = started if started is not None else time.perf_counter()
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.device = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type  # for the card
        self.parts = dict.fromkeys(PARTS, 0.0)
        self.parts["startup"] = self.now() - self.t0  # the stage's shared set-up before this model's own
        self._mark = None  # while the step clock runs: when the current step began
        self._packed = self._loss = None
        self.steps = 0
        self.first_step_s = None  # this process's first step: compile, loader workers starting, CUDA warm-up
        self.epochs: list[dict] = []  # per pass of the training loop (start_steps .. stop_steps)
        self._epoch0 = None

    def now(self) -> float:
        return time.perf_counter()

    @contextlib.contextmanager
    def timed(self, part: str):
        """Time `part`; a step in progress is closed first and a new one starts after."""
        self.sync()
        t = self.now()
        if self._mark is not None:
            self.parts["steps"] += t - self._mark
        try:
            yield
        finally:
            self.sync()
            end = self.now()
            self.parts[part] = self.parts.get(part, 0.0) + end - t  # profile: only when profiling
            if self._mark is not None:
                self._mark = end

    def start_steps(self, epoch: int | None = None, global_step: int | None = None) -> None:
        self._mark = self.now()
        self._epoch0 = (self.steps, self.parts["steps"], self._packed_now(), epoch, global_step)

    def step_done(self) -> None:
        t = self.now()
        if self.first_step_s is None:
            self.first_step_s = t - self._mark
        self.parts["steps"] += t - self._mark
        self._mark = t
        self.steps += 1

    def stop_steps(self) -> None:
        if self._mark is not None:
            self.sync()
            self.parts["steps"] += self.now() - self._mark
            self._mark = None
            self._close_epoch()

    def _packed_now(self) -> int:
        """The packed tokens so far (a read of the device's running sum: only where the device is idle anyway)."""
        return int(self._packed.item()) if self._packed is not None else 0

    def _close_epoch(self) -> None:
        steps0, secs0, packed0, epoch, global_step = self._epoch0
        n, secs, packed = self.steps - steps0, self.parts["steps"] - secs0, self._packed_now() - packed0
        if not n:
            return
        first = self.first_step_s if steps0 == 0 else 0.0  # the process's first step fell in this pass
        rest = secs - first
        self.epochs.append({"epoch": epoch, "first_step": global_step, "steps": n, "steps_s": round(secs, 4), "packed_tokens": packed,
                            "tokens_per_s": round(packed / secs, 1) if secs else 0.0,
                            "steady_tokens_per_s": round(packed * (n - (1 if first else 0)) / n / rest, 1)
                            if rest > 0 and n > (1 if first else 0) else None})

    def count(self, document_ids: torch.Tensor, loss_mask: torch.Tensor) -> None:
        """Tokens of one training batch, summed on its device (no synchronisation per step)."""
        packed, loss = (document_ids >= 0).sum(), loss_mask.sum()
        self._packed = packed if self._packed is None else self._packed + packed
        self._loss = loss if self._loss is None else self._loss + loss

    def record(self, extra: dict | None = None) -> dict:
        wall = self.now() - self.t0
        steps_s = self.parts["steps"]
        packed = int(self._packed.item()) if self._packed is not None else 0
        loss = int(self._loss.item()) if self._loss is not None else 0
        return {"wall_s": round(wall, 4), "train_wall_s": round(wall, 4), "parts_s": {k: round(v, 4) for k, v in self.parts.items()},
                "unaccounted_s": round(wall - sum(self.parts.values()), 4),
                "steps_share": round(steps_s / wall, 4) if wall else 0.0, "steps": self.steps,
                "steps_per_s": round(self.steps / steps_s, 3) if steps_s else 0.0, "packed_tokens": packed,
                "loss_tokens": loss, "tokens_per_s": round(packed / steps_s, 1) if steps_s else 0.0,
                "loss_tokens_per_s": round(loss / steps_s, 1) if steps_s else 0.0,
                **self._steady(steps_s, packed), "epochs": self.epochs, "device": self.device, **(extra or {})}

    def _steady(self, steps_s: float, packed: int) -> dict:
        """The steps after the first: their rate, and the tokens' (the first step's share of the tokens taken out
        as an average step's)."""
        rest = steps_s - (self.first_step_s or 0.0)
        if self.steps < 2 or rest <= 0:
            return {"first_step_s": round(self.first_step_s, 4) if self.first_step_s else None,
                    "steady_steps_per_s": None, "steady_tokens_per_s": None}
        return {"first_step_s": round(self.first_step_s, 4), "steady_steps_per_s": round((self.steps - 1) / rest, 3),
                "steady_tokens_per_s": round(packed * (self.steps - 1) / self.steps / rest, 1)}


def write(path: Path, rec: dict, name: str) -> None:
    path.write_text(json.dumps(rec, indent=1) + "\n")
    steady = (f", first step {rec['first_step_s']:.1f} s, then {rec['steady_tokens_per_s']:.0f} packed tokens/s"
              if rec.get("steady_tokens_per_s") else "")
    print(f"box {name}: {rec['wall_s']:.1f} s, {100 * rec['steps_share']:.1f}% steps ({rec['steps']} steps, "
          f"{rec['tokens_per_s']:.0f} packed tokens/s, {rec['loss_tokens_per_s']:.0f} loss tokens/s{steady}); " +
          ", ".join(f"{k} {v:.1f} s" for k, v in rec["parts_s"].items() if k != "steps") +
          f"; unaccounted {rec['unaccounted_s']:.2f} s", flush=True)


def add_export(path: Path, seconds: float, name: str) -> None:
    """The export stage's time for this model into its box: wall_s = train_wall_s + export (a re-export replaces
    the earlier export time)."""
    if not path.is_file():
        return
    rec = json.loads(path.read_text())
    rec["parts_s"]["export"] = round(seconds, 4)
    rec["wall_s"] = round(rec["train_wall_s"] + seconds, 4)
    rec["unaccounted_s"] = round(rec["wall_s"] - sum(rec["parts_s"].values()), 4)
    steps_s = rec["parts_s"]["steps"]
    rec["steps_share"] = round(steps_s / rec["wall_s"], 4) if rec["wall_s"] else 0.0
    write(path, rec, name)


def earlier_boxes(path: Path, key: str, start_step: int) -> list[dict]:
    """The box records of the earlier processes of this model (the same fingerprint) that this one continues from
    their last step (a stop with a checkpoint, or an interrupt), oldest first; [] for a fresh start."""
    if not path.is_file():
        return []
    rec = json.loads(path.read_text())
    if rec.get("key") != key or rec.get("last_step") != start_step or rec.get("status") == "finished":
        return []
    return [*rec.pop("earlier", []), rec]
