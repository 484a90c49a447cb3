"""The sweep's flags (--batch-sizes, --context-lengths), checked from the command line alone
(harness.protocol.config.validate calls `check`); the sweep itself is harness.protocol.sweep.
--device spyre sweeps 1..4 requests (harness.protocol.spyre_contract.check_batches)."""
from __future__ import annotations

import math
import os

from core.errors import UsageError

MAX_BATCH = 64  # the largest batch swept (the vLLM XPress PR measures 1..64 requests)


def points_of(text: str | None, flag: str, low: int, high: int | None = None) -> list[int]:
    """A comma-separated list of distinct integers in [low, high], sorted."""
    if text is None:
        return []
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: use comma-separated integers, e.g. "
                         f"{'1,2,4,8' if low else '0,1024,4096'}") from None
    if not values:
        raise UsageError(f"{flag} is empty; give at least one value, e.g. {'1,2,4,8' if low else '0,1024'}")
    bad = [v for v in values if v < low or (high is not None and v > high)]
    if bad:
        raise UsageError(f"{flag} {text}: {bad[0]} is out of range; every value must be in {low}.."
                         f"{high if high is not None else 'the context limit'}")
    if len(set(values)) != len(values):
        raise UsageError(f"{flag} {text}: a value is repeated; give each point once")
    return sorted(values)


def is_sweep(cfg) -> bool:
    return cfg.batch_sizes is not None or cfg.context_lengths is not None


def batch_sizes(cfg) -> list[int]:
    return points_of(cfg.batch_sizes, "--batch-sizes", 1, MAX_BATCH) or [1]


def context_lengths(cfg) -> list[int]:
    return points_of(cfg.context_lengths, "--context-lengths", 0) or [0]


def check(cfg) -> None:
    """Everything a sweep refuses, from the flags alone (harness.protocol.config.validate calls it)."""
    batch_sizes(cfg), context_lengths(cfg)
    refused = [(cfg.resume, "--resume (a sweep runs whole; delete its folder and start it again, or pick another "
                            "--run-id)"),
               (cfg.compat_reference, "--compat-reference (one global random stream cannot be shared by a batch)"),
               (cfg.trace, "--trace (the step tracer follows one request)"),
               (cfg.answer_file, "--answer-file (the reference's schema has no batches)")]
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise UsageError("--batch-sizes/--context-lengths: a sweep runs in one process (each point's rounds pair "
                         "its arms on one device); launch it without torchrun / accelerate")
    for given, why in refused:
        if given:
            raise UsageError(f"--batch-sizes/--context-lengths: a sweep does not take {why}")
    from harness.protocol.spyre_contract import budget_of, check_batches, is_spyre
    if cfg.refill and is_spyre(cfg.device):
        raise UsageError("--refill on --device spyre: its compiled batch shapes serve 1, 2 or 4 fixed requests; "
                         "sweep it without --refill")
    if is_spyre(cfg.device):  # 1..4 requests (3 padded to 4) within the token budget; config.validate's
        check_batches(batch_sizes(cfg), budget_of(cfg))  # spyre_contract.check_run has said so already


def request_ids(n: int, b: int) -> list[int]:
    """The prompts of a point at batch size b: 0..n-1, cycled up to the next multiple of b."""
    return [i % n for i in range(math.ceil(n / b) * b)]


def repeats(ids: list[int], how: set) -> list[int]:
    """Per request of a point, how many times its prompt came before it (0: its first request; request_ids cycles
    the prompts past their count); where a prompt repeats, `how` (the sweep's labels) says so."""
    seen: dict = {}
    out = []
    for i in ids:
        out.append(seen.get(i, 0))
        seen[i] = out[-1] + 1
    if any(out):
        how.add("prompts cycled to fill B: where a point has more requests than prompts, a prompt's repeats are "
                "requests of their own (each on its own random stream)")
    return out


def served_rows(plan, batch: int) -> int:
    """The rows a batch of `batch` requests decodes as: --device spyre serves 1, 2 or 4 rows (its compiled shapes;
    harness.protocol.spyre_contract.padded_batch: 3 -> 4), every other device the batch itself."""
    if plan.spyre is None:
        return batch
    from harness.protocol.spyre_contract import padded_batch
    return padded_batch(batch)


def padded_requests(prompts: list[list[int]], seeds: list[int], rows: int, limit: int):
    """(prompts, output limits, seeds) for a batch run at `rows` rows: each padding row repeats the first prompt
    with an output limit of 1 token, which its prefill produces, so it is finished (masked, batch_loop) from the
    first step: it rides in every forward at its own KV row and is never proposed, verified, committed or read.
    Its prefill runs before the first step, so decode_s does not include it (prefill_s does)."""
    pad = rows - len(prompts)
    return prompts + [prompts[0]] * pad, [limit] * len(prompts) + [1] * pad, seeds + [seeds[0]] * pad
