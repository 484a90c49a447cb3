"""speculators' Trainer, run as it is, with the few changes it needs here (each names speculators 0.9.0):

* device: the Trainer moves the model and batches to `get_local_rank()` (an int: CUDA device 0) and its
  checkpointer loads onto `get_current_device()` ("cuda:0" when there is no accelerator), so it cannot run on a
  CPU. The device is set here before the model is placed, and loads map to it.
* checkpoints: `SingleGPUCheckpointer.save_checkpoint` rounds the weights AND the optimizer state (Adam's moments
  and its step count) to bf16, so a resumed run is not the run it continues. They are saved in fp32 here; export
  writes bf16.
* determinism: anchors are drawn from torch's global generator (`select_anchors`); the generator is reseeded from
  (seed, global step) before every step, and the data loader gets its own generator, so a run resumed mid-epoch
  draws what the uninterrupted run drew.
* CPU timing: its per-step `_StepTimer` (which gates the metric logging) calls `torch.accelerator.synchronize()`,
  which raises without an accelerator; on a CPU a timer that skips the synchronisation is swapped in.
* hooks: `run_training` passes no step callback; `train_epoch` is called with one here (held-out acceptance every
  `eval_every` steps). `stop_after_step` ends a run right after a checkpoint, and `max_seconds` checkpoints and
  ends it once the time is up (a long run split across calls resumes from there). `cut_at_step` (train.cut_at_step)
  ends it at that global step as a spent box with on_deadline=finish does: the checkpoint is the final model, its
  export records the step, and a later session's warm start continues the same schedule (a run planned over
  several sessions, cut where each session's device time ends, not where a clock happens to stop it).
* box accounting (training/box.py): `val_epoch`, `maybe_save_checkpoint` and the held-out evaluation are timed
  around speculators' own methods, the steps between the step callbacks; a forward pre-hook counts each training
  batch's tokens. Held-out evaluation is capped at `eval_max_seconds` each, and a periodic one is skipped while
  held-out time exceeds `eval_share` of the elapsed box (the final one always runs).
* profiling (training/profiling.py): `train.profile_steps` steps under torch.profiler, from the step callback.
* warm start (training/warm.py): with `warm_step` and no checkpoint, the Trainer starts at that global step: the
  epoch and in-epoch position the uninterrupted run had there, counted from `data_start` (speculators' own
  mid-epoch resume skip; train.warm_mode=extend starts this data at the warm step) and the LR schedulers stepped to
  it; the optimizer is fresh (Adam's moments and step counts start from zero).
"""
from __future__ import annotations

import json
import logging
import math
import time
import warnings
from pathlib import Path

import torch
from speculators.train.checkpointer import SingleGPUCheckpointer, convert_float_dtype, load_safetensors_state_dict
import speculators.train.trainer as trainer_module
from speculators.train.trainer import Trainer

from training.fit import Probe

FINGERPRINT = "xpress_bench_fingerprint.json"


class _HostTimer(trainer_module._StepTimer):
    """speculators 0.9.0's step timer without the accelerator synchronisation (CPU only)."""

    def mark(self, name: str) -> None:
        if self.enabled:
            self._marks[name] = time.perf_counter()

    def now(self) -> float | None:
        return time.perf_counter() if self.enabled else None


class StopRequested(Exception):
    pass


class Fp32Checkpointer(SingleGPUCheckpointer):
    def __init__(self, path, device: torch.device):
        self.device = device
        super().__init__(path)

    def save_checkpoint(self, model, optimizer, epoch, float_dtype=torch.float32):
        super().save_checkpoint(model, optimizer, epoch, float_dtype=torch.float32)

    def load_model_state_dict(self, model, float_dtype=None):
        state = load_safetensors_state_dict(self.model_path(self.previous_epoch), str(self.device))
        model.load_state_dict(convert_float_dtype(state, float_dtype or model.dtype), strict=False)

    def load_optimizer_state_dict(self, model, optimizer, float_dtype=None):
        loaded = torch.load(self.optimizer_path(self.previous_epoch), weights_only=True, map_location=self.device)
        opts = optimizer if isinstance(optimizer, list) else [optimizer]
        for opt, sd in zip(opts, loaded if isinstance(loaded, list) else [loaded], strict=True):
            opt.load_state_dict(sd)


class PipelineTrainer(Trainer):
    def __init__(self, model, config, train_loader, val_loader, *, device: torch.device, seed: int,
                 eval_fn=None, eval_every: int = 0, stop_after_step: int = 0, metrics_file: Path | None = None,
                 max_seconds: float = 0.0, box=None, eval_max_seconds: float = 0.0, eval_share: float = 1.0,
                 warm_step: int = 0, fit: dict | None = None, profile=None, cut_at_step: int = 0,
                 data_start: int = 0, schedule_start: int = 0, backbone_lr_scale: float = 1.0):
        from training.box import Box
        self._device, self._seed, self._backbone_scale = device, seed, backbone_lr_scale
        self.box = box or Box(device)
        self._eval_cap, self._eval_share, self._warm_step = eval_max_seconds, eval_share, warm_step
        self.data_start = data_start  # the global step where this data's epoch 0 began (train.warm_mode)
        self.schedule_start = schedule_start  # the global step the LR schedule began at (train.warm_mode=restart)
        self.warm_started = False
        model.register_forward_pre_hook(self._count, with_kwargs=True)
        self._deadline = time.monotonic() + max_seconds if max_seconds else None
        self.deadline_hit = self.fit_reached = self.cut_hit = False
        self._cut = cut_at_step  # train.cut_at_step: this session ends the run at that global step, as a box would
        self._fit = fit if fit and max_seconds else None  # training/fit.py; needs a box
        self.fit_record: dict | None = None
        self._refit = None  # training/fit.py: the second Probe, in the pass after the fit's
        self._guard = None  # training/fit.py: the probes after the fit, back to back; a slower stretch shortens it
        self._epoch_start = (0, 0, 0)  # epoch, global step and local step where this epoch's loop started
        self._eval_fn, self._eval_every, self._stop_after = eval_fn, eval_every, stop_after_step
        self._metrics_file = metrics_file
        self.step_profile = profile  # training/profiling.StepProfile, or None
        # the fit's clock starts after the first step (it compiles) and after a profile (its steps and its summary
        # are spent before the fit measures what the box has left: a profile after the fit overran small boxes)
        skip = profile.start + profile.steps if profile is not None and profile.steps else 1
        self._fit_probe = Probe(skip, fit["probe"], self.box.sync, self._apart) if self._fit else None
        self.evals: list[dict] = []
        train_loader.generator = torch.Generator().manual_seed(seed)
        super().__init__(model, config, train_loader, val_loader)

    def setup_trainer(self):
        self.local_rank = self._device  # noqa: speculators 0.9.0 uses an int (CUDA) here
        self.checkpointer = Fp32Checkpointer(self.config.save_path, self._device)
        super().setup_trainer()
        if self._warm_step and self.checkpointer.previous_epoch == -1:  # warm start: where the run had got to
            per_epoch = len(self.train_loader)
            self.current_epoch, self._resume_local_step = divmod(self._warm_step - self.data_start, per_epoch)
            self._resume_global_step = self.global_step = self._warm_step
            self.warm_started = True

    def setup_optimizer(self):
        if self._backbone_scale == 1:
            super().setup_optimizer()
        else:  # training/cotrain.py: speculators 0.9.0's setup_optimizer builds its optimizers through the trainer
            import speculators.train.trainer as st  # module's build_optimizers, swapped for this call only
            from training.cotrain import optimizers
            real, st.build_optimizers = st.build_optimizers, lambda m, c: optimizers(m, c, self._backbone_scale)
            try:
                super().setup_optimizer()
            finally:
                st.build_optimizers = real
        from training.fit import check_schedulers, restart
        if self._fit:
            check_schedulers(self.schedulers)
        if self.schedule_start:  # warmup and decay anew from there to the run's end, which fit_box may move
            check_schedulers(self.schedulers, "train.warm_mode extend (fresh data) or resume (an export's own run)")
            restart(self.schedulers, self.schedule_start, self.config.scheduler_total_steps,
                    self.config.scheduler_warmup_ratio)
        if self.warm_started:  # the schedule at the warm step (LambdaLR: lr = base * lambda(last_epoch))
            for sched in self.schedulers:
                sched.last_epoch = self._warm_step - 1
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": on purpose
                    sched.step()

    def _count(self, module, args, kwargs):
        if module.training and "document_ids" in kwargs:
            self.box.count(kwargs["document_ids"], kwargs["loss_mask"])

    def _reseed(self):
        torch.manual_seed(self._seed * 1_000_003 + self.global_step)

    def _finish_here(self):
        """Checkpoint at this step and stop (StopRequested from maybe_save_checkpoint)."""
        epoch, g0, l0 = self._epoch_start
        self._stop_after = self.global_step
        self.maybe_save_checkpoint(epoch, local_step=l0 + self.global_step - g0)

    def _probed(self, probe) -> tuple[int, float, float, int] | None:
        """A finished probe (training/fit.py Probe): the step its clock started at, the steps/s, the box's seconds
        left and the plan they fit (fitted_total, looked up per call: tests replace it); None while it runs. The
        probes after the fit keep the seconds the fit reserved (its share of what was left then), not that share of
        what is left now, which shrinks as the box runs out."""
        from training.fit import fitted_total
        got = probe.tick(self.global_step)
        if got is None:
            return None
        (g1, rate), f = got, self._fit
        left = self._deadline - time.monotonic()
        reserve = f["reserve"] if self.fit_record is None else min(1.0, self._reserve_s / max(left, 1e-9))
        return g1, rate, left, fitted_total(self.global_step, rate, left, reserve, f["planned"])

    def _maybe_fit(self):
        """training/fit.py: time this process's `probe` steps after the first one and any profile, then fit the plan
        to what the box has left."""
        from training.fit import replan, warmup_running
        f, got = self._fit, self._probed(self._fit_probe)
        if got is None:
            return
        g1, rate, left, total = got
        warm = replan(self.schedulers, total, f["warmup_ratio"], warmup_running(self.schedulers, self.global_step,
                                                                                total)) if total < f["planned"] else None
        self.fit_record = {"probe_steps": [g1, self.global_step], "steps_per_s": round(rate, 3),
                           "box_left_s": round(left, 1), "reserve": f["reserve"], "planned_steps": f["planned"],
                           "fitted_steps": total, "warmup_steps": warm}
        print(f"fit to the box: {rate:.2f} steps/s over steps {g1}-{self.global_step}, {left:.0f} s left "
              f"(reserve {100 * f['reserve']:.0f}%): plan {f['planned']} -> {total} steps"
              + (f", warmup {warm}" if warm is not None else " (all of it fits)"), flush=True)
        self._reserve_s = f["reserve"] * left  # what the later probes keep free (_probed)
        self._guard = self._window()

    def _window(self) -> Probe:
        """A probe of the next `fit_probe_steps` steps after the next one (the refit's, and each after the fit)."""
        return Probe(1, self._fit["probe"], self.box.sync, self._apart)

    def _apart(self) -> float:
        """The seconds of what the box times apart from the steps (a probe leaves them out)."""
        return sum(self.box.parts.get(k, 0.0) for k in ("held_out", "checkpoints", "validation", "profile"))

    def _maybe_refit(self):
        """training/fit.py: the pass after the fit's probes its rate again, over as many steps after its first; where
        the box now holds more of the plan (a faster pass: the online target's cache serves the epochs after the
        first), the plan is fitted again, longer; where it holds less, shorter (`_replan_shorter`)."""
        from training.fit import replan, warmup_done
        f, got = self._fit, self._probed(self._refit)
        if got is None:
            return
        self._refit = None
        self._guard = self._window()  # the probes after the fit go on
        g1, rate, left, total = got
        before = self.fit_record["fitted_steps"]
        warm = None
        if total > before:  # a warmup already over keeps its length (its ratio of more steps would restart it)
            warm = replan(self.schedulers, total, f["warmup_ratio"], warmup_done(self.schedulers, self.global_step))
        elif total < before:
            warm = self._replan_shorter(total)
        self.fit_record["fitted_steps"] = total
        self.fit_record["refit"] = {"probe_steps": [g1, self.global_step], "steps_per_s": round(rate, 3),
                                    "box_left_s": round(left, 1), "before": before, "fitted_steps": total,
                                    "warmup_steps": warm}
        print(f"fit again, in the next pass: {rate:.2f} steps/s over steps {g1}-{self.global_step}, {left:.0f} s "
              f"left: plan {before} -> {total} steps", flush=True)

    def _maybe_shorten(self):
        """training/fit.py: after the fits, the step rate over each `probe` steps in turn; where the box no longer
        holds the plan, by more than fit.SHORTEN_SLACK of the steps left (a window's noise, which would otherwise
        walk the plan down to the slowest window's), the plan ends sooner (`_replan_shorter`)."""
        from training.fit import SHORTEN_SLACK
        got = self._probed(self._guard)
        if got is None:
            return
        self._guard = self._window()
        g1, rate, left, total = got
        step, before = self.global_step, self.fit_record["fitted_steps"]
        if total >= before - max(1, math.ceil(SHORTEN_SLACK * (before - step))):
            return
        warm = self._replan_shorter(total)
        self.fit_record["fitted_steps"] = total
        self.fit_record.setdefault("shortened", []).append(
            {"probe_steps": [g1, step], "steps_per_s": round(rate, 3), "box_left_s": round(left, 1),
             "before": before, "fitted_steps": total, "warmup_steps": warm})
        print(f"fit shorter: {rate:.2f} steps/s over steps {g1}-{step}, {left:.0f} s left: plan {before} -> {total} "
              f"steps", flush=True)

    def _replan_shorter(self, total: int) -> int:
        """The schedules re-planned to end at `total`, sooner than planned: a slower stretch (the fit's probe ran on
        steps that the online target's cache served, as a second model trained after the first gets them at its
        start) ends annealed there instead of cut by the deadline with its LR still high. A warmup over or under way
        keeps its length, as the fits keep it; returns the warmup steps."""
        from training.fit import replan, warmup_done, warmup_running
        step = self.global_step
        warm = warmup_done(self.schedulers, step)
        return replan(self.schedulers, total, self._fit["warmup_ratio"],
                      warm if warm is not None else warmup_running(self.schedulers, step, total))

    @property
    def planned_steps(self) -> int | None:
        """The fitted plan when it is shorter than the planned one, else None."""
        r = self.fit_record
        return r["fitted_steps"] if r and r["fitted_steps"] < r["planned_steps"] else None

    def _after_step(self):
        self.box.step_done()
        if self.step_profile is not None:
            self.step_profile.after_step(self.global_step, lambda: self.box.timed("profile"))
        self._reseed()
        if self._fit and self.fit_record is None:
            self._maybe_fit()
        elif self._refit is not None:
            self._maybe_refit()
        elif self._guard is not None:
            self._maybe_shorten()
        if self.planned_steps is not None and self.global_step >= self.planned_steps:  # the fitted plan's end
            self.fit_reached = True
            self._finish_here()
        if self._cut and self.global_step >= self._cut:  # the session's share of the schedule is done
            self.deadline_hit = self.cut_hit = True
            self._finish_here()
        if self._deadline is not None and time.monotonic() > self._deadline:  # out of time: checkpoint and stop
            self.deadline_hit = True
            self._finish_here()
        if self._eval_fn is not None and self._eval_every and self.global_step % self._eval_every == 0:
            elapsed = self.box.now() - self.box.t0
            if self.box.parts["held_out"] <= self._eval_share * elapsed:
                self.log_eval()

    def val_epoch(self, epoch):
        with self.box.timed("validation"):
            return super().val_epoch(epoch)

    def log_eval(self):
        with self.box.timed("held_out"):
            self._log_eval()

    def _log_eval(self):
        raw = getattr(self.model, "module", self.model)
        was = raw.training
        result = {"global_step": self.global_step, **self._eval_fn(raw, max_seconds=self._eval_cap)}
        raw.train(was)
        self.evals.append(result)
        where = result.get("set", "held-out")  # the pipeline evaluates on its selection split, not the held-out set
        if "prompts" in result:
            where += f", {result['prompts']}" + (f" of {result['of']}" if "of" in result else "") + " prompts"
        logging.getLogger("speculators").info(f"acceptance during training ({where}): {result}")
        print(f"acceptance during training @ step {self.global_step} ({where}): " +
              ", ".join(f"{k}={v:.3f}" for k, v in result.items() if isinstance(v, float)), flush=True)
        if self._metrics_file is not None:
            with self._metrics_file.open("a") as f:
                f.write(json.dumps({"eval": result}) + "\n")

    def train_epoch(self, epoch, *, step_callback=None):
        self._reseed()
        if self.fit_record is not None and "refit" not in self.fit_record and self._refit is None \
                and self.fit_record["fitted_steps"] < self.fit_record["planned_steps"]:
            self._refit = self._window()  # the fit cut the plan: again
            self._guard = None  # paused while the refit probes; it starts anew after
        skip = getattr(self, "_resume_local_step", 0) if epoch == getattr(self, "current_epoch", epoch) else 0
        self._epoch_start = (epoch, self.global_step, skip)
        swap = not torch.accelerator.is_available()
        original = trainer_module._StepTimer
        if swap:
            trainer_module._StepTimer = _HostTimer
        self.box.start_steps(epoch, self.global_step)
        try:
            return super().train_epoch(epoch, step_callback=self._after_step)
        finally:
            self.box.stop_steps()
            trainer_module._StepTimer = original

    def maybe_save_checkpoint(self, epoch, local_step: int = 0):
        with self.box.timed("checkpoints"):
            super().maybe_save_checkpoint(epoch, local_step=local_step)
        if self._stop_after and self.global_step >= self._stop_after and isinstance(epoch, int):
            raise StopRequested(self.global_step)


class MetricsFile(logging.Handler):
    """speculators logs its metrics as dicts on the `speculators.metrics` logger; one JSON line each here."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def emit(self, record):
        if isinstance(record.msg, dict):
            with self.path.open("a") as f:
                f.write(json.dumps(record.msg, default=float) + "\n")
