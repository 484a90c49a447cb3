"""models.X.backbone_lr_scale (training/cotrain.py): a head co-trained with its drafter learns at lr and the drafter
under it at lr x scale, two groups of one AdamW that speculators' schedules move together; checked with the config,
before any stage runs, and invisible to the fingerprint of a model trained before it existed."""
from types import SimpleNamespace

import pytest
import torch

from core.errors import UsageError


class Head(torch.nn.Module):
    """A head model's parameter names: refiner_head.* the head's, the rest its drafter's."""
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Linear(4, 4)
        self.refiner_head = torch.nn.Linear(4, 2)


def _trainer(scale: float, warmup: int = 10, total: int = 100):
    """A PipelineTrainer with only what setup_optimizer reads (its loaders and models are not built)."""
    from speculators.train.trainer import TrainerConfig
    from training.trainer import PipelineTrainer
    t = PipelineTrainer.__new__(PipelineTrainer)
    t.model, t.train_loader = Head(), [None] * total
    t.config = TrainerConfig(lr=1e-2, num_epochs=1, save_path="unused", scheduler_type="cosine",
                             scheduler_warmup_steps=warmup, scheduler_total_steps=total, weight_decay=0.0)
    t.resume_from_checkpoint, t._backbone_scale, t._fit, t.schedule_start, t.warm_started = False, scale, None, 0, False
    t.setup_optimizer()
    return t


def test_the_drafter_learns_at_the_scaled_rate_through_the_schedule():
    t = _trainer(0.05)
    (opt,) = t.optimizers
    head, body = opt.param_groups
    assert {id(p) for p in head["params"]} == {id(p) for p in t.model.refiner_head.parameters()}
    assert {id(p) for p in body["params"]} == {id(p) for p in t.model.layers.parameters()}
    for _ in range(30):  # through the warmup and into the decay: the ratio holds, the rates move
        opt.step()
        for s in t.schedulers:
            s.step()
        assert body["lr"] == pytest.approx(0.05 * head["lr"], rel=1e-12) and head["lr"] > 0
    assert head["lr"] < 1e-2
    import speculators.train.trainer as st
    from speculators.train.optimizers import build_optimizers
    assert st.build_optimizers is build_optimizers  # put back after the call


def test_scale_one_is_speculators_own_optimizer():
    (opt,) = _trainer(1.0).optimizers
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["initial_lr"] == 1e-2


@pytest.mark.parametrize("model, match", [
    ({"backbone_lr_scale": 0}, "must be a number > 0"),
    ({"backbone_lr_scale": True}, "must be a number > 0"),
    ({"backbone_lr_scale": 0.1, "freeze_backbone": True}, "co-trained drafter"),
    ({"backbone_lr_scale": 0.1, "init_from": None, "freeze_backbone": False}, "co-trained drafter"),
    ({"backbone_lr_scale": 0.1, "type": "dflash", "freeze_backbone": False}, "co-trained drafter"),
    ({"freeze_backbone": True, "init_from": None}, "freeze_backbone needs init_from"),
])
def test_bad_settings_are_refused_in_one_line(model, match):
    from training import cotrain
    m = {"type": "xpress", "init_from": "drafter", "freeze_backbone": False, "backbone_lr_scale": 1.0, **model}
    with pytest.raises(UsageError, match=match) as e:
        cotrain.check("models.xpress", m)
    assert "\n" not in str(e.value)


def test_a_co_trained_head_and_a_frozen_one_are_accepted():
    from training import cotrain
    cotrain.check("models.xpress", {"type": "xpress", "init_from": "drafter", "freeze_backbone": False,
                                    "backbone_lr_scale": 0.06})
    cotrain.check("models.markov", {"type": "dspark", "init_from": "drafter", "freeze_backbone": True,
                                    "backbone_lr_scale": 1.0})


def test_a_model_trained_before_the_key_keeps_its_fingerprint():
    from training.config import load_config, model_fingerprint
    cfg = load_config("tiny-cpu")
    name = next(iter(cfg["models"]))
    before = model_fingerprint({**cfg, "models": {name: {k: v for k, v in cfg["models"][name].items()
                                                         if k != "backbone_lr_scale"}}}, name)
    assert model_fingerprint(cfg, name) == before
    cfg["models"][name]["backbone_lr_scale"] = 0.5
    assert model_fingerprint(cfg, name) != before


def test_the_optimizer_refuses_a_model_without_head_tensors():
    from training.cotrain import optimizers
    with pytest.raises(UsageError, match="no head tensors"):
        optimizers(torch.nn.Linear(2, 2), SimpleNamespace(optimizer="adamw", lr=1e-3, weight_decay=0.0), 0.1)
