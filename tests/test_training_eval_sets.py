"""prompts.eval_sets (training/eval_sets.py): the selection and held-out sets pinned from a folder, the same in every
run whatever its pool; training prompts near-duplicating a pinned one (before templates) are dropped and counted;
the files' content is part of the stage's key; a folder that does not match the config is refused before anything
loads. The prompts stage runs here without a target (JSONL prompts only, no Magpie)."""
import json

import pytest

from core.errors import UsageError
from training import prompts
from training.config import load_config

SUFFIX = " Please reason step by step."


def _setup(tmp_path, held_texts=("a question number 3 about apples", "something else entirely new here"),
           sel=2):
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"question": f"a question number {i} about apples"}) + "\n" for i in range(20)))
    pinned = tmp_path / "sets"
    pinned.mkdir(exist_ok=True)
    # the held-out row wraps its text in the template, as the stage writes a templated row
    held = [{"text": t + SUFFIX, "source": f"x.jsonl:{i}", "template": 0} for i, t in enumerate(held_texts)]
    (pinned / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held))
    (pinned / "selection.jsonl").write_text("".join(json.dumps({"text": f"pinned selection prompt {i}",
                                                                "source": f"y.jsonl:{i}"}) + "\n" for i in range(sel)))
    (tmp_path / "eval").mkdir(exist_ok=True)
    (tmp_path / "c.json").write_text(json.dumps({
        "target": "t", "models": {"d": {}},
        "prompts": {"jsonl": [str(src)], "min_chars": 4, "heldout": 2, "selection": 2, "eval_dir": str(tmp_path / "eval"),
                    "eval_sets": str(pinned), "templates": [{"sources": ["a.jsonl"], "suffix": SUFFIX, "share": 1.0}]}}))
    return pinned


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_pinned_sets_are_the_runs_sets_and_their_near_duplicates_leave_the_training_prompts(tmp_path):
    pinned = _setup(tmp_path)
    cfg = load_config(str(tmp_path / "c.json"), workdir=str(tmp_path / "work"))
    out = prompts.run(cfg, load=lambda: pytest.fail("loaded the target"))
    assert _read(out / "heldout.jsonl") == _read(pinned / "heldout.jsonl")
    assert _read(out / "selection.jsonl") == _read(pinned / "selection.jsonl")
    train = _read(out / "train.jsonl")
    m = json.loads((out / "manifest.json").read_text())
    # question 3 is the pinned held-out prompt before its template: dropped; the other 19 train, templated
    assert m["dropped"]["eval_sets_overlap"] == 1 and len(train) == m["train"] == 19
    assert not any(r["text"].startswith("a question number 3 ") for r in train)
    assert m["eval_sets"]["path"] == str(pinned) and len(m["eval_sets"]["digest"]) == 16
    key = m["key"]
    (pinned / "selection.jsonl").write_text(json.dumps({"text": "another", "source": "y.jsonl:0"}) + "\n" +
                                            json.dumps({"text": "and another", "source": "y.jsonl:1"}) + "\n")
    assert prompts.stage_key(cfg, m["eval_files"], prompts.eval_sets.read(cfg)[2]) != key


def test_without_eval_sets_the_stage_key_is_the_one_from_before_the_field(tmp_path):
    _setup(tmp_path)
    cfg = load_config(str(tmp_path / "c.json"), workdir=str(tmp_path / "work"))
    cfg["prompts"]["eval_sets"] = ""
    key = prompts.stage_key(cfg, [])
    del cfg["prompts"]["eval_sets"]
    assert prompts.stage_key(cfg, []) == key


@pytest.mark.parametrize("change, says", [
    ("count", "holds 3 prompts and prompts.selection asks for 2: set prompts.selection to 3"),
    ("missing", "no heldout.jsonl in "),
    ("row", "a row needs a text and a source")])
def test_a_folder_that_does_not_match_is_refused_at_the_config(tmp_path, change, says):
    pinned = _setup(tmp_path, sel=3 if change == "count" else 2)
    if change == "missing":
        (pinned / "heldout.jsonl").unlink()
    if change == "row":
        (pinned / "heldout.jsonl").write_text(json.dumps({"text": "no source"}) + "\n" * 2)
    with pytest.raises(UsageError, match=says):
        load_config(str(tmp_path / "c.json"), workdir=str(tmp_path / "work"))
    assert not (tmp_path / "work").exists()


def test_a_pinned_prompt_without_ngrams_or_under_another_template_index_still_leaves_the_training_prompts(tmp_path):
    """Found by review: a prompt of no Latin words has no n-grams, so only an exact match catches its copy; and a
    pinned folder written under other template indices is stripped by the configured template that wraps it."""
    from training import eval_sets
    _setup(tmp_path)
    cfg = load_config(str(tmp_path / "c.json"), workdir=str(tmp_path / "work"))
    pinned = [{"text": "你好 世界", "source": "m:1"}, {"text": "a question number 7 about apples" + SUFFIX,
                                                      "source": "x:1", "template": 5}]
    rows = [{"text": "你好  世界", "source": "t:1"}, {"text": "a question number 7 about apples", "source": "t:2"},
            {"text": "a question number 8 about pears and plums", "source": "t:3"}]
    kept, n = eval_sets.drop_near(rows, pinned, cfg)
    assert n == 2 and [r["source"] for r in kept] == ["t:3"]


@pytest.mark.parametrize("value", [123, True, ["x"]])
def test_eval_sets_must_be_a_path(tmp_path, value):
    _setup(tmp_path)
    raw = json.loads((tmp_path / "c.json").read_text())
    raw["prompts"]["eval_sets"] = value
    (tmp_path / "c.json").write_text(json.dumps(raw))
    with pytest.raises(UsageError, match="prompts.eval_sets must be a folder path"):
        load_config(str(tmp_path / "c.json"))


def test_preset_prompt_keys_are_the_ones_from_before_eval_sets():
    """The keys d73925c computed (before prompts.eval_sets existed): a workdir's pool stays up to date."""
    got = [prompts.stage_key(load_config(n), ["gsm8k.jsonl"]) for n in ("smollm2-gpu", "smollm2-gpu-continue", "tiny-cpu")]
    assert got == ["881a456551c7e411", "adeaf8fa9057902e", "73e91a73dc37fcec"]
