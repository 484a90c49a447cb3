"""train.cut_at_step: a run planned over several sessions, each cut at a chosen global step (where its device time
ends), continued by the next session's warm start (training/warm.py) on the same schedule."""
import json

import pytest

from training_fixtures import copy_stages, run_cli, tiny_models, write_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _lrs(work):
    rows = (work / "train" / "drafter" / "metrics.jsonl").read_text().splitlines()
    return {r["global_step"]: r["lr"] for r in map(json.loads, rows) if "train" in r}


def test_a_cut_run_exports_its_step_and_the_next_session_finishes_the_schedule(tmp_path, capsys):
    """Cut half-way (step c of n): the export records step c (truncated, the whole plan's n steps), and a warm start
    from it runs steps c..n-1 with the LR the uninterrupted run had at each; the cut is run control (no new
    fingerprint: the continuation reads the same data stages)."""
    cfg = write_config(tmp_path, tiny_models(heads=False), train={"epochs": 1, "warmup_ratio": 0.3,
                                                                 "eval_prompts": 0})
    assert run_cli("all", "--config", cfg, "--workdir", tmp_path / "full") == 0
    full = _lrs(tmp_path / "full")
    n = len(full)
    c = n // 2
    assert sorted(full) == list(range(n)) and n >= 4 and len(set(full.values())) > 3, full  # a moving schedule
    capsys.readouterr()
    assert run_cli("all", "--config", cfg, "--workdir", tmp_path / "cut", "--set", f"train.cut_at_step={c}") == 0
    assert f"train.cut_at_step reached at step {c} of {n}" in capsys.readouterr().out
    state = json.loads((tmp_path / "cut" / "export" / "drafter" / "train_state.json").read_text())
    assert (state["global_step"], state["planned_steps"], state["truncated"]) == (c, n, True)
    assert sorted(_lrs(tmp_path / "cut")) == list(range(c))
    copy_stages(tmp_path / "cut", tmp_path / "next")
    assert run_cli("all", "--config", cfg, "--workdir", tmp_path / "next", "--set",
                   f"train.warm_start={tmp_path / 'cut' / 'export'}") == 0
    rest = _lrs(tmp_path / "next")
    assert sorted(rest) == list(range(c, n)) and rest == {g: full[g] for g in rest}


def test_a_negative_cut_is_refused(tmp_path, capsys):
    cfg = write_config(tmp_path, tiny_models(heads=False))
    capsys.readouterr()
    assert run_cli("all", "--config", cfg, "--workdir", tmp_path / "w", "--set", "train.cut_at_step=-1") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.cut_at_step must be an integer >= 0" in err[0], err
    assert not (tmp_path / "w").exists()
