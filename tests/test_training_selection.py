"""Stage 1's three-way split (train / selection / held-out: disjoint, stratified over the sources) and Magpie
steered by domains on the tiny target (each domain's share of the generated prompts, its seed words fed to the
target, its name in every prompt's source). Guards issue 26 items 4 and 6 and issue 27 item 8: before, one
held-out set of 16 both reported tau and chose, drawn unstratified, and Magpie used the bare user-turn prefix."""
import json

import pytest

from core.errors import UsageError
from training.domains import group_counts, largest_remainder, magpie_plan, split


def _rows(sizes: dict) -> list[dict]:
    return [{"text": f"{g} prompt {i}", "source": f"{g}:{i}"} for g, n in sizes.items() for i in range(n)]


def test_split_is_disjoint_stratified_and_every_prefix_is_too():
    rows = _rows({"gsm8k.jsonl": 60, "magpie:code": 30, "magpie:math": 10})
    train, sel, held = split(rows, heldout=20, selection=10, seed=3)
    texts = [[r["text"] for r in part] for part in (train, sel, held)]
    assert sum(map(len, texts)) == len(rows) == len(set().union(*map(set, texts)))  # disjoint, nothing lost
    assert group_counts(held) == {"gsm8k.jsonl": 12, "magpie:code": 6, "magpie:math": 2}  # 20 in proportion
    assert group_counts(sel) == {"gsm8k.jsonl": 6, "magpie:code": 3, "magpie:math": 1}
    assert [r["source"] for r in train] == [r["source"] for r in rows if r in train]  # train keeps file order
    assert group_counts(held[:10]) == {"gsm8k.jsonl": 6, "magpie:code": 3, "magpie:math": 1}  # interleaved
    assert split(rows, 20, 10, 3) == (train, sel, held) and split(rows, 20, 10, 4)[2] != held  # seeded
    with pytest.raises(UsageError, match="need more than prompts.heldout"):
        split(rows, 60, 40, 0)


def test_domain_shares_and_validation(tmp_path):
    from training.config import load_config
    assert largest_remainder(10, [0.4, 0.3, 0.3]) == [4, 3, 3] and largest_remainder(7, [1, 1, 1]) == [3, 2, 2]
    pc = {"magpie": 9, "magpie_domains": [{"name": "code", "share": 2, "seeds": ["Write"]},
                                          {"name": "math", "share": 1}]}
    assert [(d["name"], d["count"], d["source"]) for d in magpie_plan(pc)] == [("code", 6, "magpie:code"),
                                                                                 ("math", 3, "magpie:math")]
    assert magpie_plan({"magpie": 5, "magpie_domains": []})[0]["source"] == "magpie"  # unsteered: as before
    gpu = load_config("smollm2-gpu")["prompts"]
    assert gpu["heldout"] >= 64 and gpu["selection"] >= 32 and [d["name"] for d in gpu["magpie_domains"]] == \
        ["chat", "code", "math"]
    path = tmp_path / "c.json"
    for bad, msg in (({"magpie_domains": [{"name": "a", "share": 0}]}, "share must be a number > 0"),
                     ({"magpie_domains": [{"name": "a", "share": 1, "seed": "x"}]}, "expected an object"),
                     ({"magpie_domains": [{"name": "a", "share": 1}, {"name": "a", "share": 1}]}, "unique"),
                     ({"selection": 0}, "prompts.selection must be an integer >= 1")):
        path.write_text(json.dumps({"target": "t", "models": {"d": {}}, "prompts": bad}))
        with pytest.raises(UsageError, match=msg):
            load_config(str(path))


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_magpie_domains_on_the_tiny_target(tmp_path, monkeypatch, engine):
    """prompts.run on the tiny target: 5 code + 3 math prompts generated (shares 5:3 of 8), each code prompt fed
    the chat template's system turn and user-turn prefix followed by a code seed, written by the target, and
    recorded as magpie:<domain>:i; the split is stratified over the JSONL file and both domains. Both engines:
    the fast one (responses.engine's default; HF generate wrote Magpie prompts at 7.7k tokens/s before) and HF."""
    import training.gen
    from tiny import save_tiny_checkpoint
    from training import prompts
    from training.config import load_config
    from training.target import load_hf
    save_tiny_checkpoint(tmp_path / "target")
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} times {a + 3} plus seven?"}) + "\n"
                            for a in range(12)))
    (tmp_path / "eval").mkdir()
    doms = [{"name": "code", "share": 5, "seeds": ["Write a Python function", "Implement"], "system": "CODE"},
            {"name": "math", "share": 3, "seeds": ["Solve:"]}]
    (tmp_path / "c.json").write_text(json.dumps({
        "target": str(tmp_path / "target"), "models": {"d": {}},
        "prompts": {"jsonl": [str(data)], "magpie": 8, "magpie_batch": 4, "magpie_max_new_tokens": 8,
                    "min_chars": 4, "dedup_jaccard": 1.1, "heldout": 4, "selection": 4, "magpie_domains": doms,
                    "eval_dir": str(tmp_path / "eval")}, "responses": {"engine": engine}}))
    cfg = load_config(str(tmp_path / "c.json"), workdir=str(tmp_path / "work"))
    fed, calls = [], []

    def spy(name, real):
        def run(m, p, *a, **k):
            calls.append(name)
            fed.extend(p)
            return real(m, p, *a, **k)
        return run
    for name in ("generate_batch", "generate_fast"):
        monkeypatch.setattr(training.gen, name, spy(name, getattr(training.gen, name)))
    hf = load_hf(cfg["target"], __import__("torch").device("cpu"))
    out = prompts.run(cfg, load=lambda: hf)
    tok = hf[1]
    seen = [tok.decode(p) for p in fed]
    assert set(calls) == {{"fast": "generate_fast", "hf": "generate_batch"}[engine]}
    assert len(seen) == 8 and all(s.startswith("<|system|>CODE<eot><|user|>") for s in seen[:5])
    assert [s.split("<|user|>")[1] for s in seen] == ["Write a Python function", "Implement"] * 2 + \
        ["Write a Python function"] + ["Solve:"] * 3
    m = json.loads((out / "manifest.json").read_text())
    assert m["magpie_generated"] == 8 and m["magpie_domains"] == {"magpie:code": 5, "magpie:math": 3}
    rows = {s: [json.loads(x) for x in (out / f"{s}.jsonl").read_text().splitlines()]
            for s in ("train", "selection", "heldout")}
    magpie = [r for part in rows.values() for r in part if r["source"].startswith("magpie:")]
    assert len(magpie) == 8 and all(r["text"].startswith(("Write a Python function", "Implement"))
                                    for r in magpie if r["source"].startswith("magpie:code:"))
    assert all(r["text"].startswith("Solve:") for r in magpie if r["source"].startswith("magpie:math:"))
    # 20 prompts: 12 from the file, 5 code, 3 math; 4 held out (2/1/1) and 4 for selection, each group within 1
    # of its proportional share
    assert m["sources"]["heldout"] == {"q.jsonl": 2, "magpie:code": 1, "magpie:math": 1} == group_counts(rows["heldout"])
    assert m["sources"]["selection"] == group_counts(rows["selection"])
    for g, n in {"q.jsonl": 12, "magpie:code": 5, "magpie:math": 3}.items():
        assert abs(m["sources"]["selection"].get(g, 0) - 4 * n / 20) < 1, g
    assert not {r["text"] for r in rows["selection"]} & {r["text"] for r in rows["heldout"]}


def test_more_prompts_extend_the_pool_without_moving_its_split_or_parts(tmp_path):
    """prompts.more_magpie (issue 26, data at scale): more Magpie prompts after the pool is split, in more.jsonl,
    never duplicating a pool prompt; the pool's train/selection/held-out files, its stage key and its response
    parts are exactly those of a run without them, and the new prompts come as parts after the pool's. Another
    round draws other prompts."""
    from tiny import save_tiny_checkpoint
    from training import prompts, responses
    from training.config import load_config
    from training.domains import group_of
    from training.target import load_hf
    save_tiny_checkpoint(tmp_path / "target")
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} times {a + 3} plus seven?"}) + "\n"
                            for a in range(12)))
    (tmp_path / "eval").mkdir()
    doms = [{"name": "code", "share": 5, "seeds": ["Write a Python function"]}, {"name": "math", "share": 3}]
    base = {"target": str(tmp_path / "target"), "models": {"d": {}},
            "prompts": {"jsonl": [str(data)], "magpie": 8, "magpie_batch": 4, "magpie_max_new_tokens": 8,
                        "min_chars": 4, "dedup_jaccard": 1.1, "heldout": 4, "selection": 4, "magpie_domains": doms,
                        "eval_dir": str(tmp_path / "eval")}}
    hf = load_hf(str(tmp_path / "target"), __import__("torch").device("cpu"))
    cfgs, outs = {}, {}
    for name, more in (("pool", {}), ("r1", {"more_magpie": 6}), ("r2", {"more_magpie": 6, "more_round": 2})):
        c = json.loads(json.dumps(base))
        c["prompts"].update(more)
        (tmp_path / f"{name}.json").write_text(json.dumps(c))
        cfgs[name] = load_config(str(tmp_path / f"{name}.json"), workdir=str(tmp_path / name))
        outs[name] = prompts.run(cfgs[name], load=lambda: hf)
    for f in ("train.jsonl", "selection.jsonl", "heldout.jsonl"):
        assert (outs["r1"] / f).read_bytes() == (outs["pool"] / f).read_bytes() == (outs["r2"] / f).read_bytes()
    assert not (outs["pool"] / "more.jsonl").exists()
    old_style = dict(cfgs["pool"], prompts={k: v for k, v in cfgs["pool"]["prompts"].items()
                                            if not k.startswith("more_")})
    assert prompts.stage_key(cfgs["pool"], []) == prompts.stage_key(old_style, []) != prompts.stage_key(cfgs["r1"], [])
    read = lambda p: [json.loads(x) for x in p.read_text().splitlines()]  # noqa: E731
    pool = {r["text"] for f in ("train", "selection", "heldout") for r in read(outs["pool"] / f"{f}.jsonl")}
    more1, more2 = read(outs["r1"] / "more.jsonl"), read(outs["r2"] / "more.jsonl")
    m = json.loads((outs["r1"] / "manifest.json").read_text())["more"]
    assert m["round"] == 1 and m["generated"] == 6 and m["kept"] == len(more1) > 0
    assert m["kept"] + m["dropped"]["duplicate"] + m["dropped"]["length"] + \
        m["dropped"]["benchmark_overlap_generated"] == 6
    assert all(r["source"].split(":")[2].startswith("r1.") for r in more1)
    assert {group_of(r["source"]) for r in more1} <= {"magpie:code", "magpie:math"}
    assert not {r["text"] for r in more1} & pool and {r["text"] for r in more1} != {r["text"] for r in more2}
    with_more, without = responses.prompt_parts(cfgs["r1"]), responses.prompt_parts(cfgs["pool"])
    assert with_more[:len(without)] == without and \
        sorted(r["text"] for g in with_more[len(without):] for r in g) == sorted(r["text"] for r in more1)
    for bad in ({"more_magpie": -1}, {"more_round": 0}):
        c = json.loads(json.dumps(base))
        c["prompts"].update(bad)
        (tmp_path / "bad.json").write_text(json.dumps(c))
        with pytest.raises(UsageError, match=f"prompts.{next(iter(bad))} must be an integer"):
            load_config(str(tmp_path / "bad.json"), workdir=str(tmp_path / "bad"))


def test_filter_rows_drops_near_duplicates_of_the_pool_too():
    """filter_rows(rows, cfg, pool): more prompts that near-duplicate a pool prompt are dropped like duplicates of
    each other (what keeps more_magpie's prompts fresh); without a pool it filters as before."""
    from training.prompts import filter_rows
    cfg = {"prompts": {"ngram": 3, "dedup_jaccard": 0.8, "min_chars": 4, "max_chars": 200}}
    pool = [{"text": "Write a function that sorts a list of numbers in place", "source": "magpie:code:1"}]
    rows = [{"text": "Write a function that sorts a list of numbers in place", "source": "magpie:code:r1.0"},
            {"text": "Explain why the sky looks blue during the day", "source": "magpie:chat:r1.1"},
            {"text": "Explain why the sky looks blue during the day", "source": "magpie:chat:r1.2"},
            {"text": "Hi", "source": "magpie:chat:r1.3"}]
    kept, dropped = filter_rows(rows, cfg, pool)
    assert [r["source"] for r in kept] == ["magpie:chat:r1.1"] and dropped == {"length": 1, "duplicate": 2}
    kept, dropped = filter_rows(rows, cfg)
    assert [r["source"] for r in kept] == ["magpie:code:r1.0", "magpie:chat:r1.1"] and dropped["duplicate"] == 1


def test_more_prompts_never_copy_a_templated_pool_prompt_and_take_the_templates(tmp_path, monkeypatch):
    """The pool's prompts are templated after the filters compared their bare text (prompts.templates); a more
    round compares its prompts with that bare text too, so a copy of a templated selection or held-out prompt is
    dropped (compared with the templated text it passed: the review's case), and its own prompts take the
    templates as the pool's do."""
    from training import prompts
    from training.config import load_config
    pool_texts = [f"Solve: a train leaves station {k} at noon and travels far" for k in range(10)] + \
                 [f"Write a Python function number {k} that merges two sorted lists" for k in range(10)]
    fresh = ["Solve: how many legs do three spiders and two ants have", "Write a Python class for a bank account"]

    def fake(cfg, model, tokenizer):
        more = cfg["seed"] != 0
        texts = pool_texts[:2] + fresh if more else pool_texts
        return [{"text": t, "source": f"magpie:{'math' if t.startswith('Solve') else 'code'}:{i}"}
                for i, t in enumerate(texts)]
    monkeypatch.setattr(prompts, "magpie_prompts", fake)
    (tmp_path / "eval").mkdir()
    (tmp_path / "c.json").write_text(json.dumps({
        "target": str(tmp_path / "target"), "models": {"d": {}},
        "prompts": {"magpie": 20, "more_magpie": 4, "min_chars": 4, "heldout": 4, "selection": 4,
                    "eval_dir": str(tmp_path / "eval"),
                    "templates": [{"sources": ["magpie:math"], "suffix": " Put the answer in a box."}]},
        "responses": {"engine": "hf"}}))
    cfg = load_config(str(tmp_path / "c.json"), workdir=str(tmp_path / "work"))
    out = prompts.run(cfg, load=lambda: (None, None))
    read = lambda f: [json.loads(x) for x in (out / f).read_text().splitlines()]  # noqa: E731
    pool = [r for f in ("train.jsonl", "selection.jsonl", "heldout.jsonl") for r in read(f)]
    assert all(r["text"].endswith(" Put the answer in a box.") for r in pool if r["source"].startswith("magpie:math"))
    more = read("more.jsonl")
    assert sorted(r["text"] for r in more) == sorted(
        [fresh[1], fresh[0] + " Put the answer in a box."])  # the two copies dropped, the new math one templated
    m = json.loads((out / "manifest.json").read_text())["more"]
    assert m["dropped"]["duplicate"] == 2 and m["kept"] == 2
