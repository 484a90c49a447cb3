"""`prompts.eval_sets`: the selection and held-out prompts pinned from a folder, instead of drawn from the pool.

The prompts stage draws both sets from a pool whose Magpie prompts the target generates; other engine numerics (the
responses attention, the top-p cut) generate other prompts and so another split (the fourteenth session's pool had
58,656 training prompts where the fifth session's had 58,691), and two runs' τ on their own sets cannot be compared.
A folder of `selection.jsonl` and `heldout.jsonl` (rows as the stage writes them: `text`, `source`, and `template`
where an instruction template wraps the text; `training_gpu.sh back` brings a run's) pins both: every run that names
it measures on the same prompts, whatever its pool, and no training prompt near-duplicates one of them (its text
before templates at `prompts.overlap_jaccard` or above, the benchmark filter's threshold, is dropped and counted).
The folder's content digest is part of the stage's key.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from core.errors import UsageError
from training.overlap import NgramIndex, gram_frequencies, read_jsonl
from training.store import repo_path

FILES = ("selection.jsonl", "heldout.jsonl")


def folder(cfg: dict) -> Path | None:
    p = cfg["prompts"]["eval_sets"]
    if not isinstance(p, str):
        raise UsageError(f"config prompts.eval_sets must be a folder path (\"\": draw the sets from the pool), not {p!r}")
    return repo_path(p) if p else None


def check(cfg: dict) -> list[list[dict]] | None:
    """The folder holds both files, each row with a text and a source, as many as prompts.selection and
    prompts.heldout ask for (refused before anything loads); their rows, or None when the sets are drawn."""
    d = folder(cfg)
    if d is None:
        return None
    sets = []
    for name, key in zip(FILES, ("selection", "heldout")):
        f = d / name
        if not f.is_file():
            raise UsageError(f"config prompts.eval_sets: no {name} in {d} (a run's "
                             "prompts/selection.jsonl and heldout.jsonl, as training_gpu.sh back brings them)")
        rows = read_jsonl(f)
        bad = next((i for i, r in enumerate(rows, 1) if not (isinstance(r, dict) and isinstance(r.get("text"), str)
                                                            and isinstance(r.get("source"), str))), None)
        if bad is not None:
            raise UsageError(f"{f}:{bad}: a row needs a text and a source (as the prompts stage writes them)")
        if len(rows) != cfg["prompts"][key]:
            raise UsageError(f"{f} holds {len(rows)} prompts and prompts.{key} asks for {cfg['prompts'][key]}: set "
                             f"prompts.{key} to {len(rows)}, or leave prompts.eval_sets empty to draw the sets")
        sets.append(rows)
    return sets


def read(cfg: dict) -> tuple[list[dict], list[dict], str] | None:
    """(selection, held-out, content digest), or None when the sets are drawn from the pool."""
    sets = check(cfg)
    if sets is None:
        return None
    digest = hashlib.sha256(b"".join(len(b).to_bytes(8, "big") + b for b in ((folder(cfg) / f).read_bytes()
                                                                            for f in FILES)))
    return sets[0], sets[1], digest.hexdigest()[:16]


def bare(row: dict, templates: list[dict]) -> str:
    """A row's text before its instruction template (what the filters compare): the template its index names, else
    the first configured one whose prefix and suffix wrap the text (a pinned folder written under other indices)."""
    i = row.get("template")
    named = [templates[i]] if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(templates) else []
    text = row["text"]
    for t in named + [t for t in templates if t.get("prefix") or t.get("suffix")]:
        pre, suf = t.get("prefix", ""), t.get("suffix", "")
        if text.startswith(pre) and text.endswith(suf) and len(text) >= len(pre) + len(suf):
            return text[len(pre):len(text) - len(suf)]
    return text


def drop_near(rows: list[dict], pinned: list[dict], cfg: dict) -> tuple[list[dict], int]:
    """ROWS less those whose text before templates has an n-gram Jaccard with a pinned prompt's reaching
    prompts.overlap_jaccard; and how many were dropped."""
    pc = cfg["prompts"]
    texts = [bare(r, pc["templates"]) for r in pinned]
    grams = gram_frequencies(texts + [bare(r, pc["templates"]) for r in rows], pc["ngram"])
    index = NgramIndex(pc["ngram"], pc["overlap_jaccard"], grams)
    for t, r in zip(texts, pinned):
        index.add(t, r["source"])
    exact = {" ".join(t.split()) for t in texts}  # a text without n-grams (no Latin words) matches nothing above
    kept = [r for r in rows if index.best(b := bare(r, pc["templates"]))[1] < pc["overlap_jaccard"]
            and " ".join(b.split()) not in exact]
    return kept, len(rows) - len(kept)
