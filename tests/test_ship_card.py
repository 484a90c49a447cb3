"""training.ship (which weights ship, within which limits) and training.card (the model card's records), on
hand-made pipeline folders: no speculators, no model."""
import gzip
import json

import pytest

from core.errors import UsageError
from training import card, ship


def _workdir(root, taus, sizes=None, held=None):
    """A pipeline workdir with export/ and train/ for a drafter, an xPress head and Markov heads of given
    selection-set tau (`held`: their held-out tau, default the same)."""
    models = {"drafter": {"type": "dflash", "num_layers": 3, "block_size": 16},
              "xpress": {"type": "xpress", "num_layers": 3, "block_size": 16, "xpress_rank": 8, "init_from": "drafter"}}
    models.update({n: {"type": "dspark", "num_layers": 3, "block_size": 16, "markov_rank": 8, "init_from": "drafter",
                       "markov_head_type": n.split("_")[1]} for n in taus})
    files = {}
    for n in models:
        d = root / "export" / n
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(b"\0" * (sizes or {}).get(n, 100))
        files[n] = {f.name: f.stat().st_size for f in d.iterdir()}
        t = root / "train" / n
        t.mkdir(parents=True)
        evals = [{"global_step": 5, "set": "selection", "of": 4, "prompts": 2, "tau_drafter": 1.5,
                  **({"tau_markov": (held or taus)[n]} if n in taus else {})}]  # where the old ship looked
        (t / "manifest.json").write_text(json.dumps({"complete": True, "final": "0", "global_step": 5,
                                                     "planned_steps": 9, "truncated": n == "markov_vanilla",
                                                     "evals": evals}))
        acc = {s: {"set": s, "of": 4, "prompts": 4, "tau_drafter": 1.5,
                   **({"tau_markov": (held or taus if s == "heldout" else taus)[n]} if n in taus else {}),
                   "per_prompt": {"keys": ["0", "1", "2", "3"], "tau_drafter": [[6, 4]] * 4}}
               for s in ("selection", "heldout")}
        (t / "acceptance.json").write_text(json.dumps({"key": "k", "final": "0", "global_step": 5, **acc}))
    (root / "export" / "manifest.json").write_text(json.dumps({"models": models, "files": files}))
    return root


def test_ship_takes_the_markov_variant_with_the_best_selection_tau(tmp_path):
    work = _workdir(tmp_path / "w", {"markov_vanilla": 2.10, "markov_gated": 2.15, "markov_rnn": 2.12})
    m = ship.ship(work, tmp_path / "out")
    assert m["shipped"] == {"drafter": "drafter", "xpress": "xpress", "markov": "markov_gated"}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["drafter", "manifest.json", "markov", "xpress"]
    written = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert written["models"]["markov_vanilla"]["truncated"] and written["models"]["markov_rnn"]["selection"][
        "tau_markov"] == 2.12 and written["models"]["markov_rnn"]["heldout"]["set"] == "heldout"
    assert ship.ship(work, tmp_path / "o2", markov="markov_rnn")["shipped"]["markov"] == "markov_rnn"
    # each model lists its own sizes only (a drafter's config carries the heads' defaults, meaningless for it)
    assert "xpress_rank" not in written["models"]["drafter"] and "markov_rank" not in written["models"]["xpress"]
    assert written["models"]["markov_rnn"]["markov_head_type"] == "rnn"


def test_ship_never_chooses_on_held_out_tau(tmp_path):
    """Issue 27 item 8: gated has the better held-out tau but the worse selection tau: vanilla ships, and the
    manifest gives both numbers under their set's name. (The old ship chose on the held-out number.)"""
    work = _workdir(tmp_path / "w", {"markov_vanilla": 2.20, "markov_gated": 2.10},
                    held={"markov_vanilla": 2.00, "markov_gated": 2.50})
    m = ship.ship(work, tmp_path / "out")
    assert m["shipped"]["markov"] == "markov_vanilla" and "selection-set" in m["markov_choice"]
    assert m["models"]["markov_gated"]["heldout"]["tau_markov"] == 2.50
    assert m["models"]["markov_gated"]["selection"]["tau_markov"] == 2.10
    (work / "train" / "markov_gated" / "acceptance.json").unlink()
    with pytest.raises(UsageError, match="no selection/held-out acceptance"):
        ship.ship(work, tmp_path / "o2")


def test_ship_takes_the_xpress_recipe_with_the_best_selection_tau_at_k1(tmp_path):
    """A heads run that trains xPress recipes side by side (e.g. consistency weights): the one with the best
    selection-set tau at K=1 ships, never the held-out one; --xpress names one instead. One xPress model ships as
    before, its manifest unchanged (no xpress_choice)."""
    import shutil
    work = _workdir(tmp_path / "w", {"markov_gated": 2.0})
    assert "xpress_choice" not in ship.ship(work, tmp_path / "o0")
    em = json.loads((work / "export" / "manifest.json").read_text())
    for name, sel, held in (("xpress", 2.30, 2.60), ("xpress_cw1", 2.40, 2.20), ("xpress_lr3", 2.35, 2.70)):
        if name != "xpress":
            shutil.copytree(work / "export" / "xpress", work / "export" / name)
            shutil.copytree(work / "train" / "xpress", work / "train" / name)
            em["models"][name], em["files"][name] = em["models"]["xpress"], em["files"]["xpress"]
        acc = work / "train" / name / "acceptance.json"
        a = json.loads(acc.read_text())
        a["selection"]["tau_xpress_K1"], a["heldout"]["tau_xpress_K1"] = sel, held
        acc.write_text(json.dumps(a))
    (work / "export" / "manifest.json").write_text(json.dumps(em))
    m = ship.ship(work, tmp_path / "o1")
    assert m["shipped"]["xpress"] == "xpress_cw1" and "selection-set tau_xpress_K1" in m["xpress_choice"]
    assert m["models"]["xpress_lr3"]["heldout"]["tau_xpress_K1"] == 2.70  # reported, not chosen on
    assert ship.ship(work, tmp_path / "o2", xpress="xpress_lr3")["shipped"]["xpress"] == "xpress_lr3"
    with pytest.raises(UsageError, match="--xpress markov_gated: not a trained xPress model"):
        ship.ship(work, tmp_path / "o3", xpress="markov_gated")


def test_ship_refuses_over_budget_and_leaves_nothing(tmp_path, capsys):
    work = _workdir(tmp_path / "w", {"markov_gated": 2.0}, sizes={"drafter": 40_000, "xpress": 30_000})
    assert ship.main(["--workdir", str(work), "--out", str(tmp_path / "out"), "--max-mb", "0.05"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "over --max-mb 0.05" in err[0]
    assert not (tmp_path / "out").exists()
    assert ship.main(["--workdir", str(work), "--out", str(tmp_path / "out"), "--markov", "nope"]) == 2
    assert "not a trained Markov model" in capsys.readouterr().err


def test_ship_never_replaces_the_workdir_or_a_folder_it_did_not_write(tmp_path, capsys):
    """ship replaces --out whole: the workdir (or a folder holding it, or one of its stages), and an existing folder
    that is not an earlier ship's output, are refused and left as they were; an earlier ship's folder keeps its
    other files (the shipped weights' README.md, CARD.md); a head given as --drafter is refused."""
    work = _workdir(tmp_path / "w", {"markov_gated": 2.0})
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for out in (work, tmp_path, work / "export"):
        assert ship.main(["--workdir", str(work), "--out", str(out)]) == 2
        assert "would replace the workdir" in capsys.readouterr().err
    other = tmp_path / "results"
    other.mkdir()
    (other / "run1.json").write_text("{}")
    assert ship.main(["--workdir", str(work), "--out", str(other)]) == 2
    assert "exists and is not an earlier ship's output" in capsys.readouterr().err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "results" not in p.parts) == before
    assert (other / "run1.json").is_file()
    out = tmp_path / "weights"
    ship.ship(work, out)
    (out / "README.md").write_text("the weights' card")
    ship.ship(work, out)  # again, over its own output
    assert (out / "README.md").read_text() == "the weights' card" and (out / "drafter").is_dir()
    assert "kept README.md" in capsys.readouterr().out
    with pytest.raises(UsageError, match="--drafter xpress is a xpress model; give the run's dflash drafter"):
        ship.ship(work, tmp_path / "o9", drafter="xpress")


def test_card_summarises_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    d = tmp_path / "train" / "drafter"
    d.mkdir(parents=True)
    rows = [{"train": {"loss": 2.0 - 0.01 * s}, "profile": {"step_ms": 9000.0 if s == 0 else 30.0},
             "global_step": s} for s in range(60)]
    rows.insert(30, {"val": {"loss_epoch": 1.5}, "epoch": 0})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "manifest.json").write_text(json.dumps({"planned_steps": 60, "truncated": False,
                                                 "evals": [{"tau_drafter": 1.7}]}))
    out = card.build(tmp_path / "train", tmp_path / "card")["models"][0]
    assert json.loads((tmp_path / "card" / "card.json").read_text())["models"][0]["box"] is None  # no box.json
    assert out["steps"] == 60 and out["first_step_s"] == 9.0 and out["median_step_ms"] == 30.0
    assert out["val_loss_per_epoch"] == [1.5] and out["last_training_eval"] == {"tau_drafter": 1.7}
    assert out["last_loss_mean25"] == pytest.approx(2.0 - 0.01 * 47)  # the mean of steps 35..59
    assert (tmp_path / "card" / "loss_curves.png").stat().st_size > 1000
    back = gzip.decompress((tmp_path / "card" / "drafter.metrics.jsonl.gz").read_bytes()).decode().splitlines()
    assert [json.loads(x) for x in back] == rows


def _numbers(obj):
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return []
    if isinstance(obj, (int, float)):
        return [obj]
    items = obj.values() if isinstance(obj, dict) else obj
    return [x for v in items for x in _numbers(v)]


def test_card_markdown_gives_every_number_of_card_json():
    """Every number in a constructed card.json appears in the generated Markdown exactly as written there (none
    typed by hand into the card), each in its row."""
    import re
    from training.card_md import render
    box = {"wall_s": 481.7, "train_wall_s": 470.2, "unaccounted_s": 0.3, "steps_share": 0.912, "steps_per_s": 3.41,
           "packed_tokens": 1523311, "loss_tokens": 1200007, "tokens_per_s": 3482.6, "box_s": 480.0,
           "parts_s": {"startup": 12.5, "steps": 438.9, "validation": 4.4, "held_out": 11.8, "checkpoints": 2.1,
                       "finish": 0.2, "export": 11.5}}
    tau = {"selection": {"of": 32, "prompts": 31, "tau_drafter": 2.054, "tau_markov": 2.135, "seconds": 17.2},
           "heldout": {"of": 64, "prompts": 64, "tau_drafter": 2.061, "tau_markov": 2.142, "seconds": 33.9}}
    rec = {"title": "SmolLM2-135M", "stages": {"prompts": {"seconds": 13.4}, "responses": {"seconds": 237.1},
                                               "train": {"seconds": 612.8}},
           "data": {"prompts": {"train": 2528, "selection": 32, "heldout": 64, "magpie_generated": 1024,
                                "dropped": {"length": 7, "duplicate": 19, "benchmark_overlap_generated": 3},
                                "sources": {"train": {"gsm8k.jsonl": 1539, "magpie:code": 291},
                                            "selection": {"gsm8k.jsonl": 20, "magpie:code": 12},
                                            "heldout": {"gsm8k.jsonl": 41, "magpie:code": 23}}},
                    "responses": {"sequences": 5056, "response_tokens": 1012345, "prompt_tokens": 431234},
                    "hidden": {"sequences": 5056, "tokens": 1443579, "mode": "online", "dtype": "bfloat16",
                               "layer_ids": [2, 15, 27]}},
           "models": [{"model": "markov_gated", "steps": 696, "planned_steps": 700, "truncated": True,
                       "first_loss": 0.5710, "last_loss_mean25": 0.4419, "val_loss_per_epoch": [0.4618, 0.4587],
                       "median_step_ms": 27.1, "box": box, **tau}],
           "shipped": {"drafter": "drafter", "xpress": "xpress", "markov": "markov_gated", "total_mb": 55.2,
                       "markov_choice": "best selection-set tau_markov"}}
    text = render(rec)
    for v in _numbers(rec):
        assert re.search(rf"(?<![\d.]){re.escape(str(v))}(?![\d])", text), v
    assert "| markov_gated | held-out | 64 | 64 | 33.9 | 2.061 | 2.142 |" in text
    assert "| markov_gated | selection | 31 | 32 | 17.2 | 2.054 | 2.135 |" in text
    assert "| magpie:code | 291 | 12 | 23 |" in text and "55.2 MB" in text


def test_the_ship_manifest_leaves_the_per_prompt_counts_in_the_run(tmp_path):
    """acceptance.json's per_prompt (training/compare_tau.py reads it there) is not copied into the shipped
    manifest, whose sets keep their taus and counts."""
    work = _workdir(tmp_path / "w", {"markov_gated": 2.0})
    models = ship.tried(work)
    for m in models.values():
        for s in ("selection", "heldout"):
            assert "per_prompt" not in m[s] and m[s]["tau_drafter"] == 1.5 and m[s]["prompts"] == 4


def test_an_acceptance_record_without_per_prompt_counts_is_measured_again():
    """training/evaluate.py keeps an acceptance.json only when its key matches and every set has per_prompt: one
    written before the counts were kept is measured again, so it can be paired."""
    from training.evaluate import kept
    rec = {"key": "k", "final": "0", "heldout": {"prompts": 2, "per_prompt": {}}, "selection": {"prompts": 2,
                                                                                               "per_prompt": {}}}
    assert kept(rec, "k") and not kept(rec, "other")
    del rec["selection"]["per_prompt"]
    assert not kept(rec, "k")


def test_card_refuses_a_bad_ship_or_json_before_writing(tmp_path, capsys):
    """A --ship that is not ship's output is refused before any record is written; --from-json of a file that is
    not a card.json (e.g. a run's summary.json) is one error line, not a traceback."""
    work = _workdir(tmp_path / "w", {"markov_gated": 2.0})
    out = tmp_path / "records"
    assert card.main(["--train", str(work / "train"), "--out", str(out), "--ship", str(tmp_path / "nope")]) == 2
    assert "is not training.ship's manifest" in capsys.readouterr().err and not out.exists()
    bad = tmp_path / "summary.json"
    bad.write_text("[1, 2]")
    assert card.main(["--from-json", str(bad), "--markdown", str(tmp_path / "c.md")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a card.json" in err[0] and not (tmp_path / "c.md").exists()
