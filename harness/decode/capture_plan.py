"""Capture every whole-step CUDA graph a run can need before it measures anything.

Step graphs are keyed by (arm, width, KV-length bucket) and captured on first need (harness.decode.graphs). A
measured decode that reaches a new bucket, e.g. a longer output at T > 0, would pay for a capture inside its
decode_s. So before the first measured round the runner calls `capture_every_shape` once per arm: it enumerates
the (speculative, width, length) shapes the run's settings allow (`shapes`) and, for each, runs one short
untimed generation whose prompt is long enough that its first graph step has that shape. Only the public
generate() is used, so every capture goes through the same path as a measured step. Each generation reports
`graph_captures`; the runner fails a run in which a measured one has any (harness.protocol.rounds).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from harness.decode.graphs import StepGraphs
from harness.decode.state import DecodeState


def room_to_speculate(pos: int, width: int, limit: int) -> bool:
    """The decode loops' rule (harness.decode.loop, batch_loop): a speculative step at `pos` writes `width`
    positions and needs one more inside the context limit; past that the steps are plain target steps."""
    return pos + width < limit


def shape_at(pos: int, limit: int, capacity: int, bucket: int, width: int) -> tuple[bool, int, int]:
    """(speculative, width, length) of the step a decode with block `width` runs at position `pos`: speculative
    while room_to_speculate, a plain target step (width 1) after that and on an AR arm."""
    speculative = width > 1 and room_to_speculate(pos, width, limit)
    w = width if speculative else 1
    return speculative, w, StepGraphs.length(pos + w, bucket, capacity)


def shapes(limit: int, capacity: int, bucket: int, width: int) -> list[tuple[bool, int, int]]:
    """Every step shape a decode within this limit and cache capacity can run."""
    # a step runs at pos only while pos + 1 < limit, and writes the cache at pos..pos+w-1
    return sorted({shape_at(pos, limit, capacity, bucket, width) for pos in range(1, min(limit - 1, capacity))})


def prompt_for(shape, limit: int, capacity: int, bucket: int, width: int, steps: int, eager_first: bool) -> int:
    """A prompt length whose first graph step has `shape` and whose generation of `steps` tokens fits the cache;
    -1 when there is none. `eager_first`: the accounting runs the first speculative step eagerly (the reference's
    timer), so the prompt starts `width` earlier and the second step lands on the shape wherever the first ends."""
    at = lambda pos: shape_at(pos, limit, capacity, bucket, width)
    for p in range(min(limit - 2, capacity - steps - width), 0, -1):  # the largest such position first
        if at(p) != shape:
            continue
        if not (eager_first and shape[0]):
            return p
        q = p - width
        if q >= 1 and all(at(x) == shape for x in range(q + 1, p + 1)):
            return q
    return -1


def reserve_output(target, widest: int, state: DecodeState | None = None) -> None:
    """Size the output buffer that every arm's step graphs share (the slot's of `state`, default the target's
    DecodeState) for the widest arm, once, before any capture. A generate asks for the cache's capacity + its block
    width + 1; a buffer grown later by a wider arm is a new address, and every graph captured before it would be
    dropped and captured again inside a measured round (results/perf/NOTES.md has the case seen on the H200)."""
    (state or DecodeState.of(target)).slot.reserve_output(target.capacity + widest + 1)


def capture_every_shape(decode: Callable, prompt: list[int], settings, capacity: int, width: int) -> int:
    """Run `decode(tokens, settings)` (an untimed generate of one arm) once per shape; returns the graphs
    captured. `prompt` is tiled to the lengths needed; `capacity` is the presized cache, which no capture
    generation outgrows (a growth would drop the graphs); the output buffer must be reserved (`reserve_output`)."""
    limit, bucket = settings.max_model_len, settings.graph_bucket
    eager_first = settings.accounting.timer_after_first_draft
    steps = 2 * width + 1 if eager_first else 2  # one graph step after the prefill (after the eager one)
    short = dataclasses.replace(settings, max_new_tokens=steps)
    captured = 0
    for shape in shapes(limit, capacity, bucket, width):
        p = prompt_for(shape, limit, capacity, bucket, width, steps, eager_first)
        if p >= 1:
            captured += decode((prompt * (p // max(1, len(prompt)) + 1))[:p], short).graph_captures
    return captured
