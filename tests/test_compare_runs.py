"""python -m harness.protocol.compare_runs: two runs' τ per arm, paired over their prompts (and at T>0 over the
sampling replicates both have), from tiny CLI runs with two drafters."""
import json
import shutil

import pytest

import benchmark_compile_all as cli
from harness.protocol import compare_runs, report, results_io
from tiny import write_run_fixture

pytestmark = pytest.mark.usefixtures("one_thread", "no_plots_module")

PROMPTS = [{"turns": ["Add 2 and 3."]}, {"turns": ["Name a colour."]}, {"turns": ["Count to four."]}]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Tiny runs on the same prompts, greedy (a0) and sampled (a1: two rounds, both replicates), a greedy run on
    fewer prompts, and copies of a0 and a1 whose drafter-only rows of prompt 1 merge their first two verify steps
    into one (the same tokens in one step fewer: a higher τ, as a better drafter's), rebuilt into their tables."""
    root = tmp_path_factory.mktemp("compare_runs")
    files = write_run_fixture(root / "files", PROMPTS, xpress_std=0.02, markov_std=0.02)
    out = root / "res"

    def run(run_id, *extra):
        argv = ["--model-name-or-path", str(files / "target"), "--draft-name-or-path", str(files / "drafter"),
                "--xpress-refiner-path", str(files / "xpress.pt"), "--markov-refiner-path", str(files / "markov.pt"),
                "--dataset", "mini", "--data-dir", str(files / "data"), "--max-new-tokens", "8", "--device", "cpu",
                "--fair-interleave", "2", "--fair-warmup-rounds", "1", "--fair-k-list", "1", "--results-dir",
                str(out), "--run-id", run_id, *extra]
        assert cli.main(argv) == 0
        return str(out / run_id)

    got = {"a0": run("a0"), "a1": run("a1", "--temperature", "1"), "a0_two": run("a0_two", "--max-samples", "2"),
           "a0_nowarm": run("a0_nowarm", "--fair-warmup-rounds", "0"),
           "td": run("td", "--draft-temperature", "1"), "t1_td0": run("t1_td0", "--temperature", "1",
                                                                   "--draft-temperature", "0"),
           "a1_topp": run("a1_topp", "--temperature", "1", "--top-p", "0.9"),
           "a1_three": run("a1_three", "--temperature", "1", "--fair-interleave", "3")}
    scripted = ["--random-weights", "tiny", "--scripted-accept", "2", "--dataset", "mini", "--data-dir",
                str(files / "data"), "--max-new-tokens", "8", "--device", "cpu", "--results-dir", str(out)]
    assert cli.main(scripted + ["--run-id", "scripted"]) == 0
    got["scripted"] = str(out / "scripted")
    for t in "01":
        got[f"b{t}"] = _better_drafter_only(got[f"a{t}"], out / f"b{t}")
    return got


def _better_drafter_only(src, dst) -> str:
    shutil.copytree(src, dst)
    rows = results_io.read_folder_rows(dst)
    for r in rows:
        if r["arm"] == "drafter-only" and r["question_id"] == 1:
            a, c = r["accept_lengths"], r["accepted"]
            assert len(a) >= 2
            r["accept_lengths"], r["accepted"] = [a[0] + a[1]] + a[2:], [c[0] + c[1] + 1] + c[2:]
    results_io.write_rows(dst, rows)
    report.rebuild(str(dst))
    return str(dst)


def _summary_tau(folder, arm):
    return json.loads(open(f"{folder}/summary.json").read())["arms"][arm]["tau_per_step"]


def test_a_run_against_itself_is_equal_in_every_speculative_arm(runs):
    r = compare_runs.compare(runs["a0"], runs["a0"])
    assert [a["arm"] for a in r["arms"]] == ["drafter-only", "Markov", "xPress(K=1)"]  # AR is not compared
    for a in r["arms"]:
        assert a["ratio"] == 1.0 and a["ratio_ci95"] == [1.0, 1.0] and a["prompts"] == 3


def test_greedy_runs_pair_their_one_tau_round_whichever_it_was(runs):
    """A greedy run's rounds decode the same text: a run without a warmup round (its τ round is 1) pairs with one
    that had one (its τ round is 2)."""
    r = compare_runs.compare(runs["a0"], runs["a0_nowarm"])
    assert all(a["ratio"] == 1.0 and a["rounds"] == [[2], [1]] for a in r["arms"])


def test_drafts_sampled_at_a_greedy_target_keep_their_replicates(runs):
    """Td > 0 at T=0: the drafts vary by round, the table's τ is the mean over its rounds, and so is each side's."""
    r = compare_runs.compare(runs["td"], runs["td"])
    for a in r["arms"]:
        assert a["replicates"] == 2 and a["base"] == pytest.approx(_summary_tau(runs["td"], a["arm"]), rel=1e-12)


def test_fewer_shared_rounds_are_said_beside_the_tau(runs, capsys):
    """A 3-round run against a 2-round one pairs the 2 rounds both have, and the line says its τ is not its
    table's."""
    assert compare_runs.main([runs["a1"], runs["a1_three"], "--arm", "drafter"]) == 0
    out = capsys.readouterr().out
    assert "2 sampling replicates; NEW's τ over 2 of its table's 3 rounds)" in out
    assert "over prompts and rounds" in out


@pytest.mark.parametrize("t", ["0", "1"])
def test_each_side_is_its_own_tables_tau_and_the_ratio_pairs_them(runs, t):
    """Each side's τ is the one its table prints (summary.json: at T>0 the mean over the replicate rounds), the ratio
    is NEW over BASE, and only the arm whose rows differ moves; at T=1 both rounds pair as replicates."""
    base, new = runs["a" + t], runs["b" + t]
    r = compare_runs.compare(base, new)
    assert r["greedy"] is (t == "0")
    for a in r["arms"]:
        assert a["base"] == pytest.approx(_summary_tau(base, a["arm"]), rel=1e-12)
        assert a["new"] == pytest.approx(_summary_tau(new, a["arm"]), rel=1e-12)
        assert a["ratio"] == pytest.approx(a["new"] / a["base"], rel=1e-12)
        assert a["replicates"] == (1 if t == "0" else 2)
    moved = {a["arm"]: a["ratio"] for a in r["arms"] if a["ratio"] != 1.0}
    assert list(moved) == ["drafter-only"] and moved["drafter-only"] > 1


def test_prompts_pair_by_question_not_by_row_order(runs, monkeypatch):
    """NEW's rows read in reverse order (BASE's as written) give the same comparison: each prompt is paired with
    itself, not with the prompt at its position."""
    want = compare_runs.compare(runs["a1"], runs["b1"])
    read = results_io.read_folder_rows
    monkeypatch.setattr(results_io, "read_folder_rows",
                        lambda folder: list(reversed(read(folder))) if str(folder) == runs["b1"] else read(folder))
    assert compare_runs.compare(runs["a1"], runs["b1"]) == want


def test_the_cli_prints_a_line_an_arm_and_writes_json(runs, tmp_path, capsys):
    out = tmp_path / "cmp.json"
    assert compare_runs.main([runs["a0"], runs["b0"], "--arm", "drafter", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert [a["arm"] for a in saved["arms"]] == ["drafter-only"]
    assert "drafter-only (3 prompts, one τ round each)" in text and "speed is not compared" in text
    assert f"ratio {saved['arms'][0]['ratio']:.3f}" in text


@pytest.mark.parametrize("which, extra, message", [
    ("a0_two", [], "differs (dataset row and tokens"),
    ("a1", [], "differ in temperature (0.0 and 1.0)"),
    ("t1_td0", [], "differ in temperature (0.0 and 1.0)"),
    ("td", [], "differ in draft_temperature (0.0 and 1.0)"),
    ("b0", ["--arm", "AR"], "AR's τ is 1 by definition"),
    ("b0", ["--arm", "xPress(K=4)"], "not an arm of both runs (shared: AR, drafter-only, Markov, xPress(K=1))"),
])
def test_runs_that_do_not_pair_are_refused_in_one_line_and_nothing_is_written(runs, tmp_path, capsys, which, extra,
                                                                               message):
    out = tmp_path / "cmp.json"
    assert compare_runs.main([runs["a0"], runs[which], *extra, "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not out.exists()


def test_a_setting_that_changes_tau_is_refused(runs, capsys):
    assert compare_runs.main([runs["a1"], runs["a1_topp"]]) == 2
    assert "differ in top_p (1.0 and 0.9), which changes τ" in capsys.readouterr().err


def test_a_summary_older_than_its_rows_is_refused_not_crashed(runs, tmp_path, capsys):
    """A τ round whose rows lack a prompt (rows rewritten without --rebuild) gets the one line naming --rebuild."""
    import shutil
    stale = tmp_path / "stale"
    shutil.copytree(runs["a0"], stale)
    results_io.write_rows(stale, [r for r in results_io.read_folder_rows(stale)
                                  if not (r["arm"] == "Markov" and r["question_id"] == 2 and r["round"] == 2)])
    assert compare_runs.main([runs["a0"], str(stale)]) == 2
    err = capsys.readouterr().err
    assert "Markov's τ rounds [2] lack rows of some prompt" in err and "--rebuild" in err and err.count("\n") == 1


def test_another_dataset_file_is_refused_even_with_the_same_rows_and_tokens(runs, tmp_path, capsys):
    """An edited prompt file can keep every row's token count: config.json's recorded sha256 tells them apart."""
    other = tmp_path / "other"
    shutil.copytree(runs["b0"], other)
    cfg = json.loads((other / "config.json").read_text())
    before = cfg["resolved"]["dataset"]["sha256"]
    cfg["resolved"]["dataset"]["sha256"] = "f" * 64
    (other / "config.json").write_text(json.dumps(cfg))
    assert compare_runs.main([runs["a0"], str(other)]) == 2
    err = capsys.readouterr().err
    assert f"sha256 {before[:12]} and ffffffffffff" in err and err.count("\n") == 1


def test_scripted_acceptance_is_not_compared(runs, capsys):
    assert compare_runs.main([runs["scripted"], runs["scripted"]]) == 2
    assert "scripted its acceptance" in capsys.readouterr().err


def test_a_folder_that_is_not_a_run_is_refused(tmp_path, capsys):
    assert compare_runs.main([str(tmp_path / "none"), str(tmp_path)]) == 2
    assert "not a results folder" in capsys.readouterr().err


def test_an_unwritable_json_path_fails_the_command_before_it_prints(runs, tmp_path, capsys):
    assert compare_runs.main([runs["a0"], runs["b0"], "--json", str(tmp_path / "no" / "cmp.json")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--json" in err and "cannot write it" in err and err.count("\n") == 1


def test_a_ratio_without_a_ci_says_so_and_its_json_holds_null(tmp_path):
    """One unit draws no CI (metrics.MIN_CI_UNITS): the verdict is "no CI", not "no difference shown", and --json
    writes null where the CI's ends are NaN (strict JSON parsers refuse a bare NaN)."""
    from core.json_out import write_json_arg
    from harness.protocol.ci_text import verdict
    nan = float("nan")
    assert verdict([nan, nan]) == "no CI" and verdict(None) == "no CI" and verdict([0.9, 1.1]) == "no difference shown"
    assert verdict([1.01, 1.2]) == "higher" and verdict([0.8, 0.99]) == "lower"
    write_json_arg(str(tmp_path / "x.json"), {"ratio_ci95": [nan, float("inf")], "n": 1}, "t")
    assert json.loads((tmp_path / "x.json").read_text()) == {"ratio_ci95": [None, None], "n": 1}
