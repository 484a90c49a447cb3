"""A head co-trained with its drafter (`freeze_backbone` false), as the xPress paper's recipe trains it (drafter and
head together, the drafter held near its own logits by the base-anchor term): the head's tensors learn at `lr` and
the drafter's at `lr` x `backbone_lr_scale`, two parameter groups of one AdamW, so a head started from zeros can take
a head's learning rate while the trained drafter under it moves at a drafter's. The schedules (warmup, decay,
training/fit.py's refits) act on both groups alike. With the scale at 1 (the default) nothing changes: speculators
builds its one group as before."""
from __future__ import annotations

from core.errors import UsageError

HEAD_PREFIXES = ("refiner_head.", "markov_head.", "confidence_head.")  # a head model's own tensors; the rest: drafter


def check(where: str, m: dict) -> None:
    """models.<name>: freeze_backbone and backbone_lr_scale, checked with the config (before any stage runs)."""
    if m["freeze_backbone"] and m["init_from"] is None:
        raise UsageError(f"{where}: freeze_backbone needs init_from (a trained drafter to freeze)")
    s = m["backbone_lr_scale"]
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0:
        raise UsageError(f"{where}: backbone_lr_scale must be a number > 0 (got {s!r})")
    if s != 1 and (m["type"] == "dflash" or m["init_from"] is None or m["freeze_backbone"]):
        raise UsageError(f"{where}: backbone_lr_scale {s} scales the learning rate of a head's co-trained drafter: it "
                         "needs a head type (xpress, dspark) with init_from and freeze_backbone false (got type "
                         f"{m['type']}, init_from {m['init_from']!r}, freeze_backbone {m['freeze_backbone']})")


def optimizers(model, config, scale: float) -> list:
    """speculators' own optimizer for optimizer "adamw" (speculators.train.optimizers.build_optimizers: one AdamW over
    every parameter, one group), its group cut to the head's parameters and the drafter's added as a second group at
    its lr x scale (the group's other settings carried over by torch's add_param_group)."""
    from speculators.train.optimizers import build_optimizers
    built = build_optimizers(model, config)
    if config.optimizer != "adamw" or len(built) != 1 or len(built[0].param_groups) != 1:
        raise UsageError(f"backbone_lr_scale works with the adamw optimizer only (got {config.optimizer!r})")
    head, body = [], []
    for name, p in model.named_parameters():
        (head if name.startswith(HEAD_PREFIXES) else body).append((name, p))
    if not head:
        raise UsageError("backbone_lr_scale: this model has no head tensors (" + ", ".join(HEAD_PREFIXES) + ")")
    opt, (group,) = built[0], built[0].param_groups
    group["params"] = [p for _, p in head]
    second = {"params": [p for _, p in body], "lr": group["lr"] * scale}
    if "param_names" in group:  # speculators passes named_parameters(): the group keeps the names beside them
        group["param_names"], second["param_names"] = [n for n, _ in head], [n for n, _ in body]
    opt.add_param_group(second)
    return [opt]
