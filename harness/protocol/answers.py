"""The answer files: the reference harness's per-sample schema, written from a run's sample rows."""
from __future__ import annotations

import json
import os
import time

from harness.protocol.results_io import atomic_write

TIMING_FIELDS = ("wall_time", "prefill_times", "drafter_prefill_times", "decode_times")


def _choice(index: int, arm, rows: list[dict], tokenizer, timing: bool) -> dict:
    choice = {"index": index, "block_size": arm.block_size if arm else None, "method": arm.name if arm else None,
              "turns": [tokenizer.decode(r["tokens"], skip_special_tokens=True) for r in rows],
              "new_tokens": [r["new_tokens"] for r in rows],
              "wall_time": [r["ttft_s"] + r["drafter_prefill_s"] + r["decode_s"] for r in rows],
              "prefill_times": [r["ttft_s"] for r in rows],
              "drafter_prefill_times": [r["drafter_prefill_s"] for r in rows],
              "decode_times": [r["decode_s"] for r in rows],
              "acceptance_lengths": [r["accept_lengths"] for r in rows],
              "stop_reason": [r["stop_reason"] for r in rows]}
    if not timing:
        for key in TIMING_FIELDS:
            del choice[key]
    return choice


def write_answer_files(cfg, rows: list[dict], samples, tokenizer, arms: list) -> list[tuple[str, int]]:
    """The reference's per-sample schema from the last round: choices[0] = AR, choices[1] = a speculative arm.

    With several speculative arms, one file per arm: <root>.<arm><ext>. Each file is written to a temporary name
    and renamed, so an interrupted run leaves no half-written answer file.
    """
    last = max(r["round"] for r in rows)
    turns = {}
    for r in rows:
        if r["round"] == last:
            turns.setdefault((r["arm"], r["question_id"]), []).append(r)
    for v in turns.values():
        v.sort(key=lambda r: r["turn"])
    ar = next((a for a in arms if a.spec.method == "ar"), None)
    spec = [a for a in arms if a.spec.method != "ar"] or [None]
    root, ext = os.path.splitext(cfg.answer_file)
    written = []
    for arm in spec:
        path = cfg.answer_file if len(spec) == 1 else f"{root}.{_slug(arm.name)}{ext}"
        lines = []
        for qid, s in enumerate(samples):
            choices = [_choice(i, a, turns.get((a.name, qid), []) if a else [], tokenizer, not cfg.no_answer_timing)
                       for i, a in enumerate((ar, arm))]
            row = {"question_id": qid, "dataset": cfg.dataset, "dataset_row": s.row, "choices": choices}
            if not cfg.no_answer_timing:
                row["tstamp"] = time.time()
            lines.append(json.dumps(row, ensure_ascii=False) + "\n")
        atomic_write(path, "".join(lines))
        written.append((path, len(samples)))
    return written


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()

