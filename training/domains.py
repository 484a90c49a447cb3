"""Magpie domains and the three-way prompt split.

Domains (`prompts.magpie_domains`, a list; empty: the bare user-turn prefix, as before): each is
    {"name": "code", "share": 0.3, "seeds": ["Write a Python function", "Implement"], "system": null}
`share` is the domain's weight among the `prompts.magpie` generated prompts (weights are normalised; counts by
largest remainder), `seeds` the first words of the user turn, used in turn (row i of a domain starts with
seeds[i % len(seeds)]; "" is the bare prefix), `system` an optional system prompt rendered before the user turn.
Each generated prompt's source is `magpie:<name>:<i>`.

Split: the filtered prompts are grouped by source (a JSONL file, or a Magpie domain) and `prompts.heldout`, then
`prompts.selection`, are drawn from every group in proportion to its size (largest remainder, seeded); the rest
train. The selection and held-out files are written interleaved over the groups, so any prefix of them (the
`train.eval_prompts` the trainer measures) is stratified too.
"""
from __future__ import annotations

import random

from core.errors import UsageError

DOMAIN_KEYS = ("name", "share", "seeds", "system")
TEMPLATE_KEYS = ("sources", "prefix", "suffix", "share")


def validate_prompts(cfg: dict) -> None:
    pc = cfg["prompts"]
    for key, low in (("heldout", 1), ("selection", 1), ("more_magpie", 0), ("more_round", 1)):
        if not isinstance(pc[key], int) or isinstance(pc[key], bool) or pc[key] < low:
            raise UsageError(f"config prompts.{key} must be an integer >= {low} (got {pc[key]!r})")
    doms = pc["magpie_domains"]
    if not isinstance(doms, list):
        raise UsageError("config prompts.magpie_domains must be a list of {name, share, seeds, system}")
    names = set()
    for i, d in enumerate(doms):
        where = f"config prompts.magpie_domains[{i}]"
        if not isinstance(d, dict) or set(d) - set(DOMAIN_KEYS):
            raise UsageError(f"{where}: expected an object with fields {', '.join(DOMAIN_KEYS)}")
        name = d.get("name")
        if not isinstance(name, str) or not name or ":" in name or name in names:
            raise UsageError(f"{where}: name must be a unique non-empty string without ':' (got {name!r})")
        names.add(name)
        share = d.get("share")
        if not isinstance(share, (int, float)) or isinstance(share, bool) or share <= 0:
            raise UsageError(f"{where} ({name}): share must be a number > 0 (got {share!r})")
        seeds = d.get("seeds", [""])
        if not isinstance(seeds, list) or not seeds or not all(isinstance(s, str) for s in seeds):
            raise UsageError(f"{where} ({name}): seeds must be a non-empty list of strings (\"\": the bare prefix)")
        if d.get("system") is not None and not isinstance(d["system"], str):
            raise UsageError(f"{where} ({name}): system must be a string or null")
    validate_templates(pc.get("templates", []))
    from training.eval_sets import check
    check(cfg)  # prompts.eval_sets: the pinned sets' files and counts


def validate_templates(templates) -> None:
    if not isinstance(templates, list):
        raise UsageError("config prompts.templates must be a list of {sources, prefix, suffix, share}")
    for i, t in enumerate(templates):
        where = f"config prompts.templates[{i}]"
        if not isinstance(t, dict) or set(t) - set(TEMPLATE_KEYS) or "sources" not in t:
            raise UsageError(f"{where}: expected an object with sources and any of prefix, suffix, share")
        if not isinstance(t["sources"], list) or not t["sources"] or not all(isinstance(x, str) and x
                                                                               for x in t["sources"]):
            raise UsageError(f"{where}: sources must be a non-empty list of source groups, e.g. "
                             "[\"gsm8k_train_questions.jsonl\", \"magpie:math\"]")
        if not all(isinstance(t.get(k, ""), str) for k in ("prefix", "suffix")) or not (t.get("prefix") or
                                                                                      t.get("suffix")):
            raise UsageError(f"{where}: give a prefix or a suffix (strings)")
        share = t.get("share", 1.0)
        if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 < share <= 1:
            raise UsageError(f"{where}: share must be a number in (0, 1] (got {share!r})")


def apply_templates(rows: list[dict], templates: list[dict], seed: int) -> list[dict]:
    """Each row of a listed source group (`group_of`) is wrapped as prefix + text + suffix with probability
    `share` (seeded), after the overlap and duplicate filters have compared the bare text; the row records the
    template's index. Rows of no listed group, or not drawn, are kept as they are."""
    rng = random.Random(seed * 7919 + 17)
    out = []
    for r in rows:
        g = group_of(r["source"])
        for k, t in enumerate(templates):
            if g in t["sources"]:
                if rng.random() < t.get("share", 1.0):
                    r = {**r, "text": t.get("prefix", "") + r["text"] + t.get("suffix", ""), "template": k}
                break
        out.append(r)
    return out


def largest_remainder(total: int, weights: list[float]) -> list[int]:
    """`total` split in proportion to `weights`; the leftover units go to the largest remainders (ties: first)."""
    s = sum(weights)
    exact = [total * w / s for w in weights] if s else [0.0] * len(weights)
    counts = [int(x) for x in exact]
    by_rest = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_rest[:total - sum(counts)]:
        counts[i] += 1
    return counts


def magpie_plan(pc: dict) -> list[dict]:
    """[{name, count, seeds, system, source}] for the configured domains (one unnamed domain when none)."""
    doms = pc["magpie_domains"]
    if not doms:
        return [{"name": None, "count": pc["magpie"], "seeds": [""], "system": None, "source": "magpie"}]
    counts = largest_remainder(pc["magpie"], [d["share"] for d in doms])
    return [{"name": d["name"], "count": c, "seeds": d.get("seeds", [""]), "system": d.get("system"),
             "source": f"magpie:{d['name']}"} for d, c in zip(doms, counts)]


def group_of(source: str) -> str:
    """The stratum of a prompt: its JSONL file (`file.jsonl:row`) or its Magpie domain (`magpie[:domain]:i`)."""
    return source.rsplit(":", 1)[0]


def group_counts(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        g = group_of(r["source"])
        out[g] = out.get(g, 0) + 1
    return out


def _interleaved(picked: dict) -> list[int]:
    """Indices from every group, ordered by their position within the group's share (ties: group order)."""
    keyed = [((j + 0.5) / len(idx), gi, i) for gi, idx in enumerate(picked.values()) for j, i in enumerate(idx)]
    return [i for _, _, i in sorted(keyed)]


def split(rows: list[dict], heldout: int, selection: int, seed: int) -> tuple[list[dict], list[dict], list[dict]]:
    """(train, selection, heldout), disjoint, selection and held-out stratified over the source groups."""
    if len(rows) <= heldout + selection:
        raise UsageError(f"prompts: only {len(rows)} prompts left after filtering, need more than prompts.heldout"
                         f" + prompts.selection = {heldout} + {selection}")
    groups: dict = {}
    for i, r in enumerate(rows):
        groups.setdefault(group_of(r["source"]), []).append(i)
    rng = random.Random(seed)
    for idx in groups.values():
        rng.shuffle(idx)
    names = list(groups)
    held_n = largest_remainder(heldout, [len(groups[g]) for g in names])
    held = {g: groups[g][:n] for g, n in zip(names, held_n)}
    left = {g: groups[g][n:] for g, n in zip(names, held_n)}
    sel_n = largest_remainder(selection, [len(left[g]) for g in names])
    sel = {g: left[g][:n] for g, n in zip(names, sel_n)}
    taken = {i for part in (held, sel) for idx in part.values() for i in idx}
    train = [r for i, r in enumerate(rows) if i not in taken]
    return (train, [rows[i] for i in _interleaved({g: v for g, v in sel.items() if v})],
            [rows[i] for i in _interleaved({g: v for g, v in held.items() if v})])
