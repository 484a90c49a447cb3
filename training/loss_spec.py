"""models.<name>.loss_fn, checked and put in the form speculators takes before any stage runs.

speculators 0.9.0 (speculators.losses.utils.resolve_loss_config) takes a loss name ("tv") or a JSON string mapping
names to weights ('{"ce": 0.1, "tv": 0.9}'), and fails inside the train stage, after the target has loaded, on
anything else: a dict given by a config file or by `--set 'models.x.loss_fn={"ce": 0.1, "tv": 1.8}'` (which parses
the value as JSON) raised "unhashable type: 'dict'" there. Here a dict is accepted and written back as the JSON
string, and an unknown name or a weight that is not a number > 0 is refused with the config, in a second.

models.<name>.per_position_loss_weight and dpace_alpha are speculators 0.9.0's weights of a block's slots in that loss
(losses/utils.py): fixed-exp-decay, exp(-(k - 1) / gamma) at slot k (models.<name>.gamma), what every model here
trained with before the field existed (its default when none is passed); or dpace (D-PACE, the weighting speculators'
own command line picks for a dflash drafter), which weighs slot k by the expected accepted run from it on (the sum
over i >= k of the product of the draft's smoothed confidences through slot i), the confidence read from the term's
elementwise loss as exp(-loss): the cross-entropy's, so the loss must be ce alone."""
from __future__ import annotations

import json
import math

from core.errors import UsageError

# speculators 0.9.0's loss names (its fused and eager maps hold the same keys); tests/test_loss_spec.py compares
# them with the installed speculators where it is installed
NAMES = ("ce", "jsd", "kl_div", "lk_hybrid", "nla", "rkl", "tv")
POSITION_WEIGHTS = ("fixed-exp-decay", "dpace")  # speculators 0.9.0's per_position_loss_weight choices
DPACE_ALPHA = 0.5  # speculators 0.9.0's default dpace_alpha


def mapping(spec):
    """The weights a loss_fn spec holds: a dict as it is, a JSON string parsed; None for a name or anything else
    (what check refuses, or the card prints as written)."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError:
            return None
    return spec if isinstance(spec, dict) else None


def check(where: str, m: dict) -> None:
    """m["loss_fn"]: a name, a JSON string or a dict of name -> weight; a dict is replaced by its JSON string."""
    spec = m["loss_fn"]
    if not (isinstance(spec, str) and spec in NAMES):
        _check_weights(where, m, spec)
    check_positions(where, m)


def _check_weights(where: str, m: dict, spec) -> None:
    weights = mapping(spec)
    bad = "not a name or a mapping" if not weights else next(
        (f"{k!r}: {w!r}" for k, w in weights.items() if k not in NAMES or isinstance(w, bool)
         or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0), None)
    if bad:
        raise UsageError(f"{where}: loss_fn {spec!r} is not a loss name ({', '.join(NAMES)}) or a mapping of those "
                         f"names to finite weights > 0 ({bad}), e.g. {{\"ce\": 0.1, \"tv\": 0.9}} (on the command "
                         "line: --set 'models.NAME.loss_fn={\"ce\": 0.1, \"tv\": 1.8}')")
    if isinstance(spec, dict):  # a string stays as written (the stages' keys hash the config)
        m["loss_fn"] = json.dumps(weights)


def check_positions(where: str, m: dict) -> None:
    """m["per_position_loss_weight"] one of POSITION_WEIGHTS, m["dpace_alpha"] in (0, 1] (speculators' range), and
    dpace only with the loss ce alone (checked after loss_fn, which it reads)."""
    how, alpha = m["per_position_loss_weight"], m["dpace_alpha"]
    if how not in POSITION_WEIGHTS:
        raise UsageError(f"{where}: per_position_loss_weight {how!r} is not one of {', '.join(POSITION_WEIGHTS)} "
                         "(fixed-exp-decay: exp(-(k - 1) / gamma) at slot k; dpace: D-PACE)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
        raise UsageError(f"{where}: dpace_alpha must be a number in (0, 1] (got {alpha!r})")
    if how != "dpace" and alpha != DPACE_ALPHA:  # else two runs alike would differ in their models' keys
        raise UsageError(f"{where}: dpace_alpha {alpha!r} is read only with per_position_loss_weight dpace, and this "
                         f"model's is {how}: set --set models.NAME.per_position_loss_weight=dpace, or drop dpace_alpha")
    weights = mapping(m["loss_fn"])
    if how == "dpace" and m["loss_fn"] != "ce" and (weights is None or set(weights) != {"ce"}):
        raise UsageError(f"{where}: per_position_loss_weight dpace reads the draft's confidence from the loss as "
                         f"exp(-loss), which holds for cross-entropy alone, and loss_fn is {m['loss_fn']!r}; use "
                         "loss_fn ce (--set models.NAME.loss_fn=ce) or per_position_loss_weight fixed-exp-decay")
