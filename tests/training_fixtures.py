"""A tiny pipeline run shared by the training tests: a random tiny target, a config over it, and helpers."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tiny import save_tiny_checkpoint

# The training tests need speculators (pip install --no-deps -r requirements-speculators.txt, then
# requirements-training.txt). Without it they skip, except under CI (CI=true), where .ci/run installs it and a
# missing install must fail rather than skip.
if not os.environ.get("CI"):
    pytest.importorskip("speculators", reason="training tests need speculators: pip install --no-deps -r "
                        "requirements-speculators.txt && pip install -r requirements-training.txt")

EVAL_ROW = "Write a python function to find the volume of a triangular prism."


def tiny_models(variant="vanilla", heads=True) -> dict:
    common = {"num_layers": 1, "block_size": 4, "intermediate_size": 64, "max_anchors": 16}
    models = {"drafter": {"type": "dflash", **common}}
    if heads:
        models["xpress"] = {"type": "xpress", **common, "init_from": "drafter", "freeze_backbone": True,
                            "xpress_rank": 8}
        models["markov"] = {"type": "dspark", **common, "init_from": "drafter", "freeze_backbone": True,
                            "markov_rank": 8, "markov_head_type": variant}
    return models


def write_config(root: Path, models: dict | None = None, **sections) -> Path:
    target = root / "target"
    if not target.exists():
        save_tiny_checkpoint(target)
    evals = root / "eval"
    evals.mkdir(exist_ok=True)
    (evals / "mbpp.jsonl").write_text(json.dumps({"turns": [EVAL_ROW]}) + "\n")
    data = root / "train.jsonl"
    if not data.exists():
        rows = [{"question": f"What is {a} plus {b} times {a + b}? Answer briefly."} for a in range(6) for b in (1, 2)]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"target": str(target), "seed": 0,
           "prompts": {"jsonl": [str(data)], "magpie": 2, "magpie_max_new_tokens": 12, "magpie_batch": 2,
                       "min_chars": 4, "heldout": 2, "selection": 2, "eval_dir": str(evals)},
           "responses": {"max_new_tokens": 12, "batch_size": 8, "sampled": 1},
           "hidden": {"layer_ids": [1, 3, 5], "batch_size": 8, "dtype": "float32"},
           "train": {"device": "cpu", "total_seq_len": 128, "epochs": 1, "lr": 1e-3, "eval_prompts": 1,
                     "eval_max_new_tokens": 6, "warmup_ratio": 0.0},
           "export": {"max_shard_mib": 0.05},
           "models": models or tiny_models()}
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    path = root / "cfg.json"
    path.write_text(json.dumps(cfg))
    return path


def run_cli(*args) -> int:
    from training.__main__ import main
    return main([str(a) for a in args])


DATA_STAGES = ("prompts", "responses", "hidden")


def make_stages(cfg: Path, work: Path) -> Path:
    """The data stages of `cfg` run into `work` (once, for the runs that copy them: `copy_stages`)."""
    for stage in DATA_STAGES:
        assert run_cli(stage, "--config", cfg, "--workdir", work) == 0
    return work


def copy_stages(src: Path, work: Path) -> Path:
    """`work` with the data stages of the workdir `src` copied in: a run there on the same config finds them up to
    date and trains on the same data."""
    import shutil
    for stage in DATA_STAGES:
        shutil.copytree(src / stage, work / stage)
    return work


def run_on(root: Path, cfg: Path, work: str, *sets: str, data: str | None = None) -> int:
    """`python -m training all` in root/work with these --set items, the prompts, responses and hidden stages of
    root/data copied in first (the same data as that run's)."""
    if data:
        copy_stages(root / data, root / work)
    return run_cli("all", "--config", cfg, "--workdir", root / work, *[x for item in sets for x in ("--set", item)])


def step_lrs(work: Path, name: str = "drafter") -> dict:
    """Each logged training step's LR (train/<name>/metrics.jsonl), by global step."""
    text = (work / "train" / name / "metrics.jsonl").read_text()
    return {r["global_step"]: r["lr"] for r in map(json.loads, text.splitlines()) if "train" in r}


def harness_from_export(target_dir: Path, export_dir: Path):
    """(backend, harness Target, DFlashDrafter) from a target directory and an export stage's output, on CPU fp32."""
    import torch
    from drafters.dflash import DFlashDrafter, load_dflash, read_dflash_config
    from core.devices import Backend
    from harness.decode.loading import load_target
    backend = Backend(torch.device("cpu"), torch.float32)
    dcfg = read_dflash_config(export_dir / "drafter")
    target, _ = load_target(str(target_dir), backend, taps=dcfg.target_layer_ids)
    dcfg.check_target(target.config)
    drafter = DFlashDrafter(load_dflash(export_dir / "drafter", dcfg, backend), target.embed, target.lm_head, backend)
    return backend, target, drafter


def xpress_tokens_and_ar(backend, target, drafter, head_state) -> tuple[list, list]:
    """A short greedy decode with an xPress head (K=2) on this drafter, and AR's on the same prompt."""
    from harness.decode.loop import DecodeSettings, generate
    from refiners.xpress import XPressRefiner, xpress_head_from_state
    s = DecodeSettings(max_new_tokens=16, max_model_len=128, stop_ids=(3, 5))
    prompt = [11, 40, 23, 77, 9]
    got = generate(target, prompt, s, backend, drafter=drafter,
                   refiner=XPressRefiner(xpress_head_from_state(head_state), 2)).tokens
    return got, generate(target, prompt, s, backend).tokens
