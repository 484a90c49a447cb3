"""--trace: one JSON line per decode step, to see where and why drafts are rejected.

Reading the step's tensors costs host syncs and a write per step, so the tracer never runs inside a timed
decode: `timed_then_traced` runs the decode timed with no step callback, then replays it untimed from the same
generator state with the tracer (same seeds, so the same tokens; a replay that differs says so in the trace).
The timed run's numbers are the ones reported. The compat accounting's extra step after an EOS is traced too
(`extra_step: true`, nothing emitted).
"""
from __future__ import annotations

import json
from typing import Callable

TRACED_LABEL = "traced (steps replayed untimed)"


class StepTracer:
    def __init__(self, path: str, append: bool = False):
        """append: a resumed run (--resume) adds its steps after the interrupted process's instead of replacing
        them (the rows it keeps were traced there)."""
        self.file = open(path, "a" if append else "w", encoding="utf-8")
        self.context: dict = {}

    def set_context(self, **fields) -> None:
        """Who the next steps belong to: arm, prompt id, dataset row, turn."""
        self.context = fields

    def __call__(self, rec: dict) -> None:
        proposal = rec["proposal"]
        block = rec["block"].tolist()
        row = {**self.context, "position": rec["position"], "speculative": rec["speculative"],
               "anchor": block[0], "draft": block[1:],
               "seed_draft": (proposal.drafted.tolist() if proposal is not None and proposal.drafted is not None
                              else block[1:]),
               "accepted": rec["accepted"], "next_token": int(rec["next_token"]), "emitted": rec["emitted"],
               "stop": rec["stop"] or None, "extra_step": bool(rec.get("extra_step"))}
        self.write(row)

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self.file.close()


def timed_then_traced(decode: Callable, generator, tracer: StepTracer | None):
    """`decode(generator, on_step)` -> Generation. Returns the timed decode's Generation (run with on_step=None);
    with a tracer, the same decode is then replayed untimed with it, from the generator state the timed run
    started from, and the generator is left where the timed run left it."""
    start = generator.get_state() if generator is not None else None
    timed = decode(generator, None)
    if tracer is None:
        return timed
    end = generator.get_state() if generator is not None else None
    if generator is not None:
        generator.set_state(start)
    replay = decode(generator, tracer)
    if generator is not None:
        generator.set_state(end)
    if replay.tokens != timed.tokens:
        first = next((i for i, (a, b) in enumerate(zip(replay.tokens, timed.tokens)) if a != b),
                     min(len(replay.tokens), len(timed.tokens)))
        tracer.write({**tracer.context, "warning": f"the untimed replay left the timed decode at token {first}; "
                      "the steps above are the replay's"})
    return timed
