"""Near-duplicate detection by word n-gram Jaccard similarity, with an inverted index so that thousands of
prompts check against thousands of benchmark prompts in a second.

Used twice: a training prompt that overlaps a benchmark (evaluation) prompt is refused (exactly equal text after
normalisation counts as Jaccard 1), and near-duplicates inside the training set are dropped.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

_WORD = re.compile(r"[a-z0-9]+")


def normalise(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def ngrams(text: str, n: int) -> frozenset:
    words = normalise(text)
    if len(words) < n:
        return frozenset([tuple(words)]) if words else frozenset()
    return frozenset(tuple(words[i:i + n]) for i in range(len(words) - n + 1))


class NgramIndex:
    """Sets of n-grams with their labels; `best(text)` -> (label, Jaccard) of the most similar entry."""

    def __init__(self, n: int):
        self.n = n
        self.sets: list[frozenset] = []
        self.labels: list[str] = []
        self.postings: dict[tuple, list[int]] = defaultdict(list)

    def add(self, text: str, label: str) -> None:
        grams = ngrams(text, self.n)
        i = len(self.sets)
        self.sets.append(grams)
        self.labels.append(label)
        for g in grams:
            self.postings[g].append(i)

    def __len__(self) -> int:
        return len(self.sets)

    def best(self, text: str) -> tuple[str | None, float]:
        grams = ngrams(text, self.n)
        if not grams:
            return None, 0.0
        shared: dict[int, int] = defaultdict(int)
        for g in grams:
            for i in self.postings.get(g, ()):
                shared[i] += 1
        best_i, best_j = None, 0.0
        for i, s in shared.items():
            j = s / (len(grams) + len(self.sets[i]) - s)
            if j > best_j:
                best_i, best_j = i, j
        return (self.labels[best_i] if best_i is not None else None), best_j


def prompt_texts(row: dict) -> list[str]:
    """The user text(s) of one JSONL row: `turns` (every turn), else question / prompt / instruction / text."""
    if isinstance(row.get("turns"), list):
        return [t for t in row["turns"] if isinstance(t, str)]
    for key in ("question", "prompt", "instruction", "text"):
        if isinstance(row.get(key), str):
            return [row[key]]
    return []


def read_jsonl(path: Path) -> list[dict]:
    from core.errors import UsageError
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{i}: invalid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise UsageError(f"{path}:{i}: expected a JSON object per line")
        rows.append(row)
    return rows


def eval_index(eval_dir: Path, n: int) -> tuple[NgramIndex, list[str]]:
    """Every turn of every *.jsonl under eval_dir, labelled file:line."""
    index = NgramIndex(n)
    files = sorted(eval_dir.glob("*.jsonl")) if eval_dir.is_dir() else []
    for f in files:
        for i, row in enumerate(read_jsonl(f), 1):
            for t in prompt_texts(row):
                index.add(t, f"{f.name}:{i}")
    return index, [f.name for f in files]
