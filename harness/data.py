"""Benchmark prompts: where they come from, which subset runs, and how a conversation becomes token ids.

Sources are one function each (local JSONL now; the HF hub later), so adding one touches no caller. The subset
rule and the chat rendering follow the reference harness (REFERENCE.md section 8) so prompts match it exactly.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from harness.errors import UsageError

# The reference's protocol datasets (REFERENCE.md section 8); only these are known without --data-dir.
KNOWN_DATASETS: tuple[str, ...] = (
    "gsm8k", "math500", "humaneval", "mbpp", "aime24", "aime25", "livecodebench", "mt-bench",
)

# Seed of the reference's `Dataset.shuffle(seed=0)`; changing it changes which prompts are measured.
SUBSET_SEED = 0


@dataclass(frozen=True)
class Sample:
    dataset: str
    row: int  # 0-based row in the source order (file rows, blank lines not counted), kept beside the subset index
    turns: tuple[str, ...]


# ------------------------------------------------------------------------------------------------------- checks

def _jsonl_path(dataset: str, data_dir: str) -> str:
    return os.path.join(data_dir, f"{dataset}.jsonl")


def _check_local(dataset: str, data_dir: str) -> None:
    if not dataset or "/" in dataset or "\\" in dataset:
        raise UsageError(f"--dataset {dataset!r} must be a bare name: it reads DIR/<name>.jsonl from --data-dir")
    if not os.path.isdir(data_dir):
        raise UsageError(f"--data-dir {data_dir} is not a directory; pass a folder holding <name>.jsonl files")
    path = _jsonl_path(dataset, data_dir)
    if not os.path.isfile(path):
        hint = f" (drop the .jsonl suffix: --dataset {dataset[:-6]})" if dataset.endswith(".jsonl") else ""
        raise UsageError(f"dataset file {path} not found: --data-dir must hold {dataset}.jsonl{hint}")


def _check_hub(dataset: str) -> None:
    if dataset not in KNOWN_DATASETS:
        raise UsageError(f"unknown dataset {dataset!r}: known are {', '.join(KNOWN_DATASETS)}; "
                         f"for your own prompts pass --data-dir DIR with DIR/{dataset}.jsonl")
    # Refused here rather than at load time so the CLI stops before it loads any model.
    raise _hub_not_available(dataset)


def _hub_not_available(dataset: str) -> UsageError:
    return UsageError(f"loading {dataset!r} from the HF hub is not available yet; pass --data-dir DIR with "
                      f"DIR/{dataset}.jsonl (e.g. --data-dir ../shared/data/eval)")


def validate_dataset_args(dataset: str, data_dir: str | None, max_samples: int | None) -> None:
    """Every check that needs no prompt text, so the CLI can fail before loading a model."""
    if max_samples is not None and (isinstance(max_samples, bool) or max_samples < 1):
        raise UsageError(f"--max-samples must be >= 1 (got {max_samples}); omit it to run every row")
    if data_dir is not None:
        _check_local(dataset, data_dir)
    else:
        _check_hub(dataset)


# ------------------------------------------------------------------------------------------------------ sources

def _parse_turns(obj: object, where: str) -> tuple[str, ...]:
    if not isinstance(obj, dict) or "turns" not in obj:
        raise UsageError(f"{where}: each row must be a JSON object with a 'turns' list of strings")
    turns = obj["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise UsageError(f"{where}: 'turns' must be a non-empty list of non-empty strings, "
                         f"got {json.dumps(turns, ensure_ascii=False)[:80]}")
    return tuple(turns)


def _read_local(dataset: str, data_dir: str) -> list[tuple[str, ...]]:
    """DIR/<dataset>.jsonl: one JSON object per line with a 'turns' list; blank lines are skipped."""
    path = _jsonl_path(dataset, data_dir)
    rows: list[tuple[str, ...]] = []
    try:
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{line_no}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UsageError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); "
                                     "each line must be one JSON object") from None
                rows.append(_parse_turns(obj, where))
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text; save the JSONL file as UTF-8") from None
    if not rows:
        raise UsageError(f"{path} holds no rows; add one JSON object with a 'turns' list per line")
    return rows


def _read_hub(dataset: str) -> list[tuple[str, ...]]:
    """HF hub source (pinned revisions, REFERENCE.md section 8 prompt templates): not implemented yet."""
    raise _hub_not_available(dataset)


# ------------------------------------------------------------------------------------------------------- subset

def subset_rows(n_rows: int, max_samples: int | None) -> list[int]:
    """Row indices to run, in evaluation order.

    More rows than max_samples: the first max_samples of default_rng(0).permutation(n), which is exactly what the
    reference's `Dataset.shuffle(seed=0).select(range(k))` picks. Otherwise every row in source order (so aime25
    and mt-bench keep their order at the protocol's 128).
    """
    if max_samples is None or n_rows <= max_samples:
        return list(range(n_rows))
    return np.random.default_rng(SUBSET_SEED).permutation(n_rows)[:max_samples].tolist()


def load_samples(dataset: str, data_dir: str | None, max_samples: int | None) -> list[Sample]:
    """The samples to run, in order; a sample's position in the list is the reference's question_id."""
    validate_dataset_args(dataset, data_dir, max_samples)
    rows = _read_local(dataset, data_dir) if data_dir is not None else _read_hub(dataset)
    return [Sample(dataset, i, rows[i]) for i in subset_rows(len(rows), max_samples)]


# ------------------------------------------------------------------------------------------------------ prompts

def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation, ending where the assistant's reply begins.

    With a chat template: rendered as the reference does (generation prompt on, thinking off; templates that do
    not read enable_thinking ignore it), then encoded without special tokens because the template already wrote
    them (a second BOS would shift every prompt). Without one (base models): the message texts joined by a blank
    line, encoded with the tokenizer's own special tokens.
    """
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        text = "\n\n".join(m["content"] for m in messages)
        ids = tokenizer.encode(text, add_special_tokens=True)
    return [int(i) for i in ids]
