"""models.<name>.loss_fn, checked and put in the form speculators takes before any stage runs.

speculators 0.9.0 (speculators.losses.utils.resolve_loss_config) takes a loss name ("tv") or a JSON string mapping
names to weights ('{"ce": 0.1, "tv": 0.9}'), and fails inside the train stage, after the target has loaded, on
anything else: a dict given by a config file or by `--set 'models.x.loss_fn={"ce": 0.1, "tv": 1.8}'` (which parses
the value as JSON) raised "unhashable type: 'dict'" there. Here a dict is accepted and written back as the JSON
string, and an unknown name or a weight that is not a number > 0 is refused with the config, in a second."""
from __future__ import annotations

import json
import math

from core.errors import UsageError

# speculators 0.9.0's loss names (its fused and eager maps hold the same keys); tests/test_loss_spec.py compares
# them with the installed speculators where it is installed
NAMES = ("ce", "jsd", "kl_div", "lk_hybrid", "nla", "rkl", "tv")


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
    if isinstance(spec, str) and spec in NAMES:
        return
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
