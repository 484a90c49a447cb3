"""--batch-sizes / --context-lengths (harness.protocol.sweep): the paired protocol at every (B, context) point, with
its refusals before any model loads, its folder, its numbers recomputed from its rows, the crossover and the plots."""
import json

import pytest

import benchmark_compile_all as cli
from harness.protocol import sweep
from harness.protocol.results_io import read_folder_rows, read_rows
from tiny import write_run_fixture

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTIONS = ["Add 2 and 3.", "Name a colour.", "Count to four, slowly please."]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_run_fixture(tmp_path_factory.mktemp("sweep"), [{"turns": [q]} for q in QUESTIONS],
                             xpress_std=0.02, markov_std=0.02)


def args(files, results, *extra):
    return ["--model-name-or-path", str(files / "target"), "--draft-name-or-path", str(files / "drafter"),
            "--xpress-refiner-path", str(files / "xpress.pt"), "--markov-refiner-path", str(files / "markov.pt"),
            "--dataset", "mini", "--data-dir", str(files / "data"), "--max-new-tokens", "7", "--device", "cpu",
            "--fair-interleave", "--fair-k-list", "2", "--results-dir", str(results), *extra]


@pytest.fixture(scope="module")
def swept(files, tmp_path_factory):
    results = tmp_path_factory.mktemp("swept")
    assert cli.main(args(files, results, "--run-id", "s", "--batch-sizes", "2,1", "--context-lengths", "0,60")) == 0
    folder = results / "s"
    assert not (folder / "samples.jsonl").exists()  # appended while it ran, gzip'd at its end
    return folder, json.loads((folder / "sweep.json").read_text()), read_rows(folder / "samples.jsonl.gz")


@pytest.mark.parametrize("extra,says", [
    (["--batch-sizes", "1,x"], "comma-separated integers"),
    (["--batch-sizes", "0,2"], "out of range"),
    (["--batch-sizes", "65"], "out of range"),
    (["--batch-sizes", "2,2"], "repeated"),
    (["--context-lengths", "-1"], "out of range"),
    (["--batch-sizes", ","], "empty"),
    (["--batch-sizes", "2", "--use-graph"], "--use-graph"),
    (["--batch-sizes", "2", "--compat-reference"], "--compat-reference"),
    (["--context-lengths", "100000"], "context limit"),
])
def test_bad_sweeps_are_refused_before_anything_loads(files, tmp_path, capsys, extra, says):
    """One line on stderr naming the flag, exit 2, no folder; the context check runs on the plan (configs only)."""
    assert cli.main(args(files, tmp_path, "--run-id", "bad", *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "bad").exists()


def test_a_context_no_prompt_is_below_is_refused_without_a_folder(files, tmp_path, capsys):
    """--context-lengths 0,2: every prompt already has 2 tokens, so the point would decode context 0's prompts
    again and the plot would draw noise as a trend; refused in one line (the prompts are tokenized first)."""
    assert cli.main(args(files, tmp_path, "--run-id", "c", "--batch-sizes", "1", "--context-lengths", "0,2")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--context-lengths 2: every prompt already has at least 2 tokens" in err[0], err
    assert not (tmp_path / "c").exists()


def test_every_point_runs_every_arm_in_balanced_rounds_on_the_same_requests(swept):
    folder, s, rows = swept
    assert [(p["batch_size"], p["context_len"]) for p in s["points"]] == [(1, 0), (2, 0), (1, 60), (2, 60)]
    arms = s["arms"]
    assert arms == ["AR", "drafter-only", "Markov", "xPress(K=2)"]
    config = json.loads((folder / "config.json").read_text())
    assert config["resolved"]["sweep"] == {"batch_sizes": [1, 2], "context_lengths": [0, 60], "graphs": False,
                                           "first_turn_only": True}
    rounds = len(config["resolved"]["rotation"])
    assert rounds == 1 + len(arms)  # warmup + one rotation: each arm in each slot once among the measured rounds
    for p in s["points"]:
        b = p["batch_size"]
        # 3 prompts at B=2: cycled to 4 requests, two full batches
        assert p["requests"] == (3 if b == 1 else 4)
        here = [r for r in rows if r["batch_size"] == b and r["context_len"] == p["context_len"]]
        assert len(here) == rounds * len(arms) * p["requests"]
        slots = {(r["arm"], r["slot"]) for r in here if not r["warmup"]}
        assert slots == {(a, k) for a in arms for k in range(1, len(arms) + 1)}
        for a in arms:
            assert sorted(r["question_id"] for r in here if r["arm"] == a and r["round"] == 1) == \
                sorted(sweep.request_ids(3, b))


def test_every_request_has_its_own_stream_and_a_cycled_prompt_is_labelled(swept):
    """Each request is decoded with a seeded generator of its own, at T = 0 too (where drafts may still be sampled:
    --draft-temperature), so its draws never come from a stream its batch neighbours share; a prompt repeated to
    fill B (3 prompts at B = 2: prompt 0 twice) gets a stream of its own, not its first request's, and the labels
    say the point's requests repeat prompts."""
    from harness.protocol import runner
    _, s, rows = swept
    for r in rows:
        assert r["stream_seed"] == runner.stream_seed(0, r["dataset_row"], 0, r["round"], r["request_copy"])
    twice = [r for r in rows if r["batch_size"] == 2 and r["question_id"] == 0 and r["arm"] == "AR"]
    by_round = {}
    for r in twice:
        by_round.setdefault((r["round"], r["context_len"]), []).append(r)
    for pair in by_round.values():
        assert sorted(r["request_copy"] for r in pair) == [0, 1]
        assert len({r["stream_seed"] for r in pair}) == 2
    assert all(r["request_copy"] == 0 for r in rows if r["batch_size"] == 1)
    assert any(x.startswith("prompts cycled to fill B") for x in s["labels"])


def test_sampled_drafts_at_t0_do_not_depend_on_the_batch(files, tmp_path):
    """T = 0 with --draft-temperature 1: the drafts are sampled, so each request's accepted counts depend on its
    random stream; a request's stream is its own, so at B = 2 they are those of its B = 1 decode (a stream shared
    by the batch would make them depend on the neighbour decoded beside it)."""
    assert cli.main(args(files, tmp_path, "--run-id", "td", "--batch-sizes", "1,2", "--draft-temperature", "1",
                         "--fair-interleave", "1", "--fair-warmup-rounds", "0")) == 0
    rows = read_folder_rows(tmp_path / "td")
    one = {(r["arm"], r["round"], r["question_id"]): r["accept_lengths"] for r in rows
           if r["batch_size"] == 1 and r["arm"] != "AR"}
    # requests [0, 1, 2, 0] in batches [0, 1] and [2, 0]: the last is prompt 0's repeat, on a stream of its own
    first = [r for r in rows
             if r["batch_size"] == 2 and r["arm"] != "AR" and (r["batch_index"], r["batch_row"]) != (1, 1)]
    assert first and all(r["accept_lengths"] == one[(r["arm"], r["round"], r["question_id"])] for r in first)
    labels = json.loads((tmp_path / "td" / "sweep.json").read_text())["labels"]  # sampled drafts refine alone
    assert "refinements per request" in labels and "refinements batched" not in labels, labels
    assert any(x.startswith("FEWER THAN 5 SEEDS (1;") for x in labels), labels  # one sampled round
    assert "rotation unbalanced by 1" in labels, labels  # 4 arms in one measured round: each in one slot
    readme = (tmp_path / "td" / "README.md").read_text()  # one context: no context plot written, none listed
    assert "`speedup_vs_batch.png`" in readme and "`speedup_vs_context.png`" not in readme and "same as B=1" in readme
    assert "Not plotted: no speedup_vs_context.png: one context length swept (0)" in readme


def test_batched_requests_decode_their_b1_tokens_and_long_contexts_are_long(swept):
    """fp32 on the CPU: every request's tokens at B=2 are its B=1 tokens (same arm, round and context), and every
    speculative arm's are AR's; context 60 gives prompts of >= 60 tokens that end with the request's own question."""
    _, s, rows = swept
    assert all(r["served_row"] == r["batch_row"] for r in rows)  # a static batch: each request on its own row
    for p in s["points"]:
        for a, e in p["arms"].items():
            if p["batch_size"] == 2:
                assert e["same_as_b1"]["equal"] == e["same_as_b1"]["of"] == 4 * 5, (p, a)
            else:
                assert e["same_as_b1"] is None
    ar = {(r["batch_size"], r["context_len"], r["round"], r["question_id"]): r["tokens"] for r in rows
          if r["arm"] == "AR"}
    for r in rows:
        assert r["tokens"] == ar[(r["batch_size"], r["context_len"], r["round"], r["question_id"])]
    short = next(p for p in s["points"] if p["context_len"] == 0)["prompt_tokens"]
    long = next(p for p in s["points"] if p["context_len"] == 60)["prompt_tokens"]
    assert long["min"] >= 60 > short["max"]


def test_the_numbers_follow_from_the_rows(swept):
    """total tok/s, tau and the speedup's point estimate recomputed from samples.jsonl.gz; the CI brackets it."""
    from harness.protocol import metrics
    _, s, rows = swept
    for p in s["points"]:
        here = [r for r in rows if r["batch_size"] == p["batch_size"] and r["context_len"] == p["context_len"]]
        mats = {}
        for a, e in p["arms"].items():
            mine = [r for r in here if r["arm"] == a and not r["warmup"]]
            batches = {(r["round"], r["batch_index"]): r["batch_decode_s"] for r in mine}
            tokens = sum(r["decode_tokens"] for r in mine)
            assert e["total_tok_s"] == pytest.approx(tokens / sum(batches.values()), rel=1e-3)
            assert e["tau"] == pytest.approx(metrics.tau_per_step([r["accept_lengths"] for r in mine]), abs=1e-4)
            rounds = sorted({r["round"] for r in mine})
            n = len({r["batch_index"] for r in mine})
            tok = [[sum(r["decode_tokens"] for r in mine if r["round"] == k and r["batch_index"] == g)
                    for g in range(n)] for k in rounds]
            sec = [[batches[(k, g)] for g in range(n)] for k in rounds]
            mats[a] = (tok, sec)
            if a == "AR":
                assert "speedup" not in e
                continue
            sp = metrics.median_round_speedup(*mats[a], *mats["AR"])
            assert e["speedup"] == pytest.approx(sp, abs=1e-4)
            lo, hi = e["speedup_ci"]
            assert lo <= e["speedup"] <= hi


def test_the_folder_has_the_table_and_both_plots(swept):
    folder, s, _ = swept
    table = (folder / "sweep.md").read_text()
    assert "| 2 | 60 | xPress(K=2) |" in table and "- xPress(K=2) against AR by batch size: context" in table
    assert (folder / "speedup_vs_batch.png").stat().st_size > 0
    assert (folder / "speedup_vs_context.png").stat().st_size > 0
    assert set(s["crossover"]) == {"drafter-only", "Markov", "xPress(K=2)"}
    # what ran batched is labelled: the verify and the dFlash drafts one forward each, and at T=0 on the torch ops
    # the refinements of a step in one call (refiners.batch)
    assert {"cpu float32", "eager", "drafts batched", "refinements batched",
            sweep.sweep_readme.DECODE_ONLY} <= set(s["labels"])
    assert "refinements per request" not in s["labels"] and not any(x.startswith("FEWER THAN") for x in s["labels"])


def test_the_folder_says_what_ran_in_its_titles_and_readme(swept):
    """The titles (sweep.md, steps.md, the plots' labels) open with the model, dataset, prompts, new tokens,
    temperature, seed and rounds; README.md lists them with what each file holds and how per-request tok/s is
    defined (a mean of ratios, above the pooled total at times); the environment is env.json, as a run's."""
    folder, s, rows = swept
    first = s["labels"][0]
    assert first == "target on mini: 3 prompts (first turns), 7 new tokens, T=0, seed 0, 4 measured + 1 warmup round(s)"
    for name in ("sweep.md", "steps.md"):
        assert first in (folder / name).read_text().splitlines()[0]
    readme = (folder / "README.md").read_text()
    assert f"- {first}" in readme and "| `steps.md` |" in readme and "mean of ratios" in readme
    assert "Per-request tok/s: the mean" in (folder / "sweep.md").read_text()
    assert (folder / "env.json").is_file() and not (folder / "environment.json").exists()
    # the labels say "tau capped" exactly when the rows' cut steps call for it (replicates.capped_label)
    from harness.protocol import replicates
    capped = replicates.capped_label(rows)
    assert [x for x in s["labels"] if x.startswith("tau capped")] == capped and (capped[0] in readme if capped else 1)
    assert "CIs: a CI printed as [lo, hi; n units]" in readme


def test_the_runs_report_refuses_a_sweep_folder_and_writes_nothing(swept, capsys):
    """report (and --rebuild, which a missing summary.json points to) reads single runs: on a sweep's folder its
    table would pool the batch sizes into one row an arm; refused in one line, the folder untouched."""
    from harness.protocol import report
    folder = swept[0]
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for argv in ([str(folder)], ["--rebuild", str(folder)]):
        assert report.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "a sweep's folder" in err[0] and "sweep.md" in err[0], err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def _rows(arm, b, seconds, rounds=(2, 3), batches=2, tokens=10):
    return [{"arm": arm, "batch_size": b, "context_len": 0, "round": k, "warmup": False, "batch_index": g,
             "batch_row": 0, "decode_tokens": tokens, "decode_s": seconds, "batch_decode_s": seconds,
             "batch_prefill_s": 0.01, "accept_lengths": [2, 3], "temperature": 0.0, "question_id": g,
             "tokens": [1, 2], "prompt_tokens": 5} for k in rounds for g in range(batches)]


def test_the_crossover_is_the_first_batch_size_where_an_arm_stops_beating_ar():
    """Synthetic rows: the arm takes 0.5, 0.8, 1.25 and 2 times AR's time at B = 1, 2, 4, 8: speedups 2, 1.25,
    0.8, 0.5, crossover B=4; an arm faster everywhere has none."""
    rows = []
    for b, f in ((1, 0.5), (2, 0.8), (4, 1.25), (8, 2.0)):
        rows += _rows("AR", b, 1.0) + _rows("slow", b, f) + _rows("fast", b, 0.5)
    s = sweep.summarize(rows, ["AR", "slow", "fast"], 1, [1, 2, 4, 8], [0], n_boot=50)
    got = [p["arms"]["slow"]["speedup"] for p in s["points"]]
    assert got == pytest.approx([2.0, 1.25, 0.8, 0.5])
    assert s["crossover"]["slow"]["batch_at_context"] == {"0": 4}
    assert s["crossover"]["fast"]["batch_at_context"] == {"0": None}
    # in words, without contradiction: it said "fast stops beating AR at context 0: beats AR at every B swept"
    lines = [x for x in sweep.format_table(s).splitlines() if "against AR by batch size" in x]
    assert lines == ["- slow against AR by batch size: context 0: at or above AR below B=4, first below it at B=4",
                     "- fast against AR by batch size: context 0: at or above AR at every B swept (1, 2, 4, 8)"]
    s["crossover"]["slow"]["batch_at_context"] = {"0": 1}
    assert "context 0: below AR from the smallest B swept, B=1" in sweep.format_table(s)


def test_requests_cycle_to_fill_every_batch():
    assert sweep.request_ids(3, 1) == [0, 1, 2]
    assert sweep.request_ids(3, 2) == [0, 1, 2, 0]
    assert sweep.request_ids(3, 8) == [0, 1, 2, 0, 1, 2, 0, 1]


def test_the_step_breakdown_follows_from_the_rows(swept):
    """steps.md (harness.protocol.sweep_steps): a batch's steps are its longest row's, ms/step and tokens/step are
    pooled over the measured batches, and token gain / step cost is the pooled tok/s ratio to AR."""
    from harness.protocol import sweep_steps
    folder, s, rows = swept
    entries = sweep_steps.breakdown(rows, s["arms"], "AR")
    assert len(entries) == len(s["points"]) * len(s["arms"])
    for e in entries:
        mine = [r for r in rows if r["arm"] == e["arm"] and r["batch_size"] == e["batch_size"]
                and r["context_len"] == e["context_len"] and not r["warmup"]]
        per_batch = {}
        for r in mine:
            k = (r["round"], r["batch_index"])
            n = len(r["accept_lengths"]) + r["tail_steps"]  # a tau entry per step but the tail's (state.advance)
            per_batch[k] = (max(per_batch.get(k, (0,))[0], n), r["batch_decode_s"])
        steps = sum(v[0] for v in per_batch.values())
        assert e["steps"] == steps
        assert e["ms_per_step"] == pytest.approx(1e3 * sum(v[1] for v in per_batch.values()) / steps, rel=1e-3)
        assert e["tokens_per_step"] == pytest.approx(sum(r["decode_tokens"] for r in mine) / steps, rel=1e-3)
        point = next(p for p in s["points"] if p["batch_size"] == e["batch_size"] and
                     p["context_len"] == e["context_len"])
        if e["arm"] != "AR":
            pooled = point["arms"][e["arm"]]["total_tok_s"] / point["arms"]["AR"]["total_tok_s"]
            assert e["token_gain"] / e["step_cost"] == pytest.approx(pooled, rel=5e-3)
    table = (folder / "steps.md").read_text()
    assert "| 2 | 60 | xPress(K=2) |" in table and "step cost vs AR" in table


def test_the_step_breakdown_cli_refuses_a_folder_that_is_not_a_sweep(tmp_path, capsys):
    from harness.protocol import sweep_steps
    assert sweep_steps.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a sweep folder" in err and err.count("\n") == 1
    assert not (tmp_path / "steps.md").exists()


def test_a_long_label_line_is_wrapped_to_the_figure(swept, tmp_path, monkeypatch):
    """The labels' suptitle is wrapped to the figure's width (one 5-inch panel: 70 characters a line); unwrapped,
    a single-panel figure cut the labels off at both sides."""
    import matplotlib.figure
    from harness.protocol import sweep_plots
    _, s, _ = swept
    titles = []
    real = matplotlib.figure.Figure.suptitle
    monkeypatch.setattr(matplotlib.figure.Figure, "suptitle",
                        lambda self, t, **k: (titles.append(t), real(self, t, **k))[1])
    one = dict(s, context_lengths=[s["context_lengths"][0]], labels=s["labels"] + ["a long label " * 6])
    sweep_plots.write_plots(str(tmp_path), one)
    assert titles and all(len(line) <= 70 for line in titles[0].split("\n")) and "\n" in titles[0]


def test_a_refilled_sweep_decodes_each_request_as_b1_in_one_queue_per_point(files, tmp_path):
    """--refill: at B=2 the point's requests run as ONE queue over 2 rows (batch_index 0 only, every request's row
    numbered in queue order), each request's tokens are its B=1 tokens and AR's, the batch's decode seconds reach
    to its last request's end, and the label says continuous batching; --refill needs --batch-sizes."""
    assert cli.main(args(files, tmp_path, "--run-id", "r", "--batch-sizes", "1,2", "--refill", "--fair-interleave", "1",
                         "--fair-warmup-rounds", "0")) == 0  # one round: each check is per (arm, round) or per row
    folder = tmp_path / "r"
    s, rows = json.loads((folder / "sweep.json").read_text()), read_folder_rows(folder)
    assert any("continuous batching" in x for x in s["labels"])
    b2 = [r for r in rows if r["batch_size"] == 2]
    assert {r["batch_index"] for r in b2} == {0} and {r["batch_row"] for r in b2} == {0, 1, 2, 3}
    for (a, rnd) in {(r["arm"], r["round"]) for r in b2}:  # the rows decoded on: both, the first two in order
        assert [r["served_row"] for r in sorted(b2, key=lambda r: r["batch_row"]) if (r["arm"], r["round"]) == (a, rnd)
                ][:2] == [0, 1] and {r["served_row"] for r in b2} == {0, 1}
    assert {r["served_row"] for r in rows if r["batch_size"] == 1} == {0}  # one row, each request in turn (None: unset)
    assert "Not plotted: no speedup_vs_context.png: one context length swept (0)" in (folder / "README.md").read_text()
    for r in b2:
        assert r["batch_decode_s"] >= r["decode_s"] > 0 and r["refill"] and r["batch_rows"] == 2
    from harness.protocol import sweep_steps
    for (a, rnd) in {(r["arm"], r["round"]) for r in b2}:
        batch = [r for r in b2 if r["arm"] == a and r["round"] == rnd]
        assert len({r["batch_steps"] for r in batch}) == 1  # one queue, one count, every request's steps within it
        steps = [r["spec_steps"] + r["ar_steps"] for r in batch]
        assert max(steps) <= batch[0]["batch_steps"] < sum(steps)
        assert sweep_steps.step_stats(batch)["steps"] == batch[0]["batch_steps"]
    for p in s["points"]:
        for e in p["arms"].values():
            assert p["batch_size"] == 1 or e["same_as_b1"]["equal"] == e["same_as_b1"]["of"] == 4 * 1
    ar = {(r["batch_size"], r["round"], r["question_id"]): r["tokens"] for r in rows if r["arm"] == "AR"}
    assert all(r["tokens"] == ar[(r["batch_size"], r["round"], r["question_id"])] for r in rows)
    assert cli.main(args(files, tmp_path, "--run-id", "bad", "--refill")) == 2
    assert not (tmp_path / "bad").exists()


def test_a_refilled_batch_counts_its_own_steps_and_its_rows_as_slots():
    """sweep_steps on refilled rows: the batch's steps are its own count (a queue of 4 requests on 2 rows takes
    more steps than its longest request), and its slots are its 2 rows at every step, not its 4 requests."""
    from harness.protocol import sweep_steps
    rows = [{"round": 2, "batch_index": 0, "spec_steps": s, "ar_steps": 0, "batch_decode_s": 0.5, "decode_tokens": t,
             "refill": True, "batch_steps": 10, "batch_rows": 2} for s, t in ((6, 12), (4, 8), (5, 10), (5, 9))]
    got = sweep_steps.step_stats(rows)
    assert got["steps"] == 10 and got["slot_use"] == 1.0 and got["tokens_per_step"] == 3.9
    static = [{k: v for k, v in r.items() if k not in ("refill", "batch_steps", "batch_rows")} for r in rows]
    assert sweep_steps.step_stats(static)["steps"] == 6  # a static batch: its longest row


def test_a_point_of_one_batch_in_one_round_prints_its_ci_as_n_a():
    """One measured round of one batch (a --refill point: one queue): the CI resampled one unit and printed as
    '10.078 [10.08, 10.08]'; it is null in sweep.json and n/a in sweep.md. Two rounds give a real interval."""
    for rounds, expect in (((2,), "[CI n/a: 1 unit]"), ((2, 3), "[")):
        rows = _rows("AR", 1, 1.0, rounds=rounds, batches=1) + _rows("xPress(K=2)", 1, 0.1, rounds=rounds, batches=1)
        if len(rounds) > 1:
            rows[-1] = dict(rows[-1], decode_s=0.2, batch_decode_s=0.2)
        s = sweep.summarize(rows, ["AR", "xPress(K=2)"], 0, [1], [0])
        e = s["points"][0]["arms"]["xPress(K=2)"]
        assert (e["speedup_ci"] is None) == (len(rounds) == 1)
        line = next(ln for ln in sweep.format_table(s).splitlines() if "| xPress(K=2) |" in ln)
        assert f"{e['speedup']:.3f} {expect}" in line and ("n/a" in line) == (len(rounds) == 1), line


def test_an_interrupted_sweeps_folder_says_to_delete_it(files, tmp_path, capsys, monkeypatch):
    """Rerun said 'pass --resume', and --resume said 'a sweep does not take --resume': the refusal names the way
    out (delete the folder, or another --run-id), before anything loads, with the sweep's flags or without."""
    import harness.protocol.runner as runner
    monkeypatch.setattr(runner, "load_target", lambda *a, **k: pytest.fail("a model was loaded"))
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"batch_sizes": "1,2"}))  # what an interrupted sweep leaves
    (folder / "samples.jsonl").write_text("")
    for extra in (("--batch-sizes", "1,2"), ()):
        assert cli.main(args(files, tmp_path, "--run-id", "r", *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert f"delete {folder} to run it again, or pick another --run-id" in err and "--resume" not in err, err
