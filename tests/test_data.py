"""Datasets: the reference's subsets (REFERENCE.md appendix A), local JSONL rules and refusals, the hub prompt
templates (REFERENCE.md section 8) checked byte for byte against ../shared/data/eval, and chat rendering."""
import hashlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

import harness.protocol.data as data_mod
from harness.protocol.data import (HUB_SOURCES, KNOWN_DATASETS, PINNED_REVISIONS, DatasetSourceError, Sample,
                          build_turns_aime24, build_turns_aime25, build_turns_gsm8k, build_turns_humaneval,
                          build_turns_livecodebench, build_turns_math500, build_turns_mbpp, build_turns_mt_bench,
                          dataset_provenance, hub_offline, load_samples, render_prompt, subset_rows,
                          validate_dataset_args)
from harness.errors import UsageError

# The shared folder sits beside the repository checkout (../shared), as on the CI machines.
EVAL_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"
needs_eval = pytest.mark.skipif(not EVAL_DIR.is_dir(),
                                reason=f"benchmark JSONL files not found at {EVAL_DIR} (expected ../shared beside "
                                       f"the repo)")

# REFERENCE.md appendix A: HF Dataset.shuffle(seed=0).select(range(128)), row indices in evaluation order.
GSM8K_128 = [
    264, 725, 996, 586, 1010, 12, 904, 130, 209, 244, 237, 689, 601, 98, 1284, 1131, 1272, 482, 992, 454, 183, 476,
    506, 765, 1195, 1093, 1232, 967, 622, 90, 423, 1020, 1004, 416, 1251, 213, 694, 514, 956, 1003, 1210, 958, 173,
    712, 917, 629, 1292, 1216, 739, 1205, 369, 1170, 816, 819, 1152, 409, 789, 443, 150, 722, 223, 422, 1221, 572,
    118, 198, 1307, 1014, 1055, 1241, 1075, 843, 480, 329, 783, 1184, 599, 269, 590, 591, 874, 1036, 945, 36, 1197,
    462, 1143, 53, 938, 323, 523, 1136, 20, 1214, 895, 149, 998, 1056, 1000, 802, 1191, 1110, 794, 1182, 220, 471,
    109, 1188, 485, 988, 366, 279, 253, 561, 1168, 1165, 1066, 26, 944, 776, 552, 245, 1298, 623, 468, 600, 672, 596,
]
FIRST_20 = {
    "gsm8k": GSM8K_128[:20],
    "math500": [221, 434, 109, 334, 375, 71, 378, 205, 290, 181, 182, 227, 371, 41, 55, 408, 142, 148, 292, 145],
    "humaneval": [139, 123, 105, 10, 148, 153, 117, 143, 91, 118, 137, 106, 87, 53, 156, 72, 80, 154, 162, 68],
    "mbpp": [252, 92, 246, 54, 203, 149, 116, 68, 83, 242, 0, 36, 126, 74, 230, 94, 222, 65, 244, 6],
    "livecodebench": [212, 515, 638, 734, 305, 553, 317, 5, 36, 1014, 334, 927, 527, 335, 550, 142, 194, 572, 790,
                      763],
}
LAST_OF_128 = {"math500": 274, "humaneval": 86, "mbpp": 243, "livecodebench": 81}
FIRST_PROMPT = {
    "gsm8k": "Carmen has $100, Samantha has $25 more than Carmen, and Daisy has $50 more than",
    "math500": "The product of integers 240 and $k$ is a perfect cube.",
    "mbpp": "Write a function to sort a dictionary by value.",
}


# --------------------------------------------------------------------------------------- reference subsets

@needs_eval
def test_gsm8k_subset_is_appendix_a_exactly():
    samples = load_samples("gsm8k", str(EVAL_DIR), 128)
    assert [s.row for s in samples] == GSM8K_128
    assert all(s.dataset == "gsm8k" and len(s.turns) == 1 for s in samples)


@needs_eval
@pytest.mark.parametrize("name", sorted(FIRST_20))
def test_shuffled_subsets_match_appendix_a(name):
    samples = load_samples(name, str(EVAL_DIR), 128)
    rows = [s.row for s in samples]
    assert len(rows) == 128 and len(set(rows)) == 128
    assert rows[:20] == FIRST_20[name]
    if name in LAST_OF_128:
        assert rows[-1] == LAST_OF_128[name]
    if name in FIRST_PROMPT:
        assert samples[0].turns[0].startswith(FIRST_PROMPT[name])


@needs_eval
def test_small_datasets_keep_original_order():
    aime = load_samples("aime25", str(EVAL_DIR), 128)
    assert [s.row for s in aime] == list(range(30))
    assert aime[0].turns[0].startswith("Find the sum of all integer bases $b>9$")
    mt = load_samples("mt-bench", str(EVAL_DIR), 128)
    assert [s.row for s in mt] == list(range(80))
    assert all(len(s.turns) == 2 for s in mt)
    assert mt[0].turns[0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")


@needs_eval
def test_every_known_dataset_file_loads_in_full():
    for name in KNOWN_DATASETS:
        samples = load_samples(name, str(EVAL_DIR), None)
        assert [s.row for s in samples] == list(range(len(samples))), name


def test_subset_rule_boundaries():
    assert subset_rows(5, None) == [0, 1, 2, 3, 4]
    assert subset_rows(5, 5) == [0, 1, 2, 3, 4]  # equal count: no shuffle, as the reference (strictly more rows)
    assert subset_rows(5, 9) == [0, 1, 2, 3, 4]
    assert subset_rows(6, 3) == np.random.default_rng(0).permutation(6)[:3].tolist()


# ------------------------------------------------------------------------------------------- local files

def _write(path: Path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_custom_name_blank_lines_and_multi_turn(tmp_path):
    _write(tmp_path / "my-prompts.jsonl", [
        json.dumps({"turns": ["first"]}),
        "",
        "   ",
        json.dumps({"turns": ["héllo", "second turn"], "id": "extra keys are ignored"}, ensure_ascii=False),
        json.dumps({"turns": ["third"]}),
    ])
    samples = load_samples("my-prompts", str(tmp_path), None)
    assert samples == [Sample("my-prompts", 0, ("first",)), Sample("my-prompts", 1, ("héllo", "second turn")),
                       Sample("my-prompts", 2, ("third",))]
    # a custom set larger than max_samples gets the same seeded subset as the reference datasets
    assert [s.row for s in load_samples("my-prompts", str(tmp_path), 2)] == subset_rows(3, 2)


def test_known_name_with_data_dir_reads_the_local_file(tmp_path):
    _write(tmp_path / "gsm8k.jsonl", [json.dumps({"turns": ["local"]})])
    assert load_samples("gsm8k", str(tmp_path), 128) == [Sample("gsm8k", 0, ("local",))]


@pytest.mark.parametrize("lines, expected", [
    (['{"turns": ["ok"]}', '{"turns": ["a"'], ["x.jsonl:2", "not valid JSON"]),
    (['{"prompt": "hi"}'], ["x.jsonl:1", "'turns'"]),
    (['["hi"]'], ["x.jsonl:1", "'turns'"]),
    (['{"turns": "hi"}'], ["x.jsonl:1", "non-empty list"]),
    (['{"turns": []}'], ["x.jsonl:1", "non-empty list"]),
    (['{"turns": ["hi", ""]}'], ["x.jsonl:1", "non-empty strings"]),
    (['{"turns": ["hi", 3]}'], ["x.jsonl:1", "non-empty strings"]),
    (["", "  "], ["x.jsonl", "no rows"]),
])
def test_bad_rows_name_the_file_and_line(tmp_path, lines, expected):
    _write(tmp_path / "x.jsonl", lines)
    with pytest.raises(UsageError) as err:
        load_samples("x", str(tmp_path), None)
    msg = str(err.value)
    assert "\n" not in msg
    for part in expected:
        assert part in msg


def test_empty_file_is_refused(tmp_path):
    (tmp_path / "x.jsonl").write_bytes(b"")
    with pytest.raises(UsageError, match="no rows"):
        load_samples("x", str(tmp_path), None)


def test_non_utf8_file_is_refused(tmp_path):
    (tmp_path / "x.jsonl").write_bytes(b'{"turns": ["\xff"]}\n')
    with pytest.raises(UsageError, match="UTF-8"):
        load_samples("x", str(tmp_path), None)


def test_missing_file_says_which_path_and_what_to_hold(tmp_path):
    with pytest.raises(UsageError) as err:
        validate_dataset_args("nope", str(tmp_path), None)
    msg = str(err.value)
    assert str(tmp_path / "nope.jsonl") in msg and "--data-dir" in msg and "nope.jsonl" in msg
    with pytest.raises(UsageError, match="drop the .jsonl suffix"):
        validate_dataset_args("nope.jsonl", str(tmp_path), None)


def test_data_dir_must_be_a_directory(tmp_path):
    with pytest.raises(UsageError, match="not a directory"):
        validate_dataset_args("x", str(tmp_path / "missing"), None)


def test_dataset_name_cannot_escape_data_dir(tmp_path):
    with pytest.raises(UsageError, match="bare name"):
        validate_dataset_args("../x", str(tmp_path), None)


@pytest.mark.parametrize("bad", [0, -3])
def test_max_samples_must_be_positive(tmp_path, bad):
    _write(tmp_path / "x.jsonl", [json.dumps({"turns": ["a"]})])
    with pytest.raises(UsageError, match="--max-samples must be >= 1"):
        load_samples("x", str(tmp_path), bad)
    with pytest.raises(UsageError, match="--max-samples"):
        validate_dataset_args("gsm8k", None, bad)


def test_unknown_name_without_data_dir_lists_the_known_ones():
    with pytest.raises(UsageError) as err:
        validate_dataset_args("alpaca", None, None)
    msg = str(err.value)
    assert all(name in msg for name in KNOWN_DATASETS) and "--data-dir" in msg


def test_known_name_without_data_dir_is_accepted_without_network_or_imports(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("validate_dataset_args touched the network")
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    for name in KNOWN_DATASETS:
        validate_dataset_args(name, None, 128)
    # and it imports neither datasets nor huggingface_hub (checked in a fresh interpreter)
    code = ("import sys, harness.protocol.data as d\n"
            "[d.validate_dataset_args(n, None, 128) for n in d.KNOWN_DATASETS]\n"
            "loaded = [m for m in ('datasets', 'huggingface_hub') if m in sys.modules]\n"
            "assert not loaded, loaded\n")
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)


def test_hub_without_the_datasets_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(data_mod, "_datasets_installed", lambda: False)
    with pytest.raises(DatasetSourceError) as err:
        validate_dataset_args("gsm8k", None, 128)
    msg = str(err.value)
    assert isinstance(err.value, UsageError) and "\n" not in msg
    assert "datasets>=3" in msg and "--data-dir" in msg


# ------------------------------------------------------------------ prompt templates (REFERENCE.md section 8)
# The expected strings below are typed from section 8, not taken from harness.protocol.data.

SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HE_HEAD = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
HE_TAIL = "\n```"
LCB_HEAD = ("You are an expert Python programmer. You will be given a question (problem specification) and will "
            "generate a correct Python program that matches the specification and passes all tests. You will NOT "
            "return anything except for the program\n\n### Question:\n")
LCB_WITH_STARTER = "\n\n### Format: Use the following code structure:\n```python\n"
LCB_NO_STARTER = "\n\n### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```"
LCB_TAIL = "\n\n### Answer: (use the provided format with backticks)"
EXPECTED_ROWS = {"gsm8k": 1319, "math500": 500, "humaneval": 164, "mbpp": 257, "aime25": 30, "aime24": 30,
                 "livecodebench": 1055, "mt-bench": 80}


def test_math_templates_on_hand_made_rows():
    assert build_turns_gsm8k({"question": "What is 2+2?", "answer": "4"}) == (
        "What is 2+2?\nPlease reason step by step, and put your final answer within \\boxed{}.",)
    for build in (build_turns_math500, build_turns_aime24, build_turns_aime25):
        assert build({"problem": "Find $x$.", "answer": "1"}) == (
            "Find $x$.\nPlease reason step by step, and put your final answer within \\boxed{}.",)


def test_code_templates_on_hand_made_rows():
    row = {"task_id": "HumanEval/0", "prompt": "def f(x):\n    \"\"\"Twice x.\"\"\"\n"}
    assert build_turns_humaneval(row) == (
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
        "def f(x):\n    \"\"\"Twice x.\"\"\"\n\n```",)
    assert build_turns_mbpp({"prompt": "Write a function to add two numbers.", "code": "..."}) == (
        "Write a function to add two numbers.",)
    pre = ("You are an expert Python programmer. You will be given a question (problem specification) and will "
           "generate a correct Python program that matches the specification and passes all tests. You will NOT "
           "return anything except for the program")
    with_starter = {"question_content": "Add a and b.", "starter_code": "class Solution:\n    def add(self, a, b):"}
    assert build_turns_livecodebench(with_starter) == (
        pre + "\n\n### Question:\nAdd a and b.\n\n### Format: Use the following code structure:\n```python\n"
        "class Solution:\n    def add(self, a, b):\n```\n\n### Answer: (use the provided format with backticks)",)
    for empty in ("", None):
        assert build_turns_livecodebench({"question_content": "Read n.", "starter_code": empty}) == (
            pre + "\n\n### Question:\nRead n.\n\n### Format: Write your code in the following format:\n```python\n"
            "# YOUR CODE HERE\n```\n\n### Answer: (use the provided format with backticks)",)


def test_mt_bench_turns_are_verbatim():
    assert build_turns_mt_bench({"prompt": ["first turn", "second turn"], "category": "writing"}) == (
        "first turn", "second turn")


def _strip(text: str, head: str, tail: str) -> str:
    assert text.startswith(head) and text.endswith(tail), text[:80]
    return text[len(head):len(text) - len(tail)]


def _lcb_raw(prompt: str) -> dict:
    """question_content and starter_code recovered from a LiveCodeBench prompt (the template's inverse)."""
    body = _strip(prompt, LCB_HEAD, LCB_TAIL)
    assert body.count("\n\n### Format: ") == 1
    if body.endswith(LCB_NO_STARTER):
        return {"question_content": body[:-len(LCB_NO_STARTER)], "starter_code": ""}
    question, starter = body.split(LCB_WITH_STARTER)
    return {"question_content": question, "starter_code": _strip(starter, "", "\n```")}


# Raw hub fields recovered from one local prompt row, per dataset.
RAW_FROM_LOCAL = {
    "gsm8k": lambda t: {"question": _strip(t[0], "", SUFFIX)},
    "math500": lambda t: {"problem": _strip(t[0], "", SUFFIX)},
    "aime24": lambda t: {"problem": _strip(t[0], "", SUFFIX)},
    "aime25": lambda t: {"problem": _strip(t[0], "", SUFFIX)},
    "humaneval": lambda t: {"prompt": _strip(t[0], HE_HEAD, HE_TAIL)},
    "mbpp": lambda t: {"prompt": t[0]},
    "livecodebench": lambda t: _lcb_raw(t[0]),
    "mt-bench": lambda t: {"prompt": list(t)},
}


def _local_turns(name: str) -> list[tuple[str, ...]]:
    with open(EVAL_DIR / f"{name}.jsonl", encoding="utf-8") as f:
        return [tuple(json.loads(line)["turns"]) for line in f if line.strip()]


@needs_eval
@pytest.mark.parametrize("name", KNOWN_DATASETS)
def test_templates_rebuild_every_local_prompt_byte_for_byte(name):
    """Raw fields recovered from each local prompt, rebuilt with the hub builder, equal the prompt exactly."""
    local = _local_turns(name)
    assert len(local) == EXPECTED_ROWS[name]
    build = HUB_SOURCES[name].build
    matched = 0
    for i, turns in enumerate(local):
        rebuilt = build(RAW_FROM_LOCAL[name](turns))
        assert rebuilt == turns, f"{name} row {i}"
        assert [t.encode("utf-8") for t in rebuilt] == [t.encode("utf-8") for t in turns]
        matched += 1
    assert matched == EXPECTED_ROWS[name]
    if name == "livecodebench":  # both format branches occur in the real data
        starters = sum(bool(_lcb_raw(t[0])["starter_code"]) for t in local)
        assert (starters, len(local) - starters) == (444, 611)
    if name == "mt-bench":
        assert all(len(t) == 2 for t in local)


def test_hub_sources_follow_section_8():
    got = {n: (s.repo, s.config, s.split) for n, s in HUB_SOURCES.items() if not s.files}
    assert got == {
        "gsm8k": ("openai/gsm8k", "main", "test"),
        "math500": ("HuggingFaceH4/MATH-500", None, "test"),
        "humaneval": ("openai/openai_humaneval", None, "test"),
        "mbpp": ("google-research-datasets/mbpp", "sanitized", "test"),
        "aime24": ("HuggingFaceH4/aime_2024", None, "train"),
        "aime25": ("MathArena/aime_2025", None, "train"),
        "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train"),
    }
    lcb = HUB_SOURCES["livecodebench"]
    assert lcb.repo == "livecodebench/code_generation_lite"
    assert lcb.files == ("test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl")
    assert set(HUB_SOURCES) == set(KNOWN_DATASETS) == set(PINNED_REVISIONS)
    for name, src in HUB_SOURCES.items():
        assert src.revision == PINNED_REVISIONS[name]
        assert src.revision is None or (len(src.revision) == 40 and int(src.revision, 16) >= 0), name


# ------------------------------------------------------------------ subset rule against the datasets library

@needs_eval
def test_subset_rule_equals_datasets_shuffle_for_every_local_file():
    datasets = pytest.importorskip("datasets", reason="datasets is in requirements.txt: pip install 'datasets>=3'")
    for name in KNOWN_DATASETS:
        n = len(_local_turns(name))
        if n > 128:
            ds = datasets.Dataset.from_dict({"i": list(range(n))})
            expected = ds.shuffle(seed=0).select(range(128))["i"]
        else:  # the reference shuffles only when there are more rows than --max-samples
            expected = list(range(n))
        assert subset_rows(n, 128) == list(expected), name


# ------------------------------------------------------------------ hub plumbing, offline (fake hub)

class _FakeInfo:
    sha = "ab" * 20


@pytest.fixture
def fake_hub(monkeypatch):
    """HfApi.dataset_info, datasets.load_dataset and hf_hub_download replaced; records the calls."""
    import datasets
    import huggingface_hub
    calls = []

    def dataset_info(self, repo, revision=None, timeout=None, **kw):
        calls.append(("info", repo, revision, timeout))
        return _FakeInfo()

    def load_dataset(repo, config=None, split=None, revision=None, **kw):
        calls.append(("load", repo, config, split, revision))
        return [{"question": "q0", "answer": "a"}, {"question": "q1", "answer": "b"},
                {"question": "q2", "answer": "c"}]

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", dataset_info)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(data_mod, "_HUB_LOADED", {})
    return calls


def test_hub_load_reads_the_resolved_commit_and_records_it(fake_hub):
    samples = load_samples("gsm8k", None, 2)
    assert fake_hub == [("info", "openai/gsm8k", None, data_mod.HUB_PROBE_TIMEOUT_S),
                        ("load", "openai/gsm8k", "main", "test", "ab" * 20)]
    assert [s.row for s in samples] == subset_rows(3, 2)
    assert [s.turns for s in samples] == [(f"q{r}" + SUFFIX,) for r in subset_rows(3, 2)]
    assert all(s.source == f"hub openai/gsm8k config=main split=test revision=unpinned resolved={'ab' * 20}"
               for s in samples)
    prov = dataset_provenance("gsm8k", None)
    rows_jsonl = "".join(json.dumps({"turns": [f"q{i}" + SUFFIX]}) + "\n" for i in range(3))
    assert prov == {"source": "hub", "repo": "openai/gsm8k", "config": "main", "split": "test",
                    "revision": "unpinned", "resolved_revision": "ab" * 20, "file": None,
                    "sha256": hashlib.sha256(rows_jsonl.encode()).hexdigest()}


def test_hub_load_uses_a_pinned_revision(fake_hub, monkeypatch):
    pin = "cd" * 20
    monkeypatch.setitem(HUB_SOURCES, "gsm8k", HUB_SOURCES["gsm8k"]._replace(revision=pin))
    samples = load_samples("gsm8k", None, None)
    assert fake_hub[0][:3] == ("info", "openai/gsm8k", pin) and fake_hub[1][-1] == "ab" * 20
    assert samples[0].source.endswith(f"revision={pin} resolved={'ab' * 20}")
    assert dataset_provenance("gsm8k", None)["revision"] == pin
    assert dataset_provenance("mbpp", None)["revision"] == "unpinned"


def test_offline_mode_skips_the_probe_and_reads_the_cache(fake_hub, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert hub_offline()
    samples = load_samples("gsm8k", None, None)
    assert [c[0] for c in fake_hub] == ["load"] and fake_hub[0][-1] is None
    assert samples[0].source == "hub openai/gsm8k config=main split=test revision=unpinned"


def test_livecodebench_reads_the_six_files_in_order(fake_hub, monkeypatch, tmp_path):
    import huggingface_hub
    fetched = []

    def hf_hub_download(repo, filename, repo_type=None, revision=None, **kw):
        fetched.append((repo, filename, repo_type, revision))
        path = tmp_path / filename
        rows = [{"question_content": f"{filename}#{k}", "starter_code": "" if k else "def f():",
                 "private_test_cases": "x" * 10} for k in range(2)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return str(path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    samples = load_samples("livecodebench", None, None)
    files = ["test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl"]
    assert fetched == [("livecodebench/code_generation_lite", f, "dataset", "ab" * 20) for f in files]
    assert [_lcb_raw(s.turns[0])["question_content"] for s in samples] == [f"{f}#{k}" for f in files
                                                                           for k in range(2)]
    assert _lcb_raw(samples[0].turns[0])["starter_code"] == "def f():"
    prov = dataset_provenance("livecodebench", None)
    assert prov["file"] == files and prov["split"] is None and prov["revision"] == "unpinned"


def test_unreachable_hub_fails_fast_in_one_line(monkeypatch):
    import huggingface_hub

    def dataset_info(self, repo, **kw):
        raise ConnectionError("[Errno -2] Name or service not known\nsecond line")

    def load_dataset(*a, **kw):
        raise AssertionError("no download may start when the probe fails")

    import datasets
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", dataset_info)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    with pytest.raises(DatasetSourceError) as err:
        load_samples("mt-bench", None, None)
    msg = str(err.value)
    assert isinstance(err.value, UsageError) and "\n" not in msg
    assert "HuggingFaceH4/mt_bench_prompts" in msg and "Name or service not known" in msg and "--data-dir" in msg


def test_download_errors_become_one_line_usage_errors(fake_hub, monkeypatch):
    import datasets

    def load_dataset(*a, **kw):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(DatasetSourceError, match="could not load 'gsm8k' .*--data-dir"):
        load_samples("gsm8k", None, None)


# ------------------------------------------------------------------ provenance

def test_local_provenance_hashes_the_file(tmp_path):
    _write(tmp_path / "p.jsonl", [json.dumps({"turns": ["a"]})])
    prov = dataset_provenance("p", str(tmp_path))
    assert prov["source"] == "local" and prov["file"] == str((tmp_path / "p.jsonl").resolve())
    assert prov["sha256"] == hashlib.sha256((tmp_path / "p.jsonl").read_bytes()).hexdigest()
    assert prov["repo"] is None and prov["revision"] is None
    assert load_samples("p", str(tmp_path), None)[0].source == f"local {tmp_path / 'p.jsonl'}"
    with pytest.raises(UsageError, match="not found"):
        dataset_provenance("q", str(tmp_path))
    with pytest.raises(UsageError, match="unknown dataset"):
        dataset_provenance("alpaca", None)


@needs_eval
def test_hub_prompt_hash_equals_the_local_file_hash_for_equal_prompts():
    """The sha256 recorded for a hub load is comparable with the local file's: same bytes, same hash."""
    for name in KNOWN_DATASETS:
        rows = _local_turns(name)
        assert data_mod._prompts_sha256(rows) == dataset_provenance(name, str(EVAL_DIR))["sha256"], name


# ------------------------------------------------------------------ the real hub (skips when unreachable)

@pytest.fixture(scope="module")
def hub_reachable():
    """One quick metadata request; any failure skips every hub test at once (no retries, no hang)."""
    if hub_offline():
        pytest.skip("HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set: hub equivalence test skipped")
    pytest.importorskip("datasets", reason="datasets is in requirements.txt: pip install 'datasets>=3'")
    from huggingface_hub import HfApi
    start = time.monotonic()
    try:
        HfApi().dataset_info("openai/gsm8k", timeout=5)
    except Exception as e:
        pytest.skip(f"HF hub not reachable ({type(e).__name__}: {' '.join(str(e).split())[:120]}; "
                    f"{time.monotonic() - start:.1f}s): hub-vs-local prompt test skipped, the offline template "
                    f"tests above cover the prompt strings")


@pytest.mark.network
@needs_eval
@pytest.mark.parametrize("name", KNOWN_DATASETS)
def test_hub_prompts_equal_local_files(hub_reachable, name):
    samples = load_samples(name, None, None)
    local = _local_turns(name)
    assert len(samples) == len(local) == EXPECTED_ROWS[name]
    for s, turns in zip(samples, local):
        assert s.turns == turns, f"{name} row {s.row}"
    assert dataset_provenance(name, None)["sha256"] == dataset_provenance(name, str(EVAL_DIR))["sha256"]


# ------------------------------------------------------------------------------------------- chat rendering

# Qwen3's shape: the empty think block appears only when the caller turns thinking off.
QWEN_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n"
             "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
PLAIN = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
         "{% if add_generation_prompt %}[assistant] {% endif %}")


def _byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built offline: every string encodes, so a wrong rendering cannot hide behind <unk>."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<bos>", "<|im_start|>", "<|im_end|>"])
    # a BOS-adding post-processor shows whether special tokens were added on top of the template
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                       special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>")


def test_render_single_turn_disables_thinking_and_adds_no_bos():
    tok = _byte_tokenizer()
    tok.chat_template = QWEN_LIKE
    ids = render_prompt(tok, [{"role": "user", "content": "Hi, é?"}])
    expected = "<|im_start|>user\nHi, é?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert ids == tok.encode(expected, add_special_tokens=False)
    assert tok.decode(ids) == expected
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.bos_token_id not in ids
    assert all(type(i) is int for i in ids)


def test_render_multi_turn_history():
    tok = _byte_tokenizer()
    tok.chat_template = QWEN_LIKE
    messages = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "reply"},
                {"role": "user", "content": "two"}]
    expected = ("<|im_start|>user\none<|im_end|>\n<|im_start|>assistant\nreply<|im_end|>\n"
                "<|im_start|>user\ntwo<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.decode(render_prompt(tok, messages)) == expected


def test_render_template_without_enable_thinking_ignores_it():
    tok = _byte_tokenizer()
    tok.chat_template = PLAIN
    ids = render_prompt(tok, [{"role": "user", "content": "Hi"}])
    assert ids == tok.encode("[user] Hi\n[assistant] ", add_special_tokens=False)


def test_render_without_template_falls_back_to_plain_text():
    tok = _byte_tokenizer()
    assert not getattr(tok, "chat_template", None)
    ids = render_prompt(tok, [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}])
    assert ids == tok.encode("one\n\ntwo", add_special_tokens=True)
    assert ids[0] == tok.bos_token_id
