"""A tiny pipeline run (drafter only) then `python -m training.card` on it: the trainer's evaluations are on the
selection set and say so, after training every final model is measured on the whole selection and the whole
held-out set (acceptance.json, each result naming its set), stages.json has each stage's wall time, and card.json
carries the data sizes, stage times, box accounting and both sets' tau, from which the card's Markdown is made.
Guards issue 26 item 7 / issue 27 item 8: before, the card's numbers were typed by hand and no card.json existed."""
import json

import pytest

from training_fixtures import run_cli, tiny_models, write_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("card")
    cfg = write_config(root, tiny_models(heads=False), acceptance={"bench": ["mbpp"], "bench_prompts": 1})
    assert run_cli("all", "--config", cfg, "--workdir", root / "work") == 0
    return root


def test_selection_and_held_out_are_measured_apart(run_dir):
    w = run_dir / "work"
    sel = (w / "prompts" / "selection.jsonl").read_text().splitlines()
    held = (w / "prompts" / "heldout.jsonl").read_text().splitlines()
    assert len(sel) == len(held) == 2 and not set(sel) & set(held)
    evals = json.loads((w / "train" / "drafter" / "manifest.json").read_text())["evals"]
    assert evals and all(e["set"] == "selection" and e["of"] == 2 for e in evals)  # never the held-out set
    acc = json.loads((w / "train" / "drafter" / "acceptance.json").read_text())
    for s in ("selection", "heldout"):
        assert acc[s]["set"] == s and acc[s]["of"] == acc[s]["prompts"] == 2 and acc[s]["tau_drafter"] >= 1.0
    assert acc["dtype"] == "float32" and acc["cuda_graphs"] is False  # acceptance.dtype auto, on the CPU
    stages = json.loads((w / "stages.json").read_text())
    assert set(stages) == {"prompts", "responses", "hidden", "train", "export"}
    assert all(v["seconds"] >= 0 for v in stages.values())


def test_acceptance_by_source_and_on_a_benchmark(run_dir):
    """Each set's tau per prompt source pools that source's steps (so the sources' taus, weighted by their step
    counts, give the set's tau), and acceptance.bench measures the benchmark file's prompts as the protocol renders
    them ("bench:mbpp", the eval row): guards the per-source and benchmark tau of the at-scale run."""
    from training.domains import group_of
    w = run_dir / "work"
    acc = json.loads((w / "train" / "drafter" / "acceptance.json").read_text())
    for s in ("selection", "heldout"):
        rows = [json.loads(x) for x in (w / "prompts" / f"{s}.jsonl").read_text().splitlines()]
        by = acc[s]["by_source"]
        assert sorted(by) == sorted({group_of(r["source"]) for r in rows})
        assert sum(v["prompts"] for v in by.values()) == acc[s]["prompts"]
        assert min(v["tau_drafter"] for v in by.values()) <= acc[s]["tau_drafter"] <= \
            max(v["tau_drafter"] for v in by.values())
    bench = acc["bench:mbpp"]
    assert bench["set"] == "bench:mbpp" and bench["of"] == bench["prompts"] == 1 and bench["tau_drafter"] >= 1.0
    assert "by_source" not in bench


def test_card_json_and_markdown_from_the_run(run_dir, tmp_path):
    pytest.importorskip("matplotlib")
    from training import card
    w = run_dir / "work"
    md = tmp_path / "README.md"
    assert card.main(["--train", str(w / "train"), "--out", str(tmp_path / "rec"), "--markdown", str(md)]) == 0
    rec = json.loads((tmp_path / "rec" / "card.json").read_text())
    prompts = json.loads((w / "prompts" / "manifest.json").read_text())
    responses = json.loads((w / "responses" / "manifest.json").read_text())
    assert rec["data"]["prompts"]["train"] == prompts["train"] and rec["data"]["prompts"]["heldout"] == 2
    assert rec["data"]["prompts"]["sources"] == prompts["sources"]
    assert rec["data"]["responses"]["response_tokens"] == responses["response_tokens"]
    assert rec["data"]["hidden"]["tokens"] > 0
    assert set(rec["stages"]) == {"prompts", "responses", "hidden", "train", "export"}
    (m,) = rec["models"]
    box = json.loads((w / "train" / "drafter" / "box.json").read_text())
    assert m["box"]["packed_tokens"] == box["packed_tokens"] and set(m["box"]["parts_s"]) == set(box["parts_s"])
    assert [e["steps"] for e in m["box"]["epochs"]] == [e["steps"] for e in box["epochs"]] and box["epochs"]
    acc = json.loads((w / "train" / "drafter" / "acceptance.json").read_text())
    assert m["selection"]["tau_drafter"] == round(acc["selection"]["tau_drafter"], 3)
    assert m["heldout"]["tau_drafter"] == round(acc["heldout"]["tau_drafter"], 3)
    text = md.read_text()
    assert "Packed tokens/s per pass of the training loop" in text  # box.json's epochs reach the card
    assert f"| drafter | held-out | 2 | 2 | {m['heldout']['seconds']} | {m['heldout']['tau_drafter']} |" in text
    assert card.main(["--from-json", str(tmp_path / "rec" / "card.json"), "--markdown", str(tmp_path / "b.md")]) == 0
    assert (tmp_path / "b.md").read_text() == text


def test_time_section_shows_the_taps_cache_only_where_a_box_has_one():
    """A model whose box.json records the online target's cache (train.taps_cache_gib) gets a row of its counts;
    a card with none has no such table."""
    from training.card_md import time_section
    rec = {"budget_gib": 60.0, "kept_gib": 41.2, "sequences": 24000, "refused_sequences": 0,
           "hit_tokens": 20_000_000, "computed_tokens": 10_000_000}
    epochs = [{"steps": 40, "steady_tokens_per_s": 101000.5}, {"steps": 45, "steady_tokens_per_s": 140000.0}]
    models = [{"model": "drafter", "box": {"wall_s": 10, "taps_cache": rec, "epochs": epochs}},
              {"model": "xpress", "box": {}}]
    text = "\n".join(time_section({}, models))
    assert "| drafter | 101000.5 (40), 140000.0 (45) |" in text, text
    assert "The online target's cache" in text
    row = [ln for ln in text.splitlines() if ln.startswith("| drafter") and "24000" in ln]
    assert len(row) == 1 and "20000000" in row[0] and "10000000" in row[0]
    assert "| xpress" not in text.split("The online target's cache")[1]  # no row for a box without one
    assert "online target's cache" not in "\n".join(time_section({}, [models[1]]))


def test_model_record_carries_the_cache_and_a_second_fit(tmp_path):
    """card_data.model_record passes box.json's taps_cache and epochs on, and a plan that a second fit lengthened
    reads as such in the card (it read as a plain "36" before: the first fit's 20 lost). Power: a record built
    from BOX_KEYS alone has neither, and the time section then shows no cache table."""
    from training.card_data import model_record
    from training.card_md import planned, time_section
    cache = {"budget_gib": 1.0, "kept_gib": 0.5, "slabs_gib": 1.0, "sequences": 9, "refused_sequences": 0,
             "stopped_for_memory": False, "hit_tokens": 300, "computed_tokens": 150}
    box = {"parts_s": {"steps": 1.0}, "steps": 36, "epochs": [{"epoch": 0, "first_step": 0, "steps": 12,
                                                               "steady_tokens_per_s": 1000.04}],
           "taps_cache": cache,
           "fit": {"planned_steps": 36, "fitted_steps": 36,
                   "refit": {"probe_steps": [13, 16], "before": 20, "fitted_steps": 36}}}
    (tmp_path / "box.json").write_text(json.dumps(box))
    m = model_record(tmp_path, {"model": "drafter", "steps": 36, "planned_steps": 36})
    assert m["box"]["taps_cache"] == cache and m["box"]["epochs"][0]["steady_tokens_per_s"] == 1000.0
    assert planned(m) == "36 (fitted from 36 to 20, then to 36 by a second fit)"
    assert "The online target's cache" in "\n".join(time_section({}, [m]))
    box["fit"] = {"planned_steps": 36, "fitted_steps": 20,
                  "refit": {"probe_steps": [13, 16], "before": 20, "fitted_steps": 20}}
    (tmp_path / "box.json").write_text(json.dumps(box))
    assert planned(model_record(tmp_path, {"model": "drafter", "steps": 20, "planned_steps": 20})) == \
        "20 (fitted from 36)"
    # the rate probes after the fit shortened it (training/fit.py): after the second fit, before it (in step
    # order, whatever order the record keeps them in), or with none; a second fit that shortened it
    def fit_reads(fit):
        box["fit"] = {"planned_steps": 36, **fit}
        (tmp_path / "box.json").write_text(json.dumps(box))
        return planned(model_record(tmp_path, {"model": "drafter", "planned_steps": fit["fitted_steps"]}))
    by = ", then shortened to {} by the rate probes after the fit"
    assert fit_reads({"fitted_steps": 14, "refit": {"probe_steps": [13, 16], "before": 20, "fitted_steps": 30},
                      "shortened": [{"probe_steps": [21, 24], "before": 30, "fitted_steps": 17},
                                    {"probe_steps": [25, 28], "before": 17, "fitted_steps": 14}]}) == \
        "14 (fitted from 36 to 20, then to 30 by a second fit" + by.format(17) + by.format(14) + ")"
    assert fit_reads({"fitted_steps": 24, "refit": {"probe_steps": [13, 16], "before": 18, "fitted_steps": 24},
                      "shortened": [{"probe_steps": [9, 12], "before": 20, "fitted_steps": 18}]}) == \
        "24 (fitted from 36 to 20" + by.format(18) + ", then to 24 by a second fit)"
    assert fit_reads({"fitted_steps": 14, "shortened": [{"probe_steps": [9, 12], "before": 20, "fitted_steps": 14}]}) \
        == "14 (fitted from 36 to 20" + by.format(14) + ")"
    assert fit_reads({"fitted_steps": 17, "refit": {"probe_steps": [13, 16], "before": 20, "fitted_steps": 17}}) == \
        "17 (fitted from 36 to 20, then to 17 by a second fit)"
    # a card.json written before plan_changes (results/smollm2-135m-v3's): its second fit lengthened the plan
    assert planned({"planned_steps": 36, "planned_before_fit": 40, "first_fit": 20}) == \
        "36 (fitted from 40 to 20, then to 36 by a second fit)"


def test_the_box_table_shows_the_share_of_steps_after_the_compiling_first_step(tmp_path):
    """The continue run's drafter: 437.2 s of steps in a 463.2-s box reads as 94.4% steps, but 93.0 s of them were
    the first step (compiling); the card shows that step and the share without it, (437.2 - 93.0) / 463.2 = 0.743.
    A box.json without first_step_s (written before it was kept) gets neither, not a made-up share."""
    from training.card_data import model_record
    from training.card_md import time_section
    box = {"parts_s": {"steps": 437.2}, "wall_s": 463.2, "steps_share": 0.944, "first_step_s": 92.9883, "steps": 1210}
    (tmp_path / "box.json").write_text(json.dumps(box))
    m = model_record(tmp_path, {"model": "drafter", "steps": 1210})
    assert m["box"]["first_step_s"] == 93.0 and m["box"]["steady_steps_share"] == 0.743
    row = [ln for ln in "\n".join(time_section({}, [m])).splitlines() if ln.startswith("| drafter")][0]
    assert "| 0.944 | 93.0 | 0.743 |" in row, row
    del box["first_step_s"]
    (tmp_path / "box.json").write_text(json.dumps(box))
    m = model_record(tmp_path, {"model": "drafter", "steps": 1210})
    assert "steady_steps_share" not in m["box"] and "first_step_s" not in m["box"]


def test_the_card_shows_a_second_round_of_magpie_prompts_apart_from_the_pool(tmp_path):
    """prompts.more_magpie's round has its own counts in the prompts manifest ("more"); the card printed only the
    pool's, so the continue run's card read as if 9 prompts were dropped for length where its round dropped 5 more
    and 1,138 duplicates. A manifest without a round gets no such line."""
    from training.card_data import data_record
    from training.card_md import data_section
    more = {"round": 1, "generated": 52000, "kept": 50855, "sources": {"magpie:chat": 1},
            "dropped": {"length": 5, "duplicate": 1138, "benchmark_overlap_generated": 2}}
    pm = {"train": 10, "selection": 2, "heldout": 4, "magpie_generated": 8, "dropped": {"length": 9}, "sources": {},
          "more": more}
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "manifest.json").write_text(json.dumps(pm))
    text = "\n".join(data_section(data_record(tmp_path)))
    assert "More Magpie prompts** (round 1" in text and "52000 generated, 50855 kept" in text
    assert "duplicate 1138" in text and "length 9" in text
    del pm["more"]
    (tmp_path / "prompts" / "manifest.json").write_text(json.dumps(pm))
    assert "More Magpie" not in "\n".join(data_section(data_record(tmp_path)))


def test_a_warm_started_drafter_shows_its_start_and_the_paired_gain(tmp_path):
    """train/<model>/acceptance_warm.json (the warm start measured alike) reaches the card: the start's taus and
    the trained drafter's over them, paired over prompts. Records without per-prompt counts say n/a rather than
    an unpaired ratio; a model without a warm start gets no line."""
    from training.card_data import model_record
    from training.card_md import tau_section

    def acc(taus, per_prompt=True):
        pp = {"keys": [f"{i:08x}" for i in range(len(taus))], "tau_drafter": [[int(t * 40), 40] for t in taus]}
        tau = sum(t for t, _ in pp["tau_drafter"]) / (40 * len(taus))
        return {s: {"set": s, "of": len(taus), "prompts": len(taus), "tau_drafter": tau,
                    **({"per_prompt": pp} if per_prompt else {})} for s in ("selection", "heldout")}
    start = [2.0 + 0.015 * i for i in range(64)]
    (tmp_path / "acceptance.json").write_text(json.dumps({"key": "a", **acc([t * 1.05 for t in start])}))
    (tmp_path / "acceptance_warm.json").write_text(json.dumps({"key": "w", "global_step": 3588, **acc(start)}))
    m = model_record(tmp_path, {"model": "drafter"})
    held = [p for p in m["warm_start"]["paired"] if p["set"] == "heldout"][0]
    assert held["prompts"] == 64 and held["ratio"] == pytest.approx(1.05, abs=0.01) and held["ratio_ci95"][0] > 1
    text = "\n".join(tau_section([m], None))
    assert "`drafter` continued a warm start at step 3588" in text and "held-out 1.049x [1.048, 1.05]" in text, text
    (tmp_path / "acceptance_warm.json").write_text(json.dumps({"key": "w", "global_step": 3588,
                                                               **acc(start, per_prompt=False)}))
    m = model_record(tmp_path, {"model": "drafter"})
    assert m["warm_start"]["paired"] == [] and "n/a (records without per-prompt counts)" in \
        "\n".join(tau_section([m], None))
    (tmp_path / "acceptance_warm.json").unlink()
    assert "warm_start" not in model_record(tmp_path, {"model": "drafter"})
