"""The marker file the random-weights scripts leave beside their weights, so every run of them is labelled."""
from __future__ import annotations

from pathlib import Path

NAME = "RANDOM_WEIGHTS.txt"  # harness.protocol.labels.RANDOM_MARK reads it


def mark(folder: str | Path) -> None:
    (Path(folder) / NAME).write_text("Random weights made by scripts/make_random_*.py: tau is near 1, and every run "
                                     "with them is labelled so.\n")
