"""JSON written by the commands: NaN and inf as null (strict parsers refuse bare NaN), numpy scalars as numbers."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from core.errors import UsageError


def json_safe(x):
    """JSON-safe: NaN and inf become None, numpy scalars become Python numbers."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    return x


def write_json_arg(path: str, obj, who: str) -> None:
    """A command's `--json PATH` output, written before the command prints anything: a path that cannot be written
    fails the command whole, in one line naming `who` (the command) and the path."""
    try:
        Path(path).write_text(json.dumps(json_safe(obj), indent=1, allow_nan=False) + "\n")
    except OSError as e:
        raise UsageError(f"{who}: --json {path}: cannot write it ({e.strerror})") from None
