"""train.fit_box: the planned steps fitted to the time box, from the measured step rate.

A box (train.max_minutes) that ends before the planned steps cuts the run with its learning rate still high (the
earlier 7-minute box stopped at 1,470 of 12,396 steps). With fit_box, after `train.fit_probe_steps` steps past
the first (the first compiles), the rate measured over them (device synchronised at both ends) gives the steps
the box's remaining time holds, less `train.fit_reserve` of it (kept for validation, evaluation, checkpoints and
export). When that is fewer than planned, the run plans that many instead: speculators' warmup + decay schedule
is re-planned over them (the warmup keeps its ratio), and the run ends there as a finished run, not a truncated
one. The fit is recorded in the manifest and box.json. It depends on the machine's speed, so a rerun elsewhere
may plan another number of steps; a resumed checkpoint plans from its own box.

Where the fit shortened the plan, the next pass of the training loop (the next epoch) probes its rate again, over
as many steps after its first, and where the box now holds more, the plan is fitted again, longer (`refit` in the
record; where it holds less, shorter): the online target's cache (train.taps_cache_gib) makes the epochs after the
first faster than the first, where the first probe ran. The schedule is re-planned from the step it is at: its LR
rises by what the longer decay puts there (a cosine at step s of T then of T' > T); a warmup already over keeps its
length (its ratio of the longer plan would start a second warmup). Both probes leave out the time of what the box
times apart inside them (held-out evaluations, checkpoints, validation, a profile's summary), so a probe that spans
a pass's end (its checkpoint and validation) still measures steps.

After the fit, the rate is probed again over each `train.fit_probe_steps` steps in turn, and where the box no longer
holds the plan (by more than SHORTEN_SLACK of the steps left), the plan ends sooner, re-planned there (`shortened`
in the record). These later probes, and the refit's, keep free the seconds the fit reserved, not its share of what
is left. The fit's own probe may run faster than the rest: a second model of a job starts on the sequences whose
tapped layers the first model's steps left in the online target's cache (2026-12-07: a D-PACE drafter's probe
measured 9.3 steps/s there, its next pass 5.8; its plan of 2,553 steps was cut by the deadline at 1,934, its cosine
LR still at 15% of its peak).
"""
from __future__ import annotations

import functools
import math
import time

from core.errors import UsageError

_KEYS = ("num_warmup_steps", "num_training_steps")


def check_schedulers(schedulers, setting: str = "train.fit_box false") -> None:
    """speculators 0.9.0 builds transformers' warmup schedules: LambdaLR over a partial of (warmup, total)."""
    for s in schedulers:
        for f in getattr(s, "lr_lambdas", [None]):
            if not isinstance(f, functools.partial) or f.args or not all(k in f.keywords for k in _KEYS):
                raise UsageError("this speculators/transformers version's LR schedule is not a partial over "
                                 f"(num_warmup_steps, num_training_steps); set {setting}")


def shifted(step: int, *, inner, schedule_start: int, **keywords) -> float:
    """A schedule begun at global step `schedule_start` (train.warm_mode=restart): `inner` at the steps since."""
    return inner(max(step - schedule_start, 0), **keywords)


def start_of(schedulers) -> int:
    """The global step the schedules began at (0 unless restarted, or with no schedule: train.scheduler none)."""
    return int(schedulers[0].lr_lambdas[0].keywords.get("schedule_start", 0)) if schedulers else 0


# the probes after the fit shorten the plan only where the box falls short of it by more than this share of the steps
# left: one window's rate carries noise (and a stall the box does not time apart), and shortening on every window
# that ran below the fit's rate would walk the plan down to the slowest window's (training/trainer.py _maybe_shorten)
SHORTEN_SLACK = 0.03

SCHEDULERS = ("linear", "cosine", "none")  # speculators 0.9.0's TrainerConfig.scheduler_type


def check_schedule(t: dict) -> None:
    """train.scheduler is one speculators knows, and a restart has a schedule to begin anew (before anything loads)."""
    if t["scheduler"] not in SCHEDULERS:
        raise UsageError(f"config train.scheduler {t['scheduler']!r}: use one of {', '.join(SCHEDULERS)}")
    if t["warm_mode"] == "restart" and t["scheduler"] == "none":
        raise UsageError("config train.warm_mode restart begins the LR schedule anew, and train.scheduler none has "
                         "none: use extend, or a linear or cosine schedule")


def _unshifted(f: functools.partial) -> dict:
    """The keywords of `shifted` over the schedule that `f` computes (itself, or its inner one if already shifted)."""
    kw = {k: v for k, v in f.keywords.items() if k not in ("inner", "schedule_start")}
    return {**kw, "inner": f.keywords["inner"] if f.func is shifted else f.func}


def restart(schedulers, start: int, total: int, warmup_ratio: float) -> int:
    """Every schedule begun anew at global step `start` (train.warm_mode=restart): its warmup (its ratio of the steps
    from `start` to `total`, rounded down as speculators 0.9.0 rounds a run's) and its decay over those steps, to 0
    at `total`, as a run from scratch over them; returns the warmup steps."""
    for s in schedulers:
        s.lr_lambdas = [functools.partial(shifted, **_unshifted(f), schedule_start=start) for f in s.lr_lambdas]
    return replan(schedulers, total, warmup_ratio, int(warmup_ratio * (total - start)))


def fitted_total(step: int, rate: float, left_s: float, reserve: float, planned: int) -> int:
    """The steps a run at `step`, going at `rate` steps/s, can reach in `left_s` seconds less `reserve` of them."""
    return max(step + 1, min(planned, step + math.floor(rate * left_s * (1.0 - reserve))))


def warmup_of(schedulers) -> int:
    """The warmup steps the schedules are planned with now."""
    return int(schedulers[0].lr_lambdas[0].keywords["num_warmup_steps"]) if schedulers else 0


def warmup_done(schedulers, step: int) -> int | None:
    """The warmup steps the schedules are planned with, once global step `step` is past them; else None."""
    warm = warmup_of(schedulers)
    return warm if step >= start_of(schedulers) + warm else None


def warmup_running(schedulers, step: int, total: int) -> int | None:
    """The warmup steps the schedules are planned with, while global step `step` is inside them and they take at most
    half of a plan ending at `total`: a fit there keeps their length, so the LR goes on up the same ramp instead of
    jumping to a shorter warmup's (a restart's fit lands inside its warmup); else None (the ratio of the new plan)."""
    warm, start = warmup_of(schedulers), start_of(schedulers)
    return warm if step < start + warm and 2 * warm <= total - start else None


def replan(schedulers, total: int, warmup_ratio: float, warmup: int | None = None) -> int:
    """Every schedule's warmup and decay re-planned to end at global step `total` (the warmup `warmup` steps where
    given, else its ratio of the steps from the schedule's start); returns the warmup steps."""
    total -= start_of(schedulers)
    warm = math.ceil(warmup_ratio * total) if warmup is None else warmup
    for s in schedulers:
        s.lr_lambdas = [functools.partial(f.func, *f.args, **{**f.keywords, "num_warmup_steps": warm,
                                                               "num_training_steps": total})
                        for f in s.lr_lambdas]
    return warm


class Probe:
    """The step rate over `steps` steps after the first `skip` of the steps it is told of (`tick`), the device
    synchronised at both ends, the seconds `apart()` counts in between (what the box times apart from the steps:
    held-out evaluations, checkpoints, validation, a profile's summary) left out."""

    def __init__(self, skip: int, steps: int, sync, apart):
        self.skip, self.steps, self.sync, self.apart = skip, steps, sync, apart
        self.seen, self.start = 0, None

    def tick(self, step: int) -> tuple[int, float] | None:
        """After a step (the global `step` reached): (the step the clock started at, steps/s) once the probe is
        over, else None."""
        self.seen += 1
        if self.seen == self.skip:
            self.sync()
            self.start = (step, time.monotonic(), self.apart())
        elif self.seen == self.skip + self.steps:
            self.sync()
            g1, t1, a1 = self.start
            return g1, (step - g1) / (time.monotonic() - t1 - (self.apart() - a1))
        return None
