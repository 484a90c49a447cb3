"""The config's schedule numbers, checked when it loads (before any stage writes): train.epochs, lr, weight_decay,
warmup_ratio, train_ratio, the step counts, and each model's own epochs, lr and max_steps. A bad value here used to
surface only at the train stage, after the data stages had run (a str epoch count as a TypeError, a negative one
as a nonsense warm-start message, a negative lr as torch's own ValueError). check_acceptance: the acceptance
section's (training/evaluate.py)."""
from __future__ import annotations

import math

from core.errors import UsageError
from harness.decode.sampling import GREEDY_BELOW

TRAIN_INTS = (("epochs", 1), ("save_every", 0), ("eval_every", 0), ("eval_prompts", 0), ("eval_max_new_tokens", 1),
              ("num_workers", 0), ("stop_after_step", 0), ("max_minutes", 0))  # key, the least value
MODEL_INTS = ("epochs", "max_steps")  # a model's own: null (the train section's) or an integer >= 1


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check(cfg: dict) -> None:
    t = cfg["train"]
    for key, low in TRAIN_INTS:
        v = t[key]
        ok = (_number(v) if key == "max_minutes" else _int(v)) and v >= low
        if not ok:
            kind = "a number of minutes" if key == "max_minutes" else "an integer"
            raise UsageError(f"config train.{key} must be {kind} >= {low} (got {v!r})")
    if not _number(t["lr"]) or t["lr"] <= 0:
        raise UsageError(f"config train.lr must be a number > 0 (got {t['lr']!r})")
    for key, lo, hi in (("weight_decay", 0, None), ("warmup_ratio", 0, 1), ("train_ratio", 0, 1)):
        v = t[key]
        if not _number(v) or v < lo or (hi is not None and v > hi) or (key == "train_ratio" and v == 0):
            span = f"in ({lo}, {hi}]" if key == "train_ratio" else f">= {lo}" + (f" and <= {hi}" if hi else "")
            raise UsageError(f"config train.{key} must be a number {span} (got {v!r})")
    for name, m in cfg["models"].items():
        for key in MODEL_INTS:
            if m[key] is not None and (not _int(m[key]) or m[key] < 1):
                raise UsageError(f"config models.{name}.{key} must be an integer >= 1, or null for train's "
                                 f"(got {m[key]!r})")
        if m["lr"] is not None and (not _number(m["lr"]) or m["lr"] <= 0):
            raise UsageError(f"config models.{name}.lr must be a number > 0, or null for train.lr (got {m['lr']!r})")


def check_acceptance(cfg: dict, dtypes: tuple) -> None:
    """The acceptance section (training/evaluate.py): its dtype (auto or one of `dtypes`), time caps, benchmark
    datasets and sampled temperatures."""
    from training.store import repo_path
    a = cfg["acceptance"]
    if a["dtype"] not in ("auto",) + dtypes:
        raise UsageError(f"config acceptance.dtype {a['dtype']!r}: use auto or one of {', '.join(dtypes)}")
    for key in ("selection_max_seconds", "heldout_max_seconds", "bench_max_seconds"):
        if not isinstance(a[key], (int, float)) or isinstance(a[key], bool) or a[key] < 0:
            raise UsageError(f"config acceptance.{key} must be a number of seconds >= 0 (0: no cap)")
    if not isinstance(a["bench_prompts"], int) or isinstance(a["bench_prompts"], bool) or a["bench_prompts"] < 1:
        raise UsageError("config acceptance.bench_prompts must be an integer >= 1")
    ts = a["sampled_temperatures"]  # under GREEDY_BELOW the decode is greedy: not a sampled measurement
    if not isinstance(ts, list) or not all(isinstance(t, (int, float)) and not isinstance(t, bool)
                                           and math.isfinite(t) and t >= GREEDY_BELOW for t in ts) \
            or len(set(ts)) != len(ts):
        raise UsageError(f"config acceptance.sampled_temperatures {ts!r}: a list of distinct temperatures >= "
                         f"{GREEDY_BELOW:g} (below it the decode is greedy) at "
                         "which tau is measured sampled as well as greedy, e.g. [1] (--set "
                         "'acceptance.sampled_temperatures=[1]'); [] for greedy only")
    from harness.protocol.data import validate_dataset_args
    if not isinstance(a["bench"], list):
        raise UsageError("config acceptance.bench must be a list of data/eval dataset names, e.g. [\"gsm8k\"]")
    for name in a["bench"]:
        try:
            validate_dataset_args(name, str(repo_path(cfg["prompts"]["eval_dir"])), a["bench_prompts"])
        except UsageError as e:
            raise UsageError(f"config acceptance.bench {name!r} (read from prompts.eval_dir): {e}") from None
