"""The labels a run's numbers carry wherever they are printed (its tables, plots, the merged report, the console):
what its weights are and what changed how it ran, from its config alone."""
from __future__ import annotations

import os

RANDOM_HEADS = "random drafter/heads (scripts/make_random_*)"
RANDOM_MARK = "RANDOM_WEIGHTS.txt"  # written by scripts/make_random_drafter.py and make_random_refiners.py


def weights_label(config: dict) -> str | None:
    """Numbers from random weights or scripted acceptance say so wherever they appear; so do runs of a real target
    with a drafter or heads that the random-weights scripts made. `config`: config.json or the RunConfig as a dict."""
    from harness.protocol.presets import timing_label
    timing = timing_label(config)
    if timing:
        return timing
    paths = (config.get("draft_name_or_path"), config.get("xpress_refiner_path"), config.get("markov_refiner_path"))
    if any(p and os.path.isfile(os.path.join(p, RANDOM_MARK)) for p in paths):
        return RANDOM_HEADS
    return None


def config_labels(config: dict) -> list[str]:
    """The labels of a run from its config (config.json or the RunConfig as a dict; "resumes": how many times its
    folder was resumed with decodes already written, harness.protocol.plan.resume_count)."""
    from harness.protocol.trace import TRACED_LABEL
    n, weights = config.get("resumes") or 0, weights_label(config)
    return [text for on, text in (
        (weights, weights), (config.get("trace"), TRACED_LABEL),
        (config.get("compat_reference"), "compat (the reference's accounting)"),
        (config.get("record_logit_gaps"), "logit gaps recorded (a top-2 per step inside the timer)"),
        (config.get("refine_numerics") == "spyre", "xPress on Spyre's numerics (--refine-numerics spyre)"),
        (n, f"resumed {n}x: some rounds ran in more than one process (resumes.json)")) if on]


def recorded_weights(summary: dict, config: dict) -> str | None:
    """The weights label a run recorded in its summary (its labels, written when it ran), else, for a summary
    from before the labels, what its config says now (weights_label reads the disk: a folder moved or deleted
    since reads as trained weights)."""
    if "labels" not in summary and "label" not in summary:
        return weights_label(config)
    from harness.protocol.presets import RANDOM_LABEL, RANDOM_ONLY_LABEL, SCRIPTED_LABEL
    from harness.protocol.tables import run_labels
    texts = (RANDOM_LABEL, RANDOM_ONLY_LABEL, SCRIPTED_LABEL, RANDOM_HEADS)  # what weights_label writes
    return next((x for x in run_labels(summary) if x in texts), None)


ARM_ALIASES = {"ar": "AR", "drafter": "drafter-only", "markov": "Markov"}


def arm_name(a: str) -> str:
    """An arm as summary.json names it, from the shorthand commands and README markers take: `ar`, `drafter`,
    `markov`, `x4` (xPress at K=4); any other name is taken as written."""
    if a in ARM_ALIASES:
        return ARM_ALIASES[a]
    if a[:1] == "x" and a[1:].isdigit():
        return f"xPress(K={a[1:]})"
    return a
