"""--trace: one JSON line per decode step, to see where and why drafts are rejected.

Reading the step's tensors costs host syncs, so a tracer exists only when --trace is given; timed runs without it
pass no step callback at all.
"""
from __future__ import annotations

import json


class StepTracer:
    def __init__(self, path: str):
        self.file = open(path, "w", encoding="utf-8")
        self.context: dict = {}

    def set_context(self, **fields) -> None:
        """Who the next steps belong to: arm, prompt id, dataset row, turn."""
        self.context = fields

    def __call__(self, rec: dict) -> None:
        proposal = rec["proposal"]
        block = rec["block"].tolist()
        row = {**self.context, "position": rec["position"], "speculative": rec["speculative"],
               "anchor": block[0], "draft": block[1:],
               "seed_draft": (proposal.seed.tolist() if proposal is not None and proposal.seed is not None
                              else block[1:]),
               "accepted": rec["accepted"], "next_token": int(rec["next_token"]), "emitted": rec["emitted"],
               "stop": rec["stop"] or None}
        self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self.file.close()
