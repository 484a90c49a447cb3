"""`train.profile_steps` = N: torch.profiler over N training steps after the process's `train.profile_start`-th
(default 3: the first compiles, the second may still warm up; smollm2-gpu takes 40, past the H200's warm-up steps);
with train.fit_box the fit's probe starts after them, so a later start also delays the probe (profiled steps are
slower: inside the probe they made the H200 run of 2026-12-02 fit 914 steps to a box that held about 1,400 at the
steady rate; after the probe their time was outside the fit, and 90-second boxes of 2026-12-03 ran 5 s over),
written to `train/<model>/profile.json`:

    steps, wall_s_per_step       the profiled steps and their wall time each (synchronised at both ends)
    device_busy_s_per_step       the kernels' time summed, per step (CUDA; 0 on a CPU)
    ranges                       the labelled parts of a step (`xb.*` record_function ranges, e.g. the online
                                 target forward), per step: host_s, device_s (the kernels launched inside) and
                                 device_span_s (CUDA: the range on the device's timeline, its idle gaps included)
    top                          the 30 host ops with the most own time (the device time of the kernels they
                                 launched on CUDA, host time on a CPU)
    top_kernels                  the 30 kernels with the most device time (CUDA)

The profiled steps run slower than the others (the profiler's own cost); they are counted in the box as steps, and
box.json names them (`profiled_steps`); writing the summary is the box's `profile` part. Nothing is profiled when N is 0.
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

from harness.lab.profiled import summary  # the record's format, shared with harness.lab.bench_generate --profile
from training.config import DEFAULTS

START = DEFAULTS["train"]["profile_start"]  # the step after which profiling starts by default (one source: the config)


class StepProfile:
    """Call `after_step()` after every training step; writes `path` once the N steps are profiled."""

    def __init__(self, path: Path, steps: int, device: torch.device, start: int = START):
        self.path, self.steps, self.device, self.start = Path(path), steps, device, start
        self.seen, self.prof, self.t0 = 0, None, 0.0
        self.first = None  # the global step the profile starts after

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def after_step(self, global_step: int, timed=None) -> None:
        """`timed`: a context manager factory (the box's `timed("profile")`) around writing the summary. A profiler
        that fails does not stop the training: profile.json records the error and profiling ends."""
        if not self.steps or self.seen > self.start + self.steps:
            return
        try:
            self._after_step(global_step, timed)
        except Exception as exc:  # noqa: BLE001 (a measurement aid; the run goes on without it)
            self.seen, self.prof, self.first = self.start + self.steps + 1, None, None
            self.path.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
            print(f"train: profiling stopped ({type(exc).__name__}: {exc}); training goes on", flush=True)

    def _after_step(self, global_step: int, timed) -> None:
        self.seen += 1
        if self.seen == self.start:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._sync()
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
            self.first, self.t0 = global_step, time.perf_counter()
        elif self.seen == self.start + self.steps and self.prof is not None:
            self._sync()
            wall = time.perf_counter() - self.t0
            with timed() if timed is not None else contextlib.nullcontext():
                self.prof.__exit__(None, None, None)
                rec = summary(self.prof.key_averages(), self.steps, wall, self.device.type == "cuda")
                rec["global_steps"] = [self.first + 1, global_step]
                self.path.write_text(json.dumps(rec, indent=1) + "\n")
            self.prof = None
            self.seen += 1  # done

    @property
    def profiled(self) -> list[int] | None:
        return [self.first + 1, self.first + self.steps] if self.first is not None else None
