"""Benchmark prompts: where they come from, which subset runs, and how a conversation becomes token ids.

Two sources, one function each: a local JSONL file (`--data-dir DIR`, any NAME from DIR/NAME.jsonl) and the HF
hub (the eight protocol datasets, without --data-dir). Hub rows become prompt strings through one small pure
function per dataset (`build_turns_<name>`), written from the reference harness's prompt templates, so the
prompts match the reference byte for byte (tests/data_templates.py holds the templates as literal strings; the
tests check the prompts against the local eval files). The subset rule and the chat rendering follow it as well.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple

import numpy as np

from core.errors import UsageError
from harness.protocol.setups import DATA_DIR, instead_of_hub, jsonl_names

# The reference's protocol datasets (the hub sources below); only these are known without --data-dir.
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
    # Where the prompt came from, one line (e.g. "local /path/gsm8k.jsonl" or "hub openai/gsm8k ... revision=...").
    # Not part of a sample's identity: equal prompts from either source compare equal.
    source: str = field(default="", compare=False, repr=False)


class DatasetSourceError(UsageError):
    """The hub could not deliver a dataset (no network, unknown revision, missing package): one line, exit 2."""


# ------------------------------------------------------------------------------------------ prompt templates
# The reference harness's templates, character for character. Each builder takes one raw row (a mapping of the source's
# fields) and returns the user turns; they touch nothing else, so the tests run them offline.

REASONING_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_HEAD = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
HUMANEVAL_TAIL = "\n```"
LCB_PREAMBLE = ("You are an expert Python programmer. You will be given a question (problem specification) and "
                "will generate a correct Python program that matches the specification and passes all tests. "
                "You will NOT return anything except for the program")
LCB_QUESTION_HEAD = "### Question:\n"
LCB_STARTER_HEAD = "### Format: Use the following code structure:\n```python\n"
LCB_STARTER_TAIL = "\n```"
LCB_NO_STARTER = "### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```"
LCB_ANSWER = "### Answer: (use the provided format with backticks)"


def build_turns_gsm8k(row: Mapping) -> tuple[str, ...]:
    return (row["question"] + REASONING_SUFFIX,)


def build_turns_math500(row: Mapping) -> tuple[str, ...]:
    return (row["problem"] + REASONING_SUFFIX,)


def build_turns_aime24(row: Mapping) -> tuple[str, ...]:
    return (row["problem"] + REASONING_SUFFIX,)


def build_turns_aime25(row: Mapping) -> tuple[str, ...]:
    return (row["problem"] + REASONING_SUFFIX,)


def build_turns_humaneval(row: Mapping) -> tuple[str, ...]:
    return (HUMANEVAL_HEAD + row["prompt"] + HUMANEVAL_TAIL,)


def build_turns_mbpp(row: Mapping) -> tuple[str, ...]:
    return (row["prompt"],)


def build_turns_livecodebench(row: Mapping) -> tuple[str, ...]:
    """One user message: preamble, question, format (starter code when there is any), answer line."""
    starter = row.get("starter_code")
    fmt = LCB_STARTER_HEAD + starter + LCB_STARTER_TAIL if starter else LCB_NO_STARTER
    return ("\n\n".join((LCB_PREAMBLE, LCB_QUESTION_HEAD + row["question_content"], fmt, LCB_ANSWER)),)


def build_turns_mt_bench(row: Mapping) -> tuple[str, ...]:
    return tuple(row["prompt"])


# ------------------------------------------------------------------------------------------------ hub sources
# PINNING. The reference loads every dataset at the hub's current main, so a dataset that changes upstream
# (LiveCodeBench gains files) silently changes N, the seed-0 subset and the prompts. To pin one, write the full
# 40-hex commit SHA of its hub repository (its "History" page, or `huggingface_hub.HfApi().dataset_info(repo).sha`)
# into PINNED_REVISIONS and check that the prompts still equal the local eval files byte for byte
# (tests/test_data.py::test_hub_prompts_equal_local_files). While a value is None the loader reads main: it records
# revision "unpinned" with the commit it resolved, and loads exactly that commit.

UNPINNED = "unpinned"

PINNED_REVISIONS: dict[str, str | None] = {
    "gsm8k": None,
    "math500": None,
    "humaneval": None,
    "mbpp": None,
    "aime24": None,
    "aime25": None,
    "livecodebench": None,
    "mt-bench": None,
}


class HubSource(NamedTuple):
    repo: str                    # hub dataset repository
    config: str | None           # datasets config name
    split: str
    revision: str | None         # commit SHA from PINNED_REVISIONS; None loads main (recorded as "unpinned")
    build: Callable[[Mapping], tuple[str, ...]]
    files: tuple[str, ...] = ()  # raw JSONL files read in this order instead of a datasets config (LiveCodeBench)


HUB_SOURCES: dict[str, HubSource] = {
    "gsm8k": HubSource("openai/gsm8k", "main", "test", PINNED_REVISIONS["gsm8k"], build_turns_gsm8k),
    "math500": HubSource("HuggingFaceH4/MATH-500", None, "test", PINNED_REVISIONS["math500"], build_turns_math500),
    "humaneval": HubSource("openai/openai_humaneval", None, "test", PINNED_REVISIONS["humaneval"],
                           build_turns_humaneval),
    "mbpp": HubSource("google-research-datasets/mbpp", "sanitized", "test", PINNED_REVISIONS["mbpp"],
                      build_turns_mbpp),
    "aime24": HubSource("HuggingFaceH4/aime_2024", None, "train", PINNED_REVISIONS["aime24"], build_turns_aime24),
    "aime25": HubSource("MathArena/aime_2025", None, "train", PINNED_REVISIONS["aime25"], build_turns_aime25),
    # The reference reads these six JSON-lines files of the repository in this order (not a datasets config).
    "livecodebench": HubSource("livecodebench/code_generation_lite", None, "test", PINNED_REVISIONS["livecodebench"],
                               build_turns_livecodebench,
                               files=("test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl",
                                      "test6.jsonl")),
    "mt-bench": HubSource("HuggingFaceH4/mt_bench_prompts", None, "train", PINNED_REVISIONS["mt-bench"],
                          build_turns_mt_bench),
}

# Seconds allowed for the one metadata request that checks the hub answers before anything is downloaded; without
# it an unreachable hub costs datasets' retries (about 25 s) before the error.
HUB_PROBE_TIMEOUT_S = 10.0

# What this process loaded from the hub, per dataset: the commit actually read and the sha256 of the prompts in
# the local-file form (see _prompts_sha256). dataset_provenance reports it.
_HUB_LOADED: dict[str, dict] = {}


def hub_offline() -> bool:
    """True when the user asked the HF libraries to stay offline (then only their local cache is read)."""
    return any(os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _datasets_installed() -> bool:
    return importlib.util.find_spec("datasets") is not None  # finds the package without importing it


def _describe_hub(src: HubSource, resolved: str | None) -> str:
    where = f"files={','.join(src.files)}" if src.files else f"config={src.config or '-'} split={src.split}"
    rev = src.revision or UNPINNED
    if resolved and resolved != src.revision:
        rev += f" resolved={resolved}"
    return f"hub {src.repo} {where} revision={rev}"


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}"


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
        hub = "; it is a hub dataset: omit --data-dir to read it from the HF hub" if dataset in KNOWN_DATASETS else ""
        raise UsageError(f"dataset file {path} not found: --data-dir must hold {dataset}.jsonl{hint}; {data_dir} "
                         f"holds {', '.join(jsonl_names(data_dir)) or 'no .jsonl file'}{hub}")


def _check_hub(dataset: str) -> None:
    """Only what is knowable without the network: the name, and that the loader's package is installed."""
    if dataset not in KNOWN_DATASETS:
        shipped = jsonl_names(DATA_DIR)
        raise UsageError(f"unknown dataset {dataset!r}: shipped in data/eval/ (no hub needed): {', '.join(shipped)}; "
                         f"from the HF hub only: {', '.join(d for d in KNOWN_DATASETS if d not in shipped)}; "
                         f"for your own prompts pass --data-dir DIR with DIR/{dataset}.jsonl")
    if not _datasets_installed():
        raise DatasetSourceError(f"loading {dataset!r} from the HF hub needs the datasets package "
                                 f"(pip install 'datasets>=3'); or {instead_of_hub(dataset)}")


def validate_dataset_args(dataset: str, data_dir: str | None, max_samples: int | None) -> None:
    """Every check that needs no prompt text, so the CLI can fail before loading a model. No network access."""
    if max_samples is not None and (isinstance(max_samples, bool) or max_samples < 1):
        raise UsageError(f"--max-samples must be >= 1 (got {max_samples}); omit it for the default")
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


def _hub_commit(dataset: str, src: HubSource) -> str | None:
    """The commit to read: one quick metadata request, so a dead network fails in seconds with a clear message.

    Offline mode (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) skips the request and reads the pinned revision (or main)
    from the local HF cache.
    """
    if hub_offline():
        return src.revision
    from huggingface_hub import HfApi
    try:
        info = HfApi().dataset_info(src.repo, revision=src.revision, timeout=HUB_PROBE_TIMEOUT_S)
    except Exception as e:  # any failure here means "cannot read this dataset now"; say why in one line
        raise DatasetSourceError(
            f"could not reach {src.repo} (revision {src.revision or 'main'}) on the HF hub for {dataset!r} "
            f"({_one_line(e)}); {instead_of_hub(dataset)}, or set HF_HUB_OFFLINE=1 to read the HF cache") from None
    return info.sha or src.revision


def _hub_raw_rows(src: HubSource, commit: str | None) -> list[Mapping]:
    if src.files:  # raw JSON-lines files, concatenated in the listed order, as the reference reads them
        from huggingface_hub import hf_hub_download
        rows: list[Mapping] = []
        for name in src.files:
            path = hf_hub_download(src.repo, name, repo_type="dataset", revision=commit,
                                   etag_timeout=HUB_PROBE_TIMEOUT_S)
            rows.extend(_read_raw_jsonl(path))
        return rows
    import datasets
    ds = datasets.load_dataset(src.repo, src.config, split=src.split, revision=commit)
    return list(ds)


def _read_raw_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _read_hub(dataset: str) -> tuple[list[tuple[str, ...]], str]:
    """The dataset's prompts in hub row order, built with the reference's templates, and their source."""
    src = HUB_SOURCES[dataset]
    commit = _hub_commit(dataset, src)
    try:
        raw = _hub_raw_rows(src, commit)
    except OSError as e:  # connection, missing file or revision, read-only cache: all OSError in datasets/hf_hub
        raise DatasetSourceError(f"could not load {dataset!r} from {src.repo} on the HF hub ({_one_line(e)}); "
                                 f"{instead_of_hub(dataset)}") from None
    where = _describe_hub(src, commit)
    rows = [_parse_turns({"turns": list(src.build(r))}, f"{where} row {i}") for i, r in enumerate(raw)]
    if not rows:
        raise DatasetSourceError(f"{where} holds no rows")
    _HUB_LOADED[dataset] = {"resolved_revision": commit, "sha256": _prompts_sha256(rows), "rows": len(rows)}
    return rows, where


def _prompts_sha256(rows: list[tuple[str, ...]]) -> str:
    """sha256 of the prompts written as the local files are (json.dumps({"turns": [...]}, ensure_ascii=False) per
    line): a hub load whose prompts equal a local file's has that file's sha256."""
    h = hashlib.sha256()
    for turns in rows:
        h.update((json.dumps({"turns": list(turns)}, ensure_ascii=False) + "\n").encode("utf-8"))
    return h.hexdigest()


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def dataset_provenance(name: str, data_dir: str | None) -> dict:
    """Where `name` is (or was) read from, for results files. No network access.

    Keys: source ("local" or "hub"), repo, config, split, revision ("unpinned" when PINNED_REVISIONS has none),
    resolved_revision (the commit a hub load in this process actually read, else None), file (the local path; for
    LiveCodeBench the hub files in read order; else None), sha256 (the local file's; for a hub load in this
    process, that of its prompts written in the local-file form, which equals the local file's when the prompts
    match it byte for byte; else None).
    """
    if data_dir is not None:
        _check_local(name, data_dir)
        path = os.path.abspath(_jsonl_path(name, data_dir))
        return {"source": "local", "repo": None, "config": None, "split": None, "revision": None,
                "resolved_revision": None, "file": path, "sha256": _file_sha256(path)}
    if name not in KNOWN_DATASETS:
        _check_hub(name)  # raises the usual "unknown dataset" message
    src = HUB_SOURCES[name]
    loaded = _HUB_LOADED.get(name, {})
    return {"source": "hub", "repo": src.repo, "config": src.config, "split": None if src.files else src.split,
            "revision": src.revision or UNPINNED, "resolved_revision": loaded.get("resolved_revision"),
            "file": list(src.files) if src.files else None, "sha256": loaded.get("sha256")}


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
    """The samples to run, in order; a sample's position in the list is the reference's question_id.

    With data_dir: DIR/<dataset>.jsonl. Without: one of KNOWN_DATASETS from the HF hub (network, or the HF cache in
    offline mode). Every sample's `source` says which.
    """
    validate_dataset_args(dataset, data_dir, max_samples)
    if data_dir is not None:
        rows = _read_local(dataset, data_dir)
        where = f"local {os.path.abspath(_jsonl_path(dataset, data_dir))}"
    else:
        rows, where = _read_hub(dataset)
    return [Sample(dataset, i, rows[i], where) for i in subset_rows(len(rows), max_samples)]


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
