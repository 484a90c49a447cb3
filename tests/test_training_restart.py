"""train.warm_mode=restart (training/warm.py, training/fit.py): a drafter continued on fresh data with its LR schedule
begun anew at the warm step (warmup from 0, decay to 0 at the run's end), where extend continues the first run's
decay, which a box fitted short takes to nearly 0."""
import json
import math

import pytest
import torch

from training_fixtures import run_on, step_lrs, tiny_models, write_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_restart_runs_a_fresh_schedule_from_the_warm_step_and_resumes_on_it(tmp_path):
    """A run cut at step W = E + 2, warm-started with restart and 2 epochs: the LR at step W + g equals a run from
    scratch's at step g, for every step of its 2E; the manifest and export record schedule_start W; the restart
    run cut at W + E + 3 and continued with resume ends on the uncut restart run's LRs. Power: extend's first LR is
    its decay's tail, not the warmup's 0 (checked), and a resume that dropped schedule_start would continue the
    unshifted schedule, whose LRs differ."""
    cfg = write_config(tmp_path, tiny_models(heads=False), train={"epochs": 2, "warmup_ratio": 0.3, "eval_prompts": 0})

    def run(work, *sets, data="one"):
        return run_on(tmp_path, cfg, work, *sets, data=data)

    def lrs(work):
        return step_lrs(tmp_path / work)

    assert run("one", data=None) == 0  # from scratch: 2 epochs of E steps
    scratch = lrs("one")
    e = len(scratch) // 2
    w = e + 2
    assert e >= 4 and run("cut", f"train.cut_at_step={w}") == 0
    export = tmp_path / "cut" / "export"
    assert run("rst", f"train.warm_start={export}", "train.warm_mode=restart") == 0
    rst = lrs("rst")
    assert sorted(rst) == list(range(w, w + 2 * e))
    assert rst == {w + g: lr for g, lr in scratch.items()} and len(set(rst.values())) > 3
    m = json.loads((tmp_path / "rst" / "train" / "drafter" / "manifest.json").read_text())
    assert m["data_start"] == m["schedule_start"] == w and m["planned_steps"] == w + 2 * e
    assert run("ext", f"train.warm_start={export}", "train.warm_mode=extend") == 0
    assert lrs("ext")[w] > 0 == rst[w]  # extend: the decay's tail; restart: the warmup's start
    assert run("rst_cut", f"train.warm_start={export}", "train.warm_mode=restart", f"train.cut_at_step={w + e + 3}") == 0
    export2 = tmp_path / "rst_cut" / "export"
    state = json.loads((export2 / "drafter" / "train_state.json").read_text())
    assert state["schedule_start"] == state["data_start"] == w
    assert run("cont", f"train.warm_start={export2}") == 0
    cont = lrs("cont")
    assert min(cont) == w + e + 3 and cont == {g: rst[g] for g in cont}
    # extend from the restart export keeps its schedule's start: the decay from step w stretched over 2 more epochs
    w2 = w + e + 3
    assert run("ext2", f"train.warm_start={export2}", "train.warm_mode=extend") == 0
    m2 = json.loads((tmp_path / "ext2" / "train" / "drafter" / "manifest.json").read_text())
    assert m2["schedule_start"] == w and m2["data_start"] == w2 and m2["planned_steps"] == w2 + 2 * e
    span = w2 + 2 * e - w
    warm = int(0.3 * span)
    want = 0.5 * (1 + math.cos(math.pi * (w2 - w - warm) / (span - warm)))
    assert lrs("ext2")[w2] == pytest.approx(max(scratch.values()) * want, rel=1e-6)


def test_restart_and_replan_arithmetic():
    """fit.restart begins the schedule at a step (warmup its ratio of the steps left), replan keeps that start when
    the box moves the end, and warmup_done counts from it."""
    from transformers import get_cosine_schedule_with_warmup

    from training.fit import replan, restart, start_of, warmup_done, warmup_running
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    s = [get_cosine_schedule_with_warmup(opt, 3, 100)]
    assert start_of(s) == 0 and warmup_done(s, 3) == 3
    assert restart(s, 10, 30, 0.2) == 4  # 20 steps from 10: a warmup of 4
    f = s[0].lr_lambdas[0]
    assert start_of(s) == 10 and f(10) == 0 and f(12) == 0.5 and f(14) == 1 and f(30) == 0
    assert abs(f(22) - 0.5) < 1e-12  # half-way through the decay from 14 to 30
    assert warmup_done(s, 13) is None and warmup_done(s, 14) == 4
    assert replan(s, 20, 0.2) == 2  # the box ends it at 20: 10 steps from 10
    f = s[0].lr_lambdas[0]
    assert f(10) == 0 and f(12) == 1 and f(20) == 0 and start_of(s) == 10
    # a fit inside the warmup keeps its length: the LR goes on up the same ramp (a restart's fit lands there)
    restart(s, 10, 30, 0.2)
    assert warmup_running(s, 12, 20) == 4 and warmup_running(s, 14, 20) is None
    assert warmup_running(s, 12, 17) is None  # a warmup over half of the fitted plan: the plan's ratio instead
    assert replan(s, 20, 0.2, warmup_running(s, 12, 20)) == 4 and s[0].lr_lambdas[0](12) == 0.5
    assert start_of([]) == 0 and warmup_running([], 3, 9) is None and replan([], 10, 0.1) == 1  # scheduler none


@pytest.mark.parametrize("sets, message", [
    ({"scheduler": "exp"}, "train.scheduler 'exp': use one of linear, cosine, none"),
    ({"scheduler": "none", "warm_mode": "restart"}, "train.warm_mode restart begins the LR schedule anew"),
])
def test_schedule_settings_are_checked_before_anything_loads(tmp_path, sets, message):
    from core.errors import UsageError
    from training.config import load_config
    with pytest.raises(UsageError, match=message):
        load_config(str(write_config(tmp_path, tiny_models(heads=False), train=sets)))
