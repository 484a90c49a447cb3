"""The merged report over several results folders (`python -m harness.protocol.report FOLDERS`): folders are
grouped by their target (model, quantization, device, dtype), protocol (the kernels, max_new_tokens, the
reference's accounting, the draft temperature, CUDA graphs, compiling and xPress's top-C), weights label, drafter
block and weights' digests, as their config.json / summary.json record them (harness.protocol.facts); a group's
header names them all, also when there is one group.
Each group gets its own table and its own Avg. rows: folders of different targets or protocols are never averaged
together. A folder that does not record a fact (summary schema 1/2, config.json without "resolved" dtype) has
"unknown" there, and groups with the folders that share its known facts and its unknowns.
"""
from __future__ import annotations

from core.errors import UsageError
from harness.protocol import facts
from harness.protocol.tables import format_multi_dataset_table

GROUP_KEYS = facts.TARGET_KEYS + facts.PROTOCOL_KEYS


def group_key(entry: dict) -> tuple:
    """The target and protocol facts, the weights' label (random drafter/heads on a real target are not its
    trained weights, whose runs they would otherwise be averaged with), the drafter's block and which tensors ran
    (`digests`: the drafter's and refiners' digests as config.json records them; two trained drafters are two
    groups)."""
    from harness.protocol.labels import recorded_weights
    config = entry.get("config") or {}
    run = facts.of(entry["summary"], config)
    weights = recorded_weights(entry["summary"], config) or "as given"
    resolved = config.get("resolved") or {}
    block = resolved.get("block_size") or config.get("block_size") or facts.UNKNOWN
    return tuple((k, run[k]) for k in GROUP_KEYS) + (("weights", weights), ("block", block),
                                                     ("digests", digests(resolved.get("weights"))))


def digests(recorded: dict | None) -> str:
    """'drafter 43b9b84b, xpress f110f5cb, markov b44e...' (the first 8 hex digits of each recorded digest), or
    'unrecorded' (random weights, or a config.json from before digests were recorded)."""
    parts = [f"{name} {d['digest'][:8]}" for name, d in sorted((recorded or {}).items())
             if isinstance(d, dict) and d.get("digest")]
    return ", ".join(parts) or "unrecorded"


def groups(entries: list[dict]) -> dict[tuple, list[dict]]:
    """Entries by group_key, in the order their first folder was given."""
    out: dict[tuple, list[dict]] = {}
    for e in entries:
        out.setdefault(group_key(e), []).append(e)
    return out


def format_merged(entries: list[dict], distinct) -> str:
    """One table (format_multi_dataset_table) per group; `distinct` checks each group's entries (one folder per
    dataset and temperature)."""
    parts = groups(entries)
    out = [] if len(parts) == 1 else [f"**{len(parts)} groups of folders with different targets, protocols or "
                                      "weights: each is averaged on its own, never together.**", ""]
    for key, members in parts.items():
        out += ["### " + "  ".join(f"{k}={v}" for k, v in key), "", format_multi_dataset_table(distinct(members))]
    return "\n".join(out)


def distinct(entries: list[dict]) -> list[dict]:
    """Rows of the merged table are datasets: two runs of one dataset at one temperature would be averaged as two
    datasets, so they are refused."""
    seen: dict = {}
    for e in entries:
        key = (e["dataset"], e["temperature"])
        if key in seen:
            raise UsageError(f"{seen[key]} and {e['folder']} are both {e['dataset']} at T={e['temperature']:g}; the "
                             "Avg. row would count that dataset twice: pass one folder per dataset (or one run "
                             "with more rounds)")
        seen[key] = e["folder"]
    return entries
