"""Datasets: the reference's subsets (REFERENCE.md appendix A), local JSONL rules and refusals, chat rendering."""
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from harness.data import KNOWN_DATASETS, Sample, load_samples, render_prompt, subset_rows, validate_dataset_args
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


def test_hub_loading_is_refused_with_a_pointer_to_data_dir():
    with pytest.raises(UsageError, match="not available yet.*--data-dir"):
        validate_dataset_args("gsm8k", None, 128)
    with pytest.raises(UsageError, match="not available yet"):
        load_samples("mt-bench", None, None)


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
