"""The prompts stage at 100K-prompt scale (issue 26 item 4): the near-duplicate and benchmark-overlap filters are
prefix-filtered (exact at and above their threshold, without comparing every prompt with every prompt that shares
an opening), and instruction templates are applied after both filters compared the bare text."""
import math
import random

import pytest

from core.errors import UsageError
from training.domains import apply_templates, validate_templates
from training.overlap import NgramIndex, gram_frequencies, ngrams


def _brute(texts_in: list[str], query: str, n: int) -> float:
    q = ngrams(query, n)
    return max((len(q & s) / len(q | s) for s in map(lambda t: ngrams(t, n), texts_in)), default=0.0)


def _texts(seed: int) -> list[str]:
    """Edits of a few base texts over a 12-word vocabulary: most pairs share n-grams, many cross 0.5 and 0.8."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(12)]
    bases = [[rng.choice(vocab) for _ in range(rng.randint(4, 14))] for _ in range(6)]
    texts = []
    for _ in range(300):
        words = list(rng.choice(bases))
        for _ in range(rng.randint(0, 3)):
            words[rng.randrange(len(words))] = rng.choice(vocab)
        texts.append(" ".join(words))
    return texts


def _dedup_errors(cls, threshold: float) -> tuple[int, int]:
    """(queries where the index and brute force disagree on a match >= threshold or its Jaccard, matches)."""
    texts = _texts(1)
    index, kept, errors, hits = cls(2, threshold, gram_frequencies(texts, 2)), [], 0, 0
    for i, t in enumerate(texts):
        j, truth = index.best(t)[1], _brute(kept, t, 2)
        errors += (j >= threshold) != (truth >= threshold) or (truth >= threshold and abs(j - truth) > 1e-12)
        if truth >= threshold:
            hits += 1
            continue
        index.add(t, str(i))
        kept.append(t)
    return errors, hits


class _OneShort(NgramIndex):
    """The prefix rule without its `+ 1`: one n-gram too few indexed and probed."""

    def _probe(self, grams):
        order = sorted(grams, key=lambda g: (self.df.get(g, 0), g))
        return order[:len(order) - math.ceil(self.threshold * len(order) - 1e-9)]


@pytest.mark.parametrize("threshold", [0.5, 0.8])
def test_prefix_filtered_index_is_exact_at_and_above_its_threshold(threshold):
    """For every query, the thresholded index finds a match >= threshold exactly when brute force does, with the
    same Jaccard; the same data catch a prefix rule one n-gram short (the test's power)."""
    errors, hits = _dedup_errors(NgramIndex, threshold)
    assert errors == 0 and hits > 50
    assert _dedup_errors(_OneShort, threshold)[0] > 0


def test_templates_wrap_only_their_sources_after_the_filters():
    rows = [{"text": f"q{i}", "source": f"gsm8k.jsonl:{i}"} for i in range(200)] + \
        [{"text": f"m{i}", "source": f"magpie:chat:{i}"} for i in range(50)]
    t = [{"sources": ["gsm8k.jsonl"], "suffix": "\nPlease reason step by step.", "share": 0.75}]
    out = apply_templates(rows, t, seed=0)
    wrapped = [r for r in out if "template" in r]
    assert all(r["source"].startswith("gsm8k.jsonl:") and r["text"].endswith("step by step.") for r in wrapped)
    assert 120 <= len(wrapped) <= 180  # share 0.75 of 200 (binomial sd 6)
    assert [r["text"] for r in out if "template" not in r and r["source"].startswith("magpie")] == \
        [f"m{i}" for i in range(50)]
    assert apply_templates(rows, t, seed=0) == out  # seeded
    for bad, msg in (([{"suffix": "x"}], "expected an object"), ([{"sources": [], "suffix": "x"}], "non-empty"),
                     ([{"sources": ["a"]}], "prefix or a suffix"),
                     ([{"sources": ["a"], "suffix": "x", "share": 0}], r"share must be a number in \(0, 1\]")):
        with pytest.raises(UsageError, match=msg):
            validate_templates(bad)


def _tiny_run(tmp_path, sources: dict, responses: dict):
    import torch
    from tiny import save_tiny_checkpoint
    from training import prompts
    from training.config import load_config
    from training.target import load_hf
    save_tiny_checkpoint(tmp_path / "target")
    files = []
    for name, n in sources.items():
        f = tmp_path / name
        f.write_text("".join('{"question": "%s question number %d about apples and \\u2028 pears"}\n' % (name, i)
                             for i in range(n)))
        files.append(str(f))
    (tmp_path / "eval").mkdir()
    import json
    (tmp_path / "c.json").write_text(json.dumps({
        "target": str(tmp_path / "target"), "models": {"d": {}},
        "prompts": {"jsonl": files, "min_chars": 4, "dedup_jaccard": 1.1, "heldout": 2, "selection": 2,
                    "eval_dir": str(tmp_path / "eval")},
        "responses": {"max_new_tokens": 4, "batch_size": 4, "sampled": 0, **responses}}))
    cfg = load_config(str(tmp_path / "c.json"), workdir=str(tmp_path / "work"))
    hf = load_hf(cfg["target"], torch.device("cpu"))
    prompts.run(cfg, load=lambda: hf)
    return cfg, hf


def test_a_boxed_responses_stage_keeps_every_source_and_reads_u2028(tmp_path, monkeypatch):
    """responses.max_minutes: the first call of parts always runs, then the box ends the stage complete, with what
    it wrote (manifest: parts 2 of 8). Parts follow a seeded shuffle of the prompts, so that those 2 parts hold both
    source files (train.jsonl lists them file by file: unshuffled, the 16 prompts would all come from a.jsonl).
    Every prompt holds U+2028, which str.splitlines took for a line break (the H200 run stopped on it)."""
    import json
    from training import responses
    monkeypatch.setattr(responses, "PART_PROMPTS", 8)
    cfg, hf = _tiny_run(tmp_path, {"a.jsonl": 32, "b.jsonl": 32}, {"max_minutes": 1e-6})
    out = responses.run(cfg, load=lambda: hf)
    m = json.loads((out / "manifest.json").read_text())
    assert m["complete"] and (m["parts"], m["parts_planned"]) == (2, 8) and m["sequences"] == 16
    rows = responses.read_rows(cfg)
    assert {r["source"].split(":")[0] for r in rows} == {"a.jsonl", "b.jsonl"}
    assert responses.run(cfg, load=lambda: hf) == out  # up to date: the box is not part of the stage's key


def test_first_part_leaves_the_earlier_parts_to_the_session_that_wrote_them(tmp_path, monkeypatch):
    """responses.first_part: a continuation session generates fresh prompts (the parts from first_part on, in the
    same seeded shuffle), not again the parts the warm-start drafter already trained on; one past the last part is
    refused before the target loads."""
    import json
    from training import responses
    monkeypatch.setattr(responses, "PART_PROMPTS", 8)
    cfg, hf = _tiny_run(tmp_path, {"a.jsonl": 32, "b.jsonl": 32}, {"first_part": 5})
    out = responses.run(cfg, load=lambda: hf)
    m = json.loads((out / "manifest.json").read_text())
    assert sorted(f.name for f in (out / "parts").glob("part_*.jsonl")) == [f"part_{g:04d}.jsonl" for g in (5, 6, 7)]
    assert (m["parts"], m["parts_planned"], m["first_part"]) == (3, 8, 5)
    assert m["sequences"] == len(responses.read_rows(cfg)) == 20  # 60 train prompts (4 held out): 8 + 8 + 4
    cfg2, _ = _tiny_run(tmp_path / "all", {"a.jsonl": 32, "b.jsonl": 32}, {})
    full = responses.run(cfg2, load=lambda: hf)
    for g in (5, 6, 7):  # the same prompts and answers as a run from part 0 wrote there
        assert (out / "parts" / f"part_{g:04d}.jsonl").read_text() == (full / "parts" / f"part_{g:04d}.jsonl").read_text()
    cfg["responses"]["first_part"] = 8
    with pytest.raises(UsageError, match="first_part 8: there are only 8 parts"):
        responses.run(cfg, load=lambda: pytest.fail("loaded the target"), force=True)


@pytest.mark.parametrize("section,bad,msg", [
    ("responses", {"max_minutes": -1}, "responses.max_minutes must be a number of minutes >= 0"),
    ("responses", {"max_minutes": "5"}, "responses.max_minutes must be a number of minutes >= 0"),
    ("responses", {"first_part": -1}, "responses.first_part must be an integer >= 0"),
    ("models", {"d": {"max_minutes": 0}}, r"models.d: max_minutes must be a number > 0"),
])
def test_bad_boxes_are_refused_before_anything_loads(tmp_path, section, bad, msg):
    import json
    from training.config import load_config
    raw = {"target": "t", "models": {"d": {}}, section: bad}
    (tmp_path / "c.json").write_text(json.dumps(raw))
    with pytest.raises(UsageError, match=msg):
        load_config(str(tmp_path / "c.json"))


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_sampled_by_group_gives_one_group_more_sampled_answers_and_leaves_the_rest_as_they_were(tmp_path, monkeypatch,
                                                                                                  engine):
    """responses.sampled_by_group: the GSM8K train questions (here a.jsonl) get 3 sampled answers, the other group
    sampled's 1; the greedy answers and every row of the other group are those of a run without the key (its
    seeds unchanged), and the stage's key is unchanged while the key is unset. An unknown group is refused before
    the target loads."""
    import json
    from training import responses
    monkeypatch.setattr(responses, "PART_PROMPTS", 8)
    base = {"sampled": 1, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 6, "engine": engine}
    cfg0, hf = _tiny_run(tmp_path / "plain", {"a.jsonl": 12, "b.jsonl": 12}, base)
    cfg, _ = _tiny_run(tmp_path / "more", {"a.jsonl": 12, "b.jsonl": 12}, {**base, "sampled_by_group": {"a.jsonl": 3}})
    key0 = responses.stage_key(cfg0)
    del cfg0["responses"]["sampled_by_group"]  # a config from before the field: its parts' key
    assert responses.stage_key(cfg0) == key0 != responses.stage_key(cfg)
    cfg0["responses"]["sampled_by_group"] = {}
    rows0 = [r for g in sorted(responses.run(cfg0, load=lambda: hf).glob("parts/*.jsonl")) for r in _read(g)]
    rows = [r for g in sorted(responses.run(cfg, load=lambda: hf).glob("parts/*.jsonl")) for r in _read(g)]
    count = {}
    for r in rows:
        count[r["source"], r["mode"]] = count.get((r["source"], r["mode"]), 0) + 1
    a = {s for s, _ in count if s.startswith("a.jsonl")}
    assert a and all(count[s, "greedy"] == 1 and count[s, "sampled"] == 3 for s in a)
    assert all(count[s, "sampled"] == 1 for s, m in count if m == "sampled" and s not in a)
    same = lambda rs: sorted(json.dumps(r, sort_keys=True) for r in rs if r["mode"] == "greedy"  # noqa: E731
                             or not r["source"].startswith("a.jsonl"))
    assert same(rows) == same(rows0) and len(rows) == len(rows0) + 2 * len(a)
    cfg["responses"]["sampled_by_group"] = {"gsm8k": 2}
    with pytest.raises(UsageError, match=r"sampled_by_group names \['gsm8k'\], no source group .*'a.jsonl', 'b.jsonl'"):
        responses.run(cfg, load=lambda: pytest.fail("loaded the target"), force=True)


def _read(path):
    import json
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sampled_by_group_must_map_groups_to_counts(tmp_path):
    import json
    from training.config import load_config
    (tmp_path / "c.json").write_text(json.dumps({"target": "t", "models": {"d": {}},
                                                 "responses": {"sampled_by_group": {"magpie:math": -1}}}))
    with pytest.raises(UsageError, match="sampled_by_group must map source groups"):
        load_config(str(tmp_path / "c.json"))


def test_sampled_by_group_names_a_group_of_the_parts_this_run_generates(tmp_path, monkeypatch):
    """A group found only in the parts before responses.first_part (which this run does not generate) would do
    nothing: refused, before the target loads."""
    from training import responses
    cfg, _ = _tiny_run(tmp_path, {"a.jsonl": 4, "b.jsonl": 4}, {"first_part": 1, "sampled_by_group": {"a.jsonl": 2}})
    monkeypatch.setattr(responses, "prompt_parts", lambda cfg: [[{"text": "x", "source": "a.jsonl:1"}],
                                                                [{"text": "y", "source": "b.jsonl:1"}]])
    with pytest.raises(UsageError, match=r"sampled_by_group names \['a.jsonl'\].*the groups are \['b.jsonl'\]"):
        responses.run(cfg, load=lambda: pytest.fail("loaded the target"), force=True)


def test_a_child_config_replaces_its_parents_sampled_by_group_whole(tmp_path):
    import json
    from training.config import load_config
    (tmp_path / "p.json").write_text(json.dumps({"target": "t", "models": {"d": {}},
                                                 "responses": {"sampled_by_group": {"a.jsonl": 2}}}))
    for over, want in (({}, {}), ({"b.jsonl": 3}, {"b.jsonl": 3})):
        (tmp_path / "c.json").write_text(json.dumps({"extends": str(tmp_path / "p.json"),
                                                     "responses": {"sampled_by_group": over}}))
        assert load_config(str(tmp_path / "c.json"))["responses"]["sampled_by_group"] == want
