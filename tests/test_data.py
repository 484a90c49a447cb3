"""Datasets: the reference's subsets (REFERENCE.md appendix A), local JSONL rules and refusals, the hub prompt
templates (REFERENCE.md section 8) checked byte for byte against ../shared/data/eval, and chat rendering."""
import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import harness.protocol.data as data_mod
from harness.protocol.data import (HUB_SOURCES, KNOWN_DATASETS, PINNED_REVISIONS, DatasetSourceError, Sample,
                                   build_turns_aime24, build_turns_aime25, build_turns_gsm8k, build_turns_humaneval,
                                   build_turns_livecodebench, build_turns_math500, build_turns_mbpp,
                                   build_turns_mt_bench, load_samples, subset_rows, validate_dataset_args)
from core.errors import UsageError

from eval_files import EVAL_DIR, needs_eval  # noqa: E402
from data_templates import EXPECTED_ROWS, RAW_FROM_LOCAL, _lcb_raw, _local_turns, _write  # noqa: F401

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
