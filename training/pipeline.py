"""The stages in order over one config: loads the target once (lazily: a stage that is up to date loads nothing)
and checks what can be checked from configs alone before the first stage runs. After the train stage, every final
model's selection and held-out tau (training/evaluate.py); each stage that did work records its wall time in
<workdir>/stages.json (training/stages.py)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from training import evaluate, export, hidden, prompts, responses, train
from core.errors import UsageError
from training.stages import stage_clock
from training.store import read_manifest
from training.target import load_hf, target_config, verifier_dir

# a stage run alone: the stage whose output it reads, and that output's folder (`export` checks its models itself)
BEFORE = {"responses": ("prompts", prompts.out_dir), "hidden": ("responses", responses.out_dir),
          "train": ("hidden", hidden.out_dir)}


class Pipeline:
    def __init__(self, cfg: dict, eval_dir: str | None = None, force: bool = False):
        self.cfg, self.eval_dir, self.force = cfg, eval_dir, force
        self._hf = None
        self._typed: dict = {}
        self.stopped = False  # the workdir is made by the first stage that runs, after the preflight's checks

    def device(self) -> torch.device:
        return train.device_of(self.cfg)

    def load(self):
        if self._hf is None:
            self._hf = load_hf(self.cfg["target"], self.device())
        return self._hf

    def preflight(self, stages) -> None:
        """Target/model compatibility and resume checks from configs alone (no weights read), and each stage's
        input: a stage run alone needs the stage before it done (its manifest in the workdir)."""
        for s in stages:
            before = BEFORE.get(s)
            if before is not None and before[0] not in stages and read_manifest(before[1](self.cfg)) is None:
                raise UsageError(f"the {s} stage reads the {before[0]} stage's output, and {before[1](self.cfg)} has "
                                 f"none: run `python -m training {before[0]}` with this config and workdir first (or "
                                 "`all`, every stage in order)")
        if {"prompts", "responses"} & set(stages):  # the engine and its attention, before any stage writes
            from training.gen import check_engine
            check_engine(self.cfg)
        tcfg = target_config(self.cfg["target"])
        self.device()  # train.device=cuda without a CUDA device: refused before the workdir is made
        hidden.layer_ids(self.cfg, tcfg.num_hidden_layers)
        for n in self.cfg["models"]:
            train.check_target_fit(self.cfg, n, tcfg)
            if {"train", "export"} & set(stages):  # before the box, not after it
                export.check_fit(self.cfg, n, tcfg)
            if "train" in stages and train.final_dir(self.cfg, n) is None:
                train.check_resume(self.cfg, n)

    def _held(self, ids: list[list[int]]):
        from core.devices import Backend
        from training.acceptance import HeldOut, acceptance_dtype
        from training.gen import stop_ids
        from training.hidden import target_in_dtype
        model, tok = self.load()
        tc = self.cfg["train"]
        dtype = acceptance_dtype(self.cfg["acceptance"]["dtype"], model.device)
        backend = Backend(model.device, dtype)
        if dtype not in self._typed:  # one copy per dtype, shared by every evaluation of the run
            self._typed[dtype] = target_in_dtype(model, dtype)
        return HeldOut(self._typed[dtype], ids, stop_ids(model, tok), backend, tc["eval_max_new_tokens"],
                       tc["eval_k"], use_graph=model.device.type == "cuda")

    def _ids(self, rows: list[dict]) -> list[list[int]]:
        """Prompt ids: the chat template over the row's text, or the protocol's rendering (bench rows)."""
        from harness.protocol.data import render_prompt
        from training.responses import chat_ids
        tok = self.load()[1]
        return [render_prompt(tok, [{"role": "user", "content": r["text"]}]) if r.get("render") == "protocol"
                else chat_ids(tok, r["text"]) for r in rows]

    def held_out(self):
        """The trainer's evaluation: the first train.eval_prompts of the selection set (never the held-out set)."""
        from training.acceptance import SetEval
        from training.evaluate import read_set
        rows = read_set(self.cfg, "selection")
        return SetEval(self._held(self._ids(rows[:self.cfg["train"]["eval_prompts"]])), "selection", len(rows))

    def sets_held(self, rows: dict):
        """For training/evaluate.py: one HeldOut sized for every prompt of both sets, and each set's ids."""
        ids = {s: self._ids(r) for s, r in rows.items()}
        return self._held([p for v in ids.values() for p in v]), ids

    def run(self, stage: str, only=None) -> None:
        Path(self.cfg["workdir"]).mkdir(parents=True, exist_ok=True)
        with stage_clock(Path(self.cfg["workdir"]), stage):
            self._run(stage, only)

    def _run(self, stage: str, only=None) -> None:
        cfg = self.cfg
        if stage == "prompts":
            prompts.run(cfg, self.eval_dir, self.force, load=self.load)
        elif stage == "responses":
            responses.run(cfg, self.load, self.force)
        elif stage == "hidden":
            hidden.run(cfg, self.load, self.force)
        elif stage == "train":
            vdir = verifier_dir(cfg["target"], Path(cfg["workdir"]))
            done = train.run(cfg, vdir, self.held_out if cfg["train"]["eval_prompts"] else None, only, load=self.load)
            wanted = [n for n in cfg["models"] if not only or n in only]
            self.stopped = any(done.get(n) is None for n in wanted)  # cut short: later stages wait for the rerun
            if not self.stopped:
                evaluate.run(cfg, wanted, self.sets_held)
        elif stage == "export":
            export.run(cfg, target_config(cfg["target"]).num_hidden_layers)
