"""harness.lab.readme_numbers: every number the READMEs quote from results is recomputed from committed files."""
import json
from pathlib import Path

import pytest

from harness.lab import readme_numbers as rn

ROOT = Path(__file__).resolve().parent.parent


def failing(findings):
    return [f for f in findings if f.kind != "untraced"]


def tiny_repo(tmp_path: Path, readme: str) -> Path:
    """A repository of one run folder (two arms) and a README.md."""
    run = tmp_path / "results" / "smollm2-135m" / "gsm8k_t0"
    run.mkdir(parents=True)
    arm = {"method": "drafter-only", "tau_per_step": 2.148409, "pooled_tok_s": {"mean": 2070.07},
           "speedup": {"value": 2.0322}, "per_position": [0.5597], "token_match": None}
    ar = {"method": "ar", "tau_per_step": 1.0, "pooled_tok_s": {"mean": 1018.6}, "speedup": None, "per_position": []}
    (run / "summary.json").write_text(json.dumps({"arms": {"AR": ar, "drafter-only": arm}}))
    (run / "table.md").write_text("| arm | tau |\n|---|---|\n| drafter-only | 2.15 |\n")
    (tmp_path / "README.md").write_text(readme)
    return tmp_path


def test_the_committed_readmes_pass_check():
    """The real guard: every marked number in README.md and the results READMEs equals what the committed files
    give, every block equals its file, and no quoted result is left unmarked."""
    bad = failing(rn.check(ROOT))
    assert not bad, "\n".join(map(str, bad)) + "\nrun: python -m harness.lab.readme_numbers --write"


def test_a_planted_wrong_number_is_caught_and_write_fixes_it(tmp_path, capsys):
    """A marked τ that disagrees with summary.json fails --check with the key and both values; --write puts the
    files' value in place and the check passes after it (the old code had no check: README numbers were by hand)."""
    root = tiny_repo(tmp_path, "gsm8k τ <!--n:tau:gsm8k_t0:drafter-->2.16<!--/n--> at "
                               "<!--n:sp:gsm8k_t0:drafter-->2.03<!--/n-->×.\n")
    (bad,) = failing(rn.check(root))
    assert bad.kind == "stale" and "'2.16'" in bad.text and "'2.15'" in bad.text and bad.line == 1
    assert rn.main(["--check", "--root", str(root)]) == 1
    assert "FAIL README.md:1: stale" in capsys.readouterr().out
    assert rn.main(["--write", "--root", str(root)]) == 0
    assert "<!--n:tau:gsm8k_t0:drafter-->2.15<!--/n-->" in (root / "README.md").read_text()
    assert failing(rn.check(root)) == []


def test_an_unmarked_quoted_number_is_caught_and_prose_numbers_are_not():
    """A τ, a speedup or a percentage written by hand outside a marker fails; code, links, ignore markers,
    integers of prose and "95% CI" do not."""
    text = ("drafter-only reaches τ 2.15 and 2.03× on gsm8k, +6.6% over AR.\n"
            "Run `--max-new-tokens 96 --tau 1.5` with 16 prompts and a [link](http://x/1.5%).\n"
            "Files under <!--i:a limit-->16 MiB<!--/i--> and a 95% CI; block 16.\n")
    found = rn.unmarked("README.md", text)
    assert [(f.line, f.text.split()[0]) for f in found] == [(1, "'2.15'"), (1, "'2.03×'"), (1, "'+6.6%'")]


def test_unmarked_numbers_in_table_rows_are_caught():
    """A table row of results names no unit itself: its decimals count as quoted."""
    (f,) = rn.unmarked("README.md", "| arm | a |\n|---|---|\n| AR | 4.487 |\n")
    assert f.line == 3 and "4.487" in f.text


def test_a_copied_block_is_checked_as_a_whole_and_rewritten(tmp_path):
    """A table copied from a results file is compared as one block with the file (no per-number markers
    needed inside it); a changed cell fails, and --write copies the file again."""
    block = "<!--block:results/smollm2-135m/gsm8k_t0/table.md-->\n| arm | tau |\n|---|---|\n| drafter-only | 2.14 |\n" \
            "<!--/block-->\n"
    root = tiny_repo(tmp_path, "Intro.\n\n" + block)
    (bad,) = failing(rn.check(root))
    assert bad.kind == "block" and bad.line == 3
    rn.write(root)
    assert "| drafter-only | 2.15 |\n<!--/block-->" in (root / "README.md").read_text()
    assert failing(rn.check(root)) == []


def test_untraced_numbers_are_listed_and_fail_only_under_strict(tmp_path):
    """A measured number with no committed source stays visible: --check lists it and passes, --strict fails."""
    root = tiny_repo(tmp_path, "It took <!--u:measured by hand-->2 min 34 s<!--/u--> of wall time.\n")
    (f,) = rn.check(root)
    assert f.kind == "untraced" and "2 min 34 s" in f.text
    assert rn.main(["--check", "--root", str(root)]) == 0
    assert rn.main(["--check", "--strict", "--root", str(root)]) == 1


@pytest.mark.parametrize("key, says", [("nosuch:gsm8k_t0", "no quantity 'nosuch'"),
                                       ("tau:gsm8k_t0:markov", "has no arm 'Markov'"),
                                       ("tau:gone_t0:drafter", "is not a committed file")])
def test_a_key_that_does_not_resolve_fails_with_its_reason(tmp_path, key, says):
    """An unknown family, a missing arm or a missing results file is a failing finding that says which."""
    root = tiny_repo(tmp_path, f"τ <!--n:{key}-->2.15<!--/n-->\n")
    (bad,) = failing(rn.check(root))
    assert bad.kind == "unknown" and says in bad.text


def test_run_folder_readmes_are_left_to_the_harness(tmp_path):
    """Only hand-written READMEs are scanned: a run folder's README.md (beside summary.json) and a sweep folder's
    (beside sweep.json) are the harness's."""
    root = tiny_repo(tmp_path, "none\n")
    (root / "results" / "smollm2-135m" / "gsm8k_t0" / "README.md").write_text("τ 9.99\n")
    sweep = root / "results" / "sweeps" / "s1"
    sweep.mkdir(parents=True)
    (sweep / "sweep.json").write_text("{}")
    (sweep / "README.md").write_text("- tau capped by --max-new-tokens: 6% of Markov's verify steps\n")
    (root / "results" / "smollm2-135m" / "README.md").write_text("τ 9.99\n")
    assert [str(p.relative_to(root)) for p in rn.readmes(root)] == ["README.md", "results/smollm2-135m/README.md"]
    # the shipped weights' README quotes their training numbers too: it is scanned
    (root / "weights" / "smollm2-135m").mkdir(parents=True)
    (root / "weights" / "smollm2-135m" / "README.md").write_text("τ 9.99\n")
    assert [str(p.relative_to(root)) for p in rn.readmes(root)][-1] == "weights/smollm2-135m/README.md"


def render_in_process(argv, cwd, **kw):
    """What check_cards' subprocess.run does, without the interpreter start and its torch import (about 3 s of CPU
    a render): the same command, checked, run through training.card.main; a real process renders the committed
    card in test_the_committed_readmes_pass_check and fails on the bad card.json below."""
    import contextlib
    import io
    import subprocess
    import sys
    from training import card as card_cli
    assert argv[:3] == [sys.executable, "-m", "training.card"] and Path(cwd) == ROOT, (argv, cwd)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = card_cli.main(argv[3:])
    return subprocess.CompletedProcess(argv, rc, "", err.getvalue())


def test_a_generated_model_card_must_equal_its_card_json_rendering(tmp_path, monkeypatch):
    """A committed card.json is rendered through `python -m training.card --from-json`: the committed Markdown
    passes when it is that rendering, and an edit by hand (or a card.json that does not render) fails."""
    root = tiny_repo(tmp_path, "none\n")
    card, md = root / "card.json", root / "CARD.md"
    monkeypatch.setattr(rn, "CARDS", (("card.json", "CARD.md"),))
    card.write_text(json.dumps({"title": "t", "data": {}, "models": [], "stages": {}}))
    md.write_text("stale\n")
    with monkeypatch.context() as mp:  # the two renders that succeed: in-process
        mp.setattr(rn.subprocess, "run", render_in_process)
        (bad,) = rn.check_cards(root)
        assert bad.kind == "card" and "differs" in bad.text
        from training.card_md import render
        md.write_text(render(json.loads(card.read_text())))
        assert rn.check_cards(root) == []
    card.write_text(json.dumps({"title": "t"}))  # a real process that fails
    (bad,) = rn.check_cards(root)
    assert "failed" in bad.text


def test_the_protocol_families_read_the_divergence_and_ratio_fields(tmp_path):
    """Guards the families the regenerated H200 tables quote (issue 27): the end-to-end Sp., the break-even τ, Sp.'s
    CI, the paired τ ratio and its CI, AR's rows equal to the fp32 AR, the gaps at AR's first divergences and the
    count beyond the near-tie bound. A planted divergence beyond the bound is counted; a wrong field fails."""
    from harness.lab.readme_numbers_keys import REGISTRY as R
    root = tiny_repo(tmp_path, "none\n")
    run = root / "results" / "smollm2-135m" / "gsm8k_t0"
    s = json.loads((run / "summary.json").read_text())
    s["arms"]["drafter-only"].update(speedup={"value": 1.5732, "ci95": [1.4687, 1.6918]},
                                     speedup_e2e={"value": 1.5189}, break_even_tau=1.3095,
                                     tau_gain={"ratio": 1.0243, "ratio_ci95": [1.0071, 1.0450]},
                                     token_match={"first_divergence": [{"position": 3, "gap": 9.0, "near_tie": False}]})
    s["arms"]["AR"]["reference_match"] = {"rows_identical": 10, "rows_compared": 35, "first_divergence": [
        {"gap": 0.1122, "near_tie": True}, {"gap": 0.0021, "near_tie": True}, {"position": None}]}
    (run / "summary.json").write_text(json.dumps(s))
    f = "gsm8k_t0"
    assert (R["sp_e2e"](root, f, "drafter"), R["be"](root, f, "drafter")) == ("1.52", "1.31")
    assert (R["sp_ci"](root, f, "drafter", "lo"), R["sp_ci"](root, f, "drafter", "hi")) == ("1.47", "1.69")
    assert [R["tau_ratio"](root, f, "drafter", w) for w in ("value", "lo", "hi")] == ["1.024", "1.007", "1.045"]
    assert R["ref_identical_of"](root, f) == "10/35" and R["ref_divergences"](root, f) == "2"
    assert (R["ref_gap_end"](root, f, "min", 3), R["ref_gap_end"](root, f, "max", 3)) == ("0.002", "0.112")
    assert R["beyond_bound"](root, f) == "1"
    # the mean over folders of the paired ratio (issue 26's five-dataset mean): a second folder at 1.1000
    other = root / "results" / "smollm2-135m" / "mbpp_t0"
    other.mkdir()
    s["arms"]["drafter-only"]["tau_gain"]["ratio"] = 1.1
    (other / "summary.json").write_text(json.dumps(s))
    assert R["tau_ratio_mean"](root, "gsm8k_t0,mbpp_t0", "drafter") == "1.062"
    assert R["tau_ratio_mean"](root, "mbpp_t0", "drafter", 2) == "1.10"


def test_the_shipping_families_read_gain_order_card_and_ranges_over_folders(tmp_path):
    """The families the shipped weights' tables quote: xPress's throughput over drafter-only's with its CI (gain),
    its τ over Markov's (tau_order's vs_markov), a range's end over several folders (comma-separated), and a field
    of the lineage card; a run or model the card lacks fails with its name."""
    from core.errors import UsageError
    from harness.lab.readme_numbers_keys import REGISTRY as R
    root = tiny_repo(tmp_path, "none\n")
    runs = root / "results" / "smollm2-135m"
    s = json.loads((runs / "gsm8k_t0" / "summary.json").read_text())
    s["arms"]["xPress(K=1)"] = {"method": "xpress", "arm": "xPress(K=1)", "tau_per_step": 2.94,
                                "gain": {"value": 1.0232, "ci95": [1.0039, 1.0410]}}
    s["tau_order"] = {"xpress": [{"arm": "xPress(K=1)",
                                  "vs_markov": {"ratio": 0.9746, "ratio_ci95": [0.9489, 1.0124]}}]}
    (runs / "gsm8k_t0" / "summary.json").write_text(json.dumps(s))
    other = json.loads(json.dumps(s))
    other["arms"]["drafter-only"]["tau_per_step"] = 2.887
    (runs / "math500_t0").mkdir()
    (runs / "math500_t0" / "summary.json").write_text(json.dumps(other))
    f = "gsm8k_t0"
    assert [R["xgain"](root, f, "x1", w) for w in ("value", "lo", "hi")] == ["1.023", "1.004", "1.041"]
    assert [R["tau_vs_markov"](root, f, "x1", w) for w in ("value", "lo", "hi")] == ["0.975", "0.949", "1.012"]
    both = "gsm8k_t0,math500_t0"
    ends = (R["tau_end"](root, both, "drafter", "min"), R["tau_end"](root, both, "drafter", "max"))
    assert ends == ("2.148", "2.887")
    card = {"lineage": [{"name": "run3", "card": {"models": [{"model": "drafter", "steps": 2248,
                                                              "heldout": {"tau_drafter": 2.295},
                                                              "val_loss_per_epoch": [0.2888, 0.2706]}]}}]}
    (runs / "training").mkdir()
    (runs / "training" / "card.json").write_text(json.dumps(card))
    assert R["card"](root, "run3", "drafter", "heldout.tau_drafter") == "2.295"
    assert R["card"](root, "run3", "drafter", "steps") == "2248"
    assert R["card"](root, "run3", "drafter", "val_loss_per_epoch.1", 4) == "0.2706"
    with pytest.raises(UsageError, match="no run 'run9'"):
        R["card"](root, "run9", "drafter", "steps")
    with pytest.raises(UsageError, match="no model 'xpress'"):
        R["card"](root, "run3", "xpress", "steps")
    older = root / "results" / "smollm2-135m-v2" / "training"  # a card kept beside earlier weights' tables
    older.mkdir(parents=True)
    card["lineage"][0]["card"]["models"][0]["steps"] = 914
    (older / "card.json").write_text(json.dumps(card))
    assert R["card_of"](root, "results/smollm2-135m-v2/training", "run3", "drafter", "steps") == "914"
    assert R["card"](root, "run3", "drafter", "steps") == "2248"
    with pytest.raises(UsageError, match="v2/training/card.json has no run 'run9'"):
        R["card_of"](root, "results/smollm2-135m-v2/training", "run9", "drafter", "steps")


def test_xopt_is_the_xpress_arm_the_run_chose_and_a_tried_run_is_found_in_the_card(tmp_path):
    """`xopt`: the README's xPress columns follow each run's throughput-optimal K (summary.json's optimal.xpress),
    not a fixed K; `card` finds a run the card lists as tried (not shipped) as well as the lineage's."""
    from harness.lab.readme_numbers_keys import REGISTRY as R
    root = tiny_repo(tmp_path, "none\n")
    run = root / "results" / "smollm2-135m" / "gsm8k_t0"
    s = json.loads((run / "summary.json").read_text())
    for k, tau, gain in ((1, 3.16, 0.996), (2, 3.28, 1.017), (4, 3.39, 1.001)):
        s["arms"][f"xPress(K={k})"] = {"method": "xpress", "arm": f"xPress(K={k})", "tau_per_step": tau,
                                       "gain": {"value": gain, "ci95": [gain - 0.03, gain + 0.05]}}
    s["optimal"] = {"xpress": {"arm": "xPress(K=2)", "K": 2}}
    (run / "summary.json").write_text(json.dumps(s))
    assert (R["tau"](root, "gsm8k_t0", "xopt"), R["xgain"](root, "gsm8k_t0", "xopt")) == ("3.28", "1.017")
    assert R["tau"](root, "gsm8k_t0", "x4") == "3.39" and R["opt_k"](root, "gsm8k_t0") == "2"
    s["optimal"] = {"xpress": None}  # a run without xPress arms chose none: a clear error, not a KeyError
    (run / "summary.json").write_text(json.dumps(s))
    from core.errors import UsageError
    from harness.lab.readme_numbers_keys import _json
    _json.cache_clear()  # the families cache each file read
    with pytest.raises(UsageError, match="chose no throughput-optimal xPress arm"):
        R["tau"](root, "gsm8k_t0", "xopt")
    (root / "results" / "smollm2-135m" / "training").mkdir()
    (root / "results" / "smollm2-135m" / "training" / "card.json").write_text(json.dumps({
        "lineage": [{"name": "heads", "card": {"models": [{"model": "xpress", "steps": 903}]}}],
        "tried": [{"name": "consistency", "card": {"models": [{"model": "xpress_cw1", "steps": 701}]}}]}))
    assert R["card"](root, "consistency", "xpress_cw1", "steps") == "701"
    assert R["card"](root, "heads", "xpress", "steps") == "903"


def test_ar_self_counts_prompts_whose_ar_text_agrees_across_two_runs(tmp_path):
    """ar_self: prompts both runs decoded whose AR rows agree through the shorter text; one token changed in one
    round of one prompt makes that prompt count as different, other arms and later turns are not read."""
    from harness.lab.readme_numbers_keys import REGISTRY as R
    root = tiny_repo(tmp_path, "none\n")
    runs = root / "results" / "smollm2-135m"

    def write(folder, rows):  # "a" as a run writes its rows (gzip'd), "b" as an older folder has them (plain)
        from harness.protocol.results_io import append_rows, write_rows
        (runs / folder).mkdir(exist_ok=True)
        write_rows(runs / folder, rows) if folder == "a" else append_rows(runs / folder / "samples.jsonl", rows)
    row = lambda q, toks, arm="AR", turn=0: {"dataset_row": q, "arm": arm, "turn": turn, "tokens": toks}
    write("a", [row(1, [5, 6, 7, 8]), row(1, [5, 6, 7, 8]), row(2, [1, 2, 3]), row(3, [9]),
                row(2, [0], "drafter-only")])
    write("b", [row(1, [5, 6]), row(2, [1, 2, 3, 4]), row(2, [1, 2, 4]), row(4, [1]), row(1, [0], turn=1)])
    assert R["ar_self"](root, "a", "b") == "1/2"  # prompt 1 agrees through 2 tokens; prompt 2's second round differs
    assert R["ar_self"](root, "a", "b", "of") == "1 of 2"


def test_the_weights_families_read_heads_json_else_the_ship_manifest(tmp_path):
    """weights_mb and held_out read training.ship's manifest: heads.json where a heads run shipped beside a drafter
    export (whose own manifest.json lists no total), else manifest.json as `training.ship` writes it for a run that
    trained every model; the held-out record is "heldout" (the 64-prompt set) or "held_out" (the first weights)."""
    from harness.lab.readme_numbers_keys import REGISTRY as R
    w = tmp_path / "weights" / "smollm2-135m"
    w.mkdir(parents=True)
    (w / "manifest.json").write_text(json.dumps({"total_bytes": 55.2e6, "models": {
        "drafter": {"held_out": {"tau_drafter": 2.05}}}}))
    assert R["weights_mb"](tmp_path) == "55.2" and R["held_out"](tmp_path, "drafter", "tau_drafter") == "2.05"
    (w / "heads.json").write_text(json.dumps({"total_bytes": 69.3167e6, "models": {
        "xpress": {"heldout": {"tau_drafter": 2.3018, "tau_xpress_K1": 2.4703, "tau_xpress_K3": 2.61,
                               "tau_xpress_K1_T1": 1.9, "tau_xpress_K3_T1": 2.9}}}}))
    assert R["weights_mb"](tmp_path) == "69.3" and R["held_out"](tmp_path, "xpress", "tau_xpress_K1") == "2.47"
    # a range over every K is of the greedy keys only: the sampled ones (acceptance.sampled_temperatures) stay out
    ends = [R["held_out_end"](tmp_path, "xpress", "tau_xpress_K", w) for w in ("min", "max")]
    assert ends == ["2.47", "2.61"], ends


def test_the_json_and_bench_batch_families_read_their_files_and_name_what_is_missing(tmp_path):
    """json reads one number at a dotted key of a committed JSON file; bench_batch one field of the row of a
    bench_batch JSON at (B, context, width). A missing key, a value that is not a number or a row that is not there
    is a clear error naming it, not a wrong number."""
    from core.errors import UsageError
    from harness.lab.readme_numbers_keys import REGISTRY as R
    perf = tmp_path / "results" / "perf"
    perf.mkdir(parents=True)
    (perf / "b.json").write_text(json.dumps({"compiled_ms": 36.174, "label": "random weights", "runs": [{"ms": 4.5}],
                                             "rows": [{"batch": 2, "context": 512, "width": 16, "ms": 4.971,
                                                       "ratio": 1.377},
                                                      {"batch": 2, "context": 512, "width": 1, "ms": 4.41,
                                                       "ratio": 1.22}]}))
    assert R["json"](tmp_path, "results/perf/b.json", "compiled_ms") == "36.17"
    assert R["json"](tmp_path, "results/perf/b.json", "runs.0.ms", 1) == "4.5"
    (perf / "acc.json").write_text(json.dumps({"bench:gsm8k": {"tau_drafter": 2.8629}}))  # the acceptance stage's key
    assert R["json"](tmp_path, "results/perf/acc.json", "bench", "gsm8k.tau_drafter", "3") == "2.863"
    assert R["json"](tmp_path, "results/perf/acc.json", "bench", "gsm8k.tau_drafter") == "2.86"
    assert R["bench_batch"](tmp_path, "b", "2", "512", "16", "ratio") == "1.38"
    assert R["bench_batch"](tmp_path, "b", "2", "512", "1", "ms") == "4.41"
    for call, says in ((lambda: R["json"](tmp_path, "results/perf/b.json", "eager_ms"), "no 'eager_ms'"),
                       (lambda: R["json"](tmp_path, "results/perf/b.json", "label"), "is not a number"),
                       (lambda: R["bench_batch"](tmp_path, "b", "4", "512", "16", "ms"), "0 rows at B=4")):
        with pytest.raises(UsageError, match=says):
            call()


@pytest.mark.parametrize("sub", ["missing", "empty"])
def test_a_root_without_any_readme_is_refused(tmp_path, capsys, sub):
    """--root /nonexistent printed '0 READMEs: 0 failing' and passed: a typo checked nothing."""
    root = tmp_path / sub
    if sub == "empty":
        root.mkdir()
    assert rn.main(["--check", "--root", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --root {root}: ") and err.count("\n") == 1, err
    assert ("no such folder" if sub == "missing" else "no README to check") in err


def test_check_and_write_read_the_files_anew(tmp_path, monkeypatch):
    """The JSON files and a sweep's step breakdown are cached while one check or write quotes them many times; each
    check and write starts with both caches empty, so a file rewritten between two of them in one process is read
    again: a number that went stale fails the second check."""
    import harness.lab.readme_numbers_more as more
    (tmp_path / "results").mkdir()
    src = tmp_path / "results" / "n.json"
    src.write_text(json.dumps({"ms": 4.25}))
    (tmp_path / "README.md").write_text("step <!--n:json:results/n.json:ms:2-->4.25<!--/n--> ms\n")
    assert not [f for f in rn.check(tmp_path) if f.kind != "untraced"]
    src.write_text(json.dumps({"ms": 5.12}))
    assert [f for f in rn.check(tmp_path) if f.kind != "untraced"]
    assert rn.write(tmp_path) == ["README.md"] and "5.12" in (tmp_path / "README.md").read_text()
    # a sweep's breakdown (its reads stubbed): cached within a check, emptied when the next one starts
    sweep = tmp_path / "results" / "sweeps" / "s"
    sweep.mkdir(parents=True)
    (sweep / "sweep.json").write_text(json.dumps({"arms": ["AR"], "reference": "AR"}))
    from harness.protocol import results_io, sweep_steps
    monkeypatch.setattr(results_io, "read_folder_rows", lambda folder: [])
    monkeypatch.setattr(sweep_steps, "breakdown", lambda rows, arms, ref: [])
    more._sweep_steps(tmp_path, "s")
    assert more._sweep_steps.cache_info().currsize == 1
    rn.check(tmp_path)
    assert more._sweep_steps.cache_info().currsize == 0
