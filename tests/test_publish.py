"""Numbers you can publish: the primary speedup and its own CI, flagged AR rounds, K chosen on held-out
rounds, tau when drafts are sampled at T=0, labels wherever a reader looks, the merged table's refusals."""
import json

import numpy as np
import pytest

from harness.protocol import metrics, report, tables
from test_report import TOKENS, example, fake_folder, row


def paired_rows(ar_seconds_by_round, speedup):
    """Warmup round 1, then measured rounds; AR's seconds per 100 tokens vary by round, drafter-only's do not."""
    rows = []
    for rnd, ar_s in enumerate(ar_seconds_by_round, start=1):
        for arm, base in (("AR", ar_s), ("drafter-only", 1 / speedup)):
            rows += [row(arm, q, rnd, base * TOKENS[q] / 100, accept=None if arm == "AR" else [2]) for q in range(3)]
    return rows


def test_one_slow_ar_round_does_not_swing_the_primary_statistic():
    """The issue's case: identical outputs, one slow AR round. The mean of per-round ratios doubles; the median
    over rounds does not move, and its CI (its own: the same statistic on bootstrap draws) contains it."""
    rows = paired_rows([1.0, 1.0, 1.0, 3.0, 1.0], speedup=0.95)  # round 4's AR ran 3x slower
    s = report.summarize(rows, n_boot=400)
    sp = s["arms"]["drafter-only"]["speedup"]
    assert sp["mean"] == pytest.approx((3 * 0.95 + 3 * 0.95) / 4)  # 1.425: swung by one round
    assert sp["value"] == pytest.approx(0.95)
    lo, hi = sp["ci95"]
    assert lo <= sp["value"] <= hi and lo == pytest.approx(0.95)
    assert [f["round"] for f in s["ar_rounds_off_median"]] == [4]
    text = report.format_console_table(s, "toy")
    assert "FLAGGED: AR round 4" in text and "0.950 [0.95, " in text


def test_the_bootstrap_resamples_rounds_and_prompts():
    rng = np.random.default_rng(0)
    tok = np.full((4, 5), 100.0)
    ar_s = np.ones((4, 5))
    # prompts agree, rounds differ: only resampling rounds can put that noise inside the interval
    spec_s = ar_s / np.array([1.8, 2.0, 2.2, 2.4])[:, None]
    lo, hi = metrics.median_round_speedup_ci(tok, spec_s, tok, ar_s, n_boot=500)
    assert lo <= 2.0 and hi >= 2.2 and hi - lo > 0.3
    # rounds agree, prompts differ: resampling prompts must widen it
    spec_s = ar_s / (1.5 + rng.random((1, 5)))
    lo, hi = metrics.median_round_speedup_ci(tok, spec_s, tok, ar_s, n_boot=500)
    assert hi - lo > 0.05
    # median 100.5: 89 and 112 are 11.4% off, 101 and 100 are not
    assert metrics.off_median_rounds([100, 101, 89, 112]) == [(2, pytest.approx(11.5 / 100.5)),
                                                               (3, pytest.approx(11.5 / 100.5))]


def test_one_measured_round_prints_1_round_not_a_zero_spread():
    rows = [r for r in example() if r["round"] in (1, 2)]
    text = report.format_console_table(report.summarize(rows, n_boot=50), "toy")
    assert "(1 round)" in text and "+-0.000" not in text and "+-0.0 " not in text


def sweep_rows(warm_fast, measured_fast):
    speeds = {"AR": 1.0, "xPress(K=4)": 4.0, "xPress(K=6)": 4.0}
    rows = []
    for rnd in (1, 2, 3):
        fast = warm_fast if rnd == 1 else measured_fast
        for arm, f in speeds.items():
            f *= 1.1 if arm == fast else 1.0
            rows += [row(arm, q, rnd, TOKENS[q] / (100 * f), accept=None if arm == "AR" else [2]) for q in range(3)]
    return rows


def test_throughput_optimal_k_is_chosen_on_held_out_rounds():
    """The measured rounds favour K=6 (the reported ones); the warmup round, held out, favours K=4: K=4 is the
    choice, and its number comes from the measured rounds. Choosing on the reported rounds would pick the arm
    whose noise was luckiest there, which biases its number upward."""
    s = report.summarize(sweep_rows("xPress(K=4)", "xPress(K=6)"), n_boot=50)
    o = s["optimal"]["xpress"]
    assert o["arm"] == "xPress(K=4)" and "warmup" in o["selected_on"]
    assert o["pooled_tok_s"] == pytest.approx(s["arms"]["xPress(K=4)"]["pooled_tok_s"]["mean"])
    # no warmup round: selected on the measured rounds, and the summary says it is biased
    rows = [dict(r, warmup=False) for r in sweep_rows("xPress(K=4)", "xPress(K=6)") if r["round"] > 1]
    o = report.summarize(rows, n_boot=50)["optimal"]["xpress"]
    assert o["arm"] == "xPress(K=6)" and "biased upward" in o["selected_on"]
    assert "held out" in report.conventions()["optimal"]


def test_tau_at_t0_with_sampled_drafts_is_the_mean_over_rounds():
    """Sampled drafts make every round a replicate, the warmup round included (issue 27)."""
    rows = [dict(r, draft_temperature=0.8) for r in example()]
    xp = report.summarize(rows, n_boot=50)["arms"]["xPress(K=6)"]
    assert xp["tau_per_step"] == pytest.approx((4.0 + 16 / 6 + 1.0) / 3) and "Td=" in xp["tau_source"]
    # drafts greedy (or the field absent, as in older rows): from the first measured round
    rows = [dict(r, draft_temperature=0.0) for r in example()]
    assert report.summarize(rows, n_boot=50)["arms"]["xPress(K=6)"]["tau_per_step"] == pytest.approx(16 / 6)


def test_scripted_acceptance_on_real_weights_claims_no_random_weights():
    """--scripted-accept on a real model is labelled scripted acceptance, not random weights."""
    assert report.config_labels({"model_name_or_path": "m", "scripted_accept": 3}) == ["scripted acceptance"]
    assert report.config_labels({"random_weights": "tiny", "scripted_accept": 3}) == [
        "random weights / scripted acceptance"]


def test_labels_in_tables_csv_and_plot_titles(tmp_path, monkeypatch):
    labels = report.config_labels({"random_weights": "tiny", "trace": "t.jsonl", "compat_reference": True})
    assert labels == ["random weights", "traced (steps replayed untimed)",
                      "compat (the reference's accounting)"]
    s = report.summarize(example(), n_boot=50, labels=labels)
    assert tables.run_labels(s) == labels
    assert all(x in tables.format_markdown_table(s, "toy").splitlines()[0] for x in labels)
    assert tables.run_labels({"label": "old"}) == ["old"]  # summaries from before the list
    titles = []
    from matplotlib.axes import Axes
    monkeypatch.setattr(Axes, "set_title", lambda self, t, *a, **k: titles.append(t))
    from harness.protocol.plots import write_plots
    assert write_plots(tmp_path, s, "toy", None)
    assert titles and all("; ".join(labels) in t for t in titles)
    # an AR round table.md flags as timing noise is flagged on every plot too (math500 at T=1, 2026-12-06: the
    # table said so, its plots did not)
    for off, says in (([{"round": 3, "pooled_tok_s": 50.0, "off_median": 0.31}], "FLAGGED: AR round 3 31% off"),
                      ([], None)):
        titles.clear()
        assert write_plots(tmp_path, {**s, "ar_rounds_off_median": off}, "toy", None)
        assert titles and all((says in t) if says else ("FLAGGED" not in t) for t in titles)


def test_merged_table_labels_and_refuses_a_dataset_twice(tmp_path, capsys):
    a = fake_folder(tmp_path, "a", "gsm8k", (4.0, 6.0), (6.0, 8.0), {6: (7.0, 9.0, 1.7)}, 6,
                    labels=["random weights / scripted acceptance"])
    b = fake_folder(tmp_path, "b", "gsm8k", (4.0, 6.0), (6.0, 8.0), {6: (7.0, 9.0, 1.7)}, 6,
                    labels=["random weights / scripted acceptance"])  # one group with a: a dataset twice
    assert report.main([a]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith("### model=")  # the group's header, also for one group
    assert "| random weights / scripted acceptance |" in text.splitlines()[4]
    assert "**Labelled: random weights / scripted acceptance**" in text
    assert report.main([a, b]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "both gsm8k at T=0" in err and err.count("\n") == 1


def test_rebuild_labels_a_folder_from_its_samples(tmp_path, capsys):
    folder = tmp_path / "run"
    config = {"dataset": "toy", "random_weights": "qwen3-8b", "scripted_accept": 6}
    report.write_results(folder, config, {}, example(), report.summarize(example(), n_boot=50))
    assert "random weights" not in (folder / "table.md").read_text()
    assert report.main(["--rebuild", str(folder)]) == 0
    assert "[random weights / scripted acceptance]" in (folder / "table.md").read_text().splitlines()[0]
    assert json.loads((folder / "summary.json").read_text())["labels"] == ["random weights / scripted acceptance"]
    assert "| random weights / scripted acceptance |" in capsys.readouterr().out


def test_rebuild_works_from_samples_and_config_alone(tmp_path, capsys):
    """--help says --rebuild works from samples.jsonl.gz and config.json: an interrupted run (no summary.json) is
    rebuilt, not refused with 'is the run finished?'; a folder without its rows gets one line naming both."""
    folder = tmp_path / "run"
    report.write_results(folder, {"dataset": "toy"}, {}, example(), report.summarize(example(), n_boot=50))
    (folder / "summary.json").unlink()
    assert report.main(["--rebuild", str(folder)]) == 0
    assert "xPress(K=6)" in json.loads((folder / "summary.json").read_text())["arms"]
    capsys.readouterr()
    (folder / "samples.jsonl.gz").unlink()
    assert report.main(["--rebuild", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no samples.jsonl.gz; --rebuild recomputes a run's tables from its " \
        "samples.jsonl.gz (or plain samples.jsonl, or a torchrun run's samples.rank{r}.jsonl) and config.json" \
        in err, err


def test_rebuild_of_an_interrupted_run_keeps_to_its_complete_rounds(tmp_path, capsys, no_plots):
    """--help says an interrupted run is rebuilt from "its complete rounds"; every row was summarised (a round
    holding AR's prompts and one of drafter-only's gave `13.2 (1 round)` rows and a `-+--` one). Now only the
    rounds in which every arm of config.json decoded every prompt (rounds.complete_rounds, as --resume counts
    decodes), as the live report would have had them, and a label says so; with none, one line and nothing written."""
    folder = tmp_path / "run"
    config = {"dataset": "toy", "resolved": {"rounds": 4, "arms": ["AR", "xPress(K=6)"]}}
    rows = example()  # rounds 1 (warmup) to 3, complete; round 4 stopped after AR and one xPress prompt
    partial = [row("AR", q, 4, 0.1) for q in range(3)] + [row("xPress(K=6)", 0, 4, 0.1, accept=[2])]
    report.write_results(folder, config, {}, rows + partial, report.summarize(rows, n_boot=50))
    (folder / "summary.json").unlink()
    assert report.main(["--rebuild", str(folder)]) == 0
    s, live = json.loads((folder / "summary.json").read_text()), report.summarize(rows, n_boot=50)
    assert s["rounds"] == live["rounds"] and s["incomplete_rounds"] == []
    assert [s["arms"][a]["pooled_tok_s"]["values"] for a in live["arms"]] == \
        [live["arms"][a]["pooled_tok_s"]["values"] for a in live["arms"]]
    assert "interrupted: 3 of 4 rounds complete, the rest left out" in s["labels"]
    capsys.readouterr()
    first = [row("AR", q, 1, 0.1, warmup=False) for q in range(3)] + [row("xPress(K=6)", 0, 1, 0.1, warmup=False)]
    report.write_results(folder, config, {}, first, s)  # the finding's folder: round 1 measured, unfinished
    (folder / "summary.json").unlink()
    assert report.main(["--rebuild", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no complete round in its rows" in err and "--resume" in err, err
    assert not (folder / "summary.json").exists()
    # with a good folder first, that refusal still comes before anything is rewritten ("every folder checked
    # before any is rewritten"): the good folder rebuilt A, then failed on B
    good = tmp_path / "good"
    report.write_results(good, {"dataset": "toy2"}, {}, rows, report.summarize(rows, n_boot=50))
    (good / "table.md").write_text("old")
    assert report.main(["--rebuild", str(good), str(folder)]) == 2
    assert (good / "table.md").read_text() == "old"


def test_rebuild_counts_the_prompts_its_run_planned_not_those_its_rows_hold(tmp_path, capsys, no_plots):
    """config.json's resolved.prompt_rows is the run's prompt set. Rows that lack a prompt in every round (a lost
    samples.rank{r}.jsonl; a one-arm run stopped between prompts) made every round complete over the prompts the
    rows held: a table over fewer prompts, unlabelled. Now they leave no complete round, and a row of a prompt the
    run did not plan there is refused; a folder written before runs recorded the plan is read as before."""
    rows, folder = example(), tmp_path / "run"  # question ids 0-2 (dataset rows 10-12), rounds 1-3 complete
    live = report.summarize(rows, n_boot=50)

    def rebuilt(prompt_rows):
        resolved = {"rounds": 3, "arms": ["AR", "xPress(K=6)"]}
        if prompt_rows is not None:
            resolved["prompt_rows"] = prompt_rows
        report.write_results(folder, {"dataset": "toy", "resolved": resolved}, {}, rows, live)
        (folder / "summary.json").unlink()
        code, err = report.main(["--rebuild", str(folder)]), capsys.readouterr().err
        return code, err, json.loads((folder / "summary.json").read_text()) if code == 0 else None

    for prompt_rows in ([10, 11, 12], None):  # the plan the rows hold; no plan recorded (an older folder)
        code, _, s = rebuilt(prompt_rows)
        assert code == 0 and s["rounds"] == live["rounds"] and not any("interrupted" in x for x in s["labels"])
    code, err, _ = rebuilt([10, 11, 12, 13])  # a fourth prompt planned, decoded in no round
    assert code == 2 and err.count("\n") == 1 and "no complete round in its rows" in err, err
    assert not (folder / "summary.json").exists()
    code, err, _ = rebuilt([10, 11, 99])
    assert code == 2 and err.count("\n") == 1 and "a row of question id 2 (dataset row 12) is not the run's: its " \
        "config.json planned dataset row 99 there (resolved.prompt_rows, 3 prompts)" in err, err
    code, err, _ = rebuilt([10, 11])
    assert code == 2 and "a row of question id 2 (dataset row 12) is not the run's: its config.json planned no " \
        "prompt there" in err, err


def test_rebuild_reads_a_torchrun_runs_rows_of_every_rank(tmp_path, capsys, no_plots):
    """A torchrun run stopped before rank 0 merged its rows leaves a samples.rank{r}.jsonl a rank (its prompts
    round-robin); --rebuild said "no samples.jsonl.gz". Now the ranks' rows are read in the merge's order and give
    the tables of all the rows; with a rank's file lost, its prompts leave no complete round (config.json's
    prompt_rows), not tables over the other rank's prompts alone."""
    from harness.protocol import rounds
    from harness.protocol.results_io import read_folder_rows
    rows, folder = example(), tmp_path / "run"
    order = [["AR", "xPress(K=6)"], ["xPress(K=6)", "AR"], ["AR", "xPress(K=6)"]]
    config = {"dataset": "toy", "resolved": {"rounds": 3, "arms": ["AR", "xPress(K=6)"], "rotation": order,
                                             "prompt_rows": [10, 11, 12], "distributed": {"world_size": 2}}}
    live = report.summarize(rows, n_boot=50)
    report.write_results(folder, config, {}, rows, live)
    (folder / "summary.json").unlink()
    (folder / "samples.jsonl.gz").unlink()
    for rank in (0, 1):  # plain JSON lines, as ranks append them; rank r decodes question ids r, r + 2, ...
        (folder / f"samples.rank{rank}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows if r["question_id"] % 2 == rank))
    merged = read_folder_rows(folder)
    assert merged == rounds.run_order(rows, order) and len(merged) == len(rows)
    assert [(r["round"], r["arm"]) for r in merged][:4] == [(1, "AR")] * 4  # round 1: AR first (q 0-2 and a turn 1)
    assert report.main(["--rebuild", str(folder)]) == 0
    s = json.loads((folder / "summary.json").read_text())
    assert s["rounds"] == live["rounds"] and s["arms"]["AR"]["pooled_tok_s"]["values"] == \
        live["arms"]["AR"]["pooled_tok_s"]["values"]
    assert sorted(p.name for p in folder.glob("samples*")) == ["samples.rank0.jsonl", "samples.rank1.jsonl"]
    (folder / "samples.rank1.jsonl").unlink()  # rank 1 (question id 1) lost
    (folder / "summary.json").unlink()
    capsys.readouterr()
    assert report.main(["--rebuild", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no samples.rank1.jsonl of its 2 ranks' rows" in err and \
        "torchrun --nproc-per-node 2 benchmark_compile_all.py --resume" in err, err
    # where the rank files are all there but a prompt was never decoded, the planned prompts still leave no round
    (folder / "samples.rank1.jsonl").write_text("")
    assert report.main(["--rebuild", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no complete round in its rows" in err and "torchrun --nproc-per-node 2" in err


def test_rebuild_keeps_what_the_runner_added_beside_the_rows(tmp_path, capsys):
    """compile stats and kernel fallbacks cannot be recomputed from samples.jsonl: --rebuild carries them over."""
    folder = tmp_path / "run"
    extra = {"compile": {"recompiles": 0}, "kernel_fallbacks": {"linear: a bias": 3}}
    report.write_results(folder, {"dataset": "toy"}, {}, example(), {**report.summarize(example(), n_boot=50),
                                                                     **extra})
    assert report.main(["--rebuild", str(folder)]) == 0
    capsys.readouterr()
    summary = json.loads((folder / "summary.json").read_text())
    assert {k: summary[k] for k in extra} == extra


def test_each_first_divergence_comes_with_the_logit_gaps_of_both_runs():
    rows = example()
    for r in rows:
        r["top2_gaps"] = [1.0, 2.0, 3.0, 0.004 if r["arm"] != "AR" else 0.002, 5.0]
    tm = report.summarize(rows, n_boot=50)["arms"]["xPress(K=6)"]["token_match"]
    q1 = tm["first_divergence"][1]
    assert (q1["position"], q1["round"], q1["gap_arm"], q1["gap_ref"]) == (3, 3, 0.004, 0.002)
    assert "q1:3 (gap 0.004/0.002)" in report.format_console_table(report.summarize(rows, n_boot=50), "toy")


def test_rows_timed_with_a_step_callback_label_the_run():
    rows = [dict(r, timed=r["arm"] != "AR") for r in example()]
    assert report.UNTIMED_LABEL in tables.run_labels(report.summarize(rows, n_boot=50))
    assert report.UNTIMED_LABEL not in tables.run_labels(report.summarize(example(), n_boot=50))


def test_out_naming_a_directory_is_refused_before_anything_is_written(tmp_path, capsys):
    """--out DIR said '...tmp: Is a directory' (the atomic write's temp file), after --rebuild had rewritten the
    folders; now one line names --out, before any folder is touched."""
    folder = tmp_path / "run"
    report.write_results(folder, {"dataset": "toy"}, {}, example(), report.summarize(example(), n_boot=50))
    (folder / "table.md").write_text("old")
    assert report.main(["--rebuild", str(folder), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --out {tmp_path}: names a directory, and --out takes a file; name one inside it, e.g. " \
        f"--out {tmp_path / 'table.md'}\n", err
    assert (folder / "table.md").read_text() == "old"


def test_the_title_says_when_no_round_was_a_warmup():
    """A run with no warmup says so in words (a new user read "warmup [] excluded" as a bug); the run's budget of
    new tokens is on the title line; a summary without it (older folders) still renders."""
    from harness.protocol.tables import _title
    s = {"rounds": {"all": [1, 2], "warmup": [], "measured": [1, 2]}, "temperature": 0.0, "block_size": 16,
         "prompts": 3, "run": {"model": "m", "max_new_tokens": 48}, "labels": []}
    title = _title(s, "gsm8k")
    assert "rounds=2 (no warmup, all measured)" in title and title.endswith("max_new_tokens=48")
    assert "max_new_tokens" not in _title(dict(s, run={"model": "m"}), "gsm8k")


def test_the_gain_over_drafter_only_prints_its_own_ci():
    """The gain column is a paired statistic like the speedup: its CI is printed beside it (a new user found the
    gain alone, without one)."""
    rows = paired_rows([1.0, 1.0, 1.0, 1.0], speedup=2.0)
    for rnd in range(1, 5):
        rows += [row("xPress(K=6)", q, rnd, 0.45 * TOKENS[q] / 100 * (1 + 0.02 * q), accept=[3]) for q in range(3)]
    s = report.summarize(rows, n_boot=200)
    gain = s["arms"]["xPress(K=6)"]["gain"]
    text = report.format_console_table(s, "toy")
    line = next(ln for ln in text.splitlines() if ln.startswith("xPress(K=6) "))
    lo, hi = gain["ci95"]
    assert line.rstrip().endswith(f"{gain['value']:.3f} [{lo:.2f}, {hi:.2f}; 9 units]") and lo < hi
    assert "x gain over drafter-only (median) [95% CI]" in text
