"""The paired protocol end to end on tiny models: bench_fair_fast.sh, the results folder, --resume, bad input."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import benchmark_compile_all as cli
import harness.protocol.runner as runner
from harness.protocol.results_io import read_folder_rows, read_rows
from tiny import write_run_fixture

# tiny shapes: one intra-op thread (conftest.one_thread), as the other tiny-model modules run
pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]
TIMING = {"ttft_s", "drafter_prefill_s", "decode_s", "run_id"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    # the two-turn prompt first: --max-samples 2 (fair_args, the script's MAX_SAMPLES) takes rows [2, 0]
    rows = [{"turns": ["Name a colour.", "Another?"]}, {"turns": ["Add 2 and 3."]}, {"turns": ["Count to 4."]}]
    return write_run_fixture(tmp_path_factory.mktemp("proto"), rows, xpress_std=0.02, markov_std=0.02)


def fair_args(files, results, *extra):
    """6 new tokens: greedy blocks of 4, so each decode still takes more than one step; 2 of the 3 prompts (the
    two-turn one among them): a run here decodes 6 rounds x 5 arms x 3 turns."""
    return ["--model-name-or-path", str(files / "target"), "--draft-name-or-path", str(files / "drafter"),
            "--xpress-refiner-path", str(files / "xpress.pt"), "--markov-refiner-path", str(files / "markov.pt"),
            "--dataset", "mini", "--data-dir", str(files / "data"), "--max-new-tokens", "6", "--device", "cpu",
            "--fair-interleave", "--fair-k-list", "1,2", "--max-samples", "2", "--results-dir", str(results), *extra]


def test_bench_fair_fast_script_end_to_end(files, tmp_path):
    env = {**os.environ, "TARGET": str(files / "target"), "DRAFT": str(files / "drafter"),
           "XPRESS_CKPT": str(files / "xpress.pt"), "MK_CKPT": str(files / "markov.pt"),
           "DATA_DIR": str(files / "data"),
           "MAX_SAMPLES": "2", "MAX_NEW_TOKENS": "8", "K_LIST": "1,3", "BLOCK": "4", "DEVICE": "cpu",
           "OUTDIR": str(tmp_path / "out")}
    proc = subprocess.run(["bash", str(ROOT / "bench_fair_fast.sh"), "mini", "0.0"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "K_LIST=1,3" in proc.stdout and "round 6/6" in proc.stdout  # 0.0 parsed as greedy; 5 arms + 1 warmup
    (folder,) = list((tmp_path / "out").iterdir())
    names = set(os.listdir(folder))
    assert {"config.json", "env.json", "samples.jsonl.gz", "summary.json", "table.md", "table.csv",
            "tau_vs_K.png", "speedup_vs_K.png", "acceptance_per_position.png"} <= names
    assert "samples.jsonl" not in names  # the rows appended while it ran: gzip'd at its end
    rows = read_rows(folder / "samples.jsonl.gz")
    arms = {"AR", "drafter-only", "Markov", "xPress(K=1)", "xPress(K=3)"}
    assert {r["arm"] for r in rows} == arms
    assert len(rows) == 6 * 5 * 3  # rounds x arms x turns: MAX_SAMPLES=2 reached the CLI (2 of the 3 prompts,
    assert {r["dataset_row"] for r in rows} == {0, 2}  # the two-turn one among them: data.subset_rows)
    config = json.loads((folder / "config.json").read_text())
    order = config["resolved"]["rotation"]
    plan = config["resolved"]["prompt_rows"]  # question id i is dataset row plan[i] (the subset's order)
    assert sorted(plan) == [0, 2] and all(r["dataset_row"] == plan[r["question_id"]] for r in rows)
    measured = order[1:]
    for slot in range(5):  # every arm in every slot exactly once over the measured rounds
        assert {r[slot] for r in measured} == arms
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["arms"]["xPress(K=1)"]["speedup"]["n"] == 5
    # issue 27: each row records its slot in the round and its replicate's seed; the design is a Latin square
    for r in rows:
        assert r["slot"] == order[r["round"] - 1].index(r["arm"]) + 1
        assert r["stream_seed"] == runner.stream_seed(0, r["dataset_row"], r["turn"], r["round"])
    assert summary["design"]["latin_square"] is True and summary["design"]["imbalance"] == 0
    for r in rows:  # greedy: every arm reproduces the AR tokens
        ar = next(x for x in rows if x["arm"] == "AR" and (x["question_id"], x["turn"], x["round"]) ==
                  (r["question_id"], r["turn"], r["round"]))
        assert r["tokens"] == ar["tokens"]


def strip(rows):
    return sorted((json.dumps({k: v for k, v in r.items() if k not in TIMING}, sort_keys=True) for r in rows))


@pytest.fixture(scope="module")
def traced_full_run(files, tmp_path_factory):
    """One uninterrupted run, made once, traced (rows from the timed decodes), its render_prompt calls counted; read
    only (a test copies it to change it): the folder, a copy of its trace as it finished, the calls' lengths. No
    plots drawn (no_plots): the tests that read them draw them (--rebuild, the plots-interrupted resume)."""
    from harness.protocol import report
    folder, calls, real = tmp_path_factory.mktemp("full"), [], runner.render_prompt
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(report, "write_plots", lambda *a, **k: [])
        mp.setattr(runner, "render_prompt", lambda tok, messages: calls.append(len(messages)) or real(tok, messages))
        assert cli.main(fair_args(files, folder, "--run-id", "a", "--trace", str(folder / "a.jsonl"))) == 0
    shutil.copy(folder / "a.jsonl", reference := folder / "reference.jsonl")
    return folder / "a", reference, calls


@pytest.fixture(scope="module")
def full_run(traced_full_run):
    return traced_full_run[0]


def test_killed_and_resumed_run_gives_the_same_rows_and_trace(files, traced_full_run, tmp_path, monkeypatch,
                                                                no_plots):
    """Killed in round 2 and resumed: the rows of the module's uninterrupted run, none lost or duplicated. Traced as
    that run was: the resumed process appends to the trace (it truncated it, losing the decodes the first process
    traced and the resume reuses). One killed run serves both checks (rows come from the timed decodes anyway)."""
    def units(path):
        return {(r["round"], r["arm"], r["question_id"]) for r in map(json.loads, path.read_text().splitlines())}
    expected, calls, real = read_folder_rows(traced_full_run[0]), {"n": 0}, runner.generate

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 25:  # the warmup makes 5 calls, a round 15: this dies in the middle of round 2
            raise KeyboardInterrupt
        return real(*a, **k)

    part, trace = tmp_path / "part", tmp_path / "b.jsonl"
    monkeypatch.setattr(runner, "generate", flaky)
    assert cli.main(fair_args(files, part, "--run-id", "b", "--trace", str(trace))) == 130
    monkeypatch.setattr(runner, "generate", real)
    partial = read_rows(part / "b" / "samples.jsonl")  # an interrupted run's rows: plain, appended as it went
    assert not (part / "b" / "samples.jsonl.gz").exists()
    assert 0 < len(partial) < len(expected)
    first = units(trace)
    assert cli.main(fair_args(files, part, "--resume", str(part / "b"))) == 0
    resumed = read_rows(part / "b" / "samples.jsonl.gz")
    assert not (part / "b" / "samples.jsonl").exists()
    assert strip(resumed) == strip(expected)  # nothing lost, nothing duplicated
    assert first < units(trace) == units(traced_full_run[1])


def test_resume_of_a_finished_run_is_refused_and_leaves_its_files_alone(full_run, tmp_path, capsys, monkeypatch):
    """Every decode already in the rows: nothing would run, and a resume would rewrite env.json with this
    machine and label the tables resumed; refused in one line before any model loads, every file unchanged."""
    folder = tmp_path / "f"
    shutil.copytree(full_run, folder)  # a finished run (the module's, copied: this test changes it)
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    monkeypatch.setattr(runner, "load_models", lambda *a, **k: pytest.fail("a model was loaded"))
    capsys.readouterr()
    assert cli.main(["--resume", str(folder), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the run is finished" in err[0] and "--rebuild" in err[0], err
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before
    monkeypatch.undo()  # a run that stopped after its last decode, before its summary: the resume finishes it
    (folder / "summary.json").unlink()  # its rows were gzip'd already: the resume reads them and appends to none
    # ... and one stopped while its plots are drawn: summary.json is written last (it marks the run finished), so the
    # interruption leaves none and --resume is not refused. Its report (the one a fresh run ends with) stops there:
    (folder / "table.md").unlink()  # (written again before the plots)
    from harness.protocol import report
    monkeypatch.setattr(report, "write_plots", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert cli.main(["--resume", str(folder), "--quiet"]) == 130
    assert (folder / "table.md").is_file() and not (folder / "summary.json").exists()
    monkeypatch.undo()
    assert not list(folder.glob("*.png"))  # (the module's run drew none)
    assert cli.main(["--resume", str(folder), "--quiet"]) == 0  # it writes the plots and the summary
    assert (folder / "samples.jsonl.gz").read_bytes() == before["samples.jsonl.gz"]  # the same rows, the same bytes
    assert not (folder / "samples.jsonl").exists()
    assert (folder / "summary.json").is_file() and list(folder.glob("*.png"))


def test_rebuild_refuses_two_runs_of_one_dataset_before_rewriting_either(full_run, tmp_path, capsys, monkeypatch):
    from harness.protocol import report
    shutil.copytree(full_run, tmp_path / "a")  # the module's run, copied (rebuilt below)
    shutil.copytree(full_run, tmp_path / "b")  # a second run of mini at T=0 (distinct() keys on dataset and T)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    capsys.readouterr()
    rebuilt = []
    monkeypatch.setattr(report, "rebuild", lambda f: rebuilt.append(f))  # a rebuild before the check shows here
    assert report.main(["--rebuild", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "are both mini at T=0" in err[0], err
    assert rebuilt == [] and {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    monkeypatch.undo()
    assert not list((tmp_path / "a").glob("*.png"))  # the module's run drew none (no_plots); --rebuild draws them
    assert report.main(["--rebuild", str(tmp_path / "a")]) == 0 and list((tmp_path / "a").glob("*.png"))


def test_resume_refuses_other_settings(files, full_run, tmp_path, capsys):
    shutil.copytree(full_run, tmp_path / "r")  # the module's run (check_resume runs before the finished check)
    assert cli.main(fair_args(files, tmp_path, "--resume", str(tmp_path / "r"), "--max-new-tokens", "11")) == 2
    err = capsys.readouterr().err
    assert "other settings (--max-new-tokens); drop those flags" in err and "--resume DIR alone" in err


def bad_jsonl(files, tmp_path):
    (d := tmp_path / "bad").mkdir()
    (d / "mini.jsonl").write_text('{"turns": ["ok"]}\n{"turns": "not a list"}\n')
    return d


# went through without a word: past the positions trained at; capped to block - 1; nan decoded, broke the tables;
# a first turn (17 tokens) with no room for a block of 4: the speculative arms never speculated
EXTRA = {"max_samples0": ["--max-samples", "0"], "past_positions": ["--max-model-len", "100000"],
         "no_room": ["--max-model-len", "20"],
         "scripted_over_block": ["--block-size", "4", "--scripted-accept", "4"],
         "temperature_nan": ["--temperature=nan"], "draft_temperature_inf": ["--draft-temperature=-inf"],
         "top_p_inf": ["--top-p=inf"]}


@pytest.mark.parametrize("case, message", [
    ("unknown_dataset", "unknown"),
    ("missing_file", "mini2.jsonl"),
    ("malformed_row", "mini.jsonl:2"),
    ("empty_k", "--fair-k-list"),
    ("k0", "every K must be >= 1"),
    ("max_samples0", "--max-samples"),
    ("rounds", "no measured round"),
    ("unwritable", "is a file, not a folder"),
    ("scripted_over_block", "--scripted-accept 4: block 4 holds at most 3 drafts a step"),
    ("interleave0", "--fair-interleave 0: must be >= 1 (or given without a value)"),
    ("interleave_negative", "--fair-interleave -1: must be >= 1 (or given without a value)"),
    ("passes0", "--xpress-refine-passes 0 in the paired protocol would add an xPress arm at K=0"),
    ("k_twice", "--fair-k-list 1,2,1: K=1 is listed twice"),
    ("k_unpaired", "--fair-k-list takes effect only with --fair-interleave"),
    ("warmup_unpaired", "--fair-warmup-rounds takes effect only with --fair-interleave"),
    ("temperature_nan", "--temperature nan: must be a finite number"),
    ("draft_temperature_inf", "--draft-temperature -inf: must be a finite number"),
    ("top_p_inf", "--top-p inf: must be a finite number"),
    ("run_id_up", "--run-id '../escape': must be a plain folder name"),
    ("run_id_absolute", "must be a plain folder name"),
    ("past_positions", "above the target's max_position_embeddings"),
    ("drafter_only_k", "--drafter-only runs no xPress arm"),
    ("no_room", "with block 4 a speculative step needs 22 positions, over the context limit 20"),
])
def test_bad_protocol_input_fails_before_loading(files, tmp_path, case, message, capsys, monkeypatch):
    monkeypatch.setattr(runner, "load_target", lambda *a, **k: pytest.fail("a model was loaded"))
    argv = fair_args(files, tmp_path / "res")
    if case == "unknown_dataset":
        i = argv.index("--data-dir")
        del argv[i:i + 2]
        argv[argv.index("--dataset") + 1] = "nosuchset"
    elif case == "missing_file":
        argv[argv.index("--dataset") + 1] = "mini2"
    elif case == "malformed_row":
        argv[argv.index("--data-dir") + 1] = str(bad_jsonl(files, tmp_path))
    elif case in ("empty_k", "k0", "k_twice"):  # k_twice ran two arms named xPress(K=1); the report kept one
        argv[argv.index("--fair-k-list") + 1] = {"empty_k": ",", "k0": "0,2", "k_twice": "1,2,1"}[case]
    elif case in EXTRA:
        argv += EXTRA[case]
    elif case == "rounds":
        argv[argv.index("--fair-interleave")] = "--fair-interleave=1"
    elif case == "unwritable":
        (tmp_path / "afile").write_text("")  # a path below a plain file (root ignores permission bits)
        argv[argv.index("--results-dir") + 1] = str(tmp_path / "afile" / "x")
    elif case in ("interleave0", "interleave_negative"):  # 0 ran as the bare flag without a word
        argv[argv.index("--fair-interleave")] = "--fair-interleave=" + ("0" if case == "interleave0" else "-1")
    elif case == "passes0":  # the K list from --xpress-refine-passes: an xPress arm at K=0 ran as drafter-only
        i = argv.index("--fair-k-list")
        del argv[i:i + 2]
        argv += ["--xpress-refine-passes", "0"]
    elif case in ("k_unpaired", "warmup_unpaired"):  # ignored without a word: one round of AR and the default K
        argv.remove("--fair-interleave")
        if case == "warmup_unpaired":
            i = argv.index("--fair-k-list")
            argv[i:i + 2] = ["--fair-warmup-rounds", "2"]
    elif case in ("run_id_up", "run_id_absolute"):  # wrote the run outside --results-dir
        argv += ["--run-id", "../escape" if case == "run_id_up" else str(tmp_path / "abs")]
    elif case == "drafter_only_k":  # the K list was ignored without a word (the embedded default's heads dropped)
        for flag in ("--xpress-refiner-path", "--markov-refiner-path"):
            i = argv.index(flag)
            del argv[i:i + 2]
        argv += ["--drafter-only"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "\n" not in err, err
    assert not (tmp_path / "res").exists() and not (tmp_path / "escape").exists() and not (tmp_path / "abs").exists()


def test_random_weights_and_scripted_acceptance(files, tmp_path, capsys, no_plots):
    # one prompt (--max-samples 1): what is checked is per arm and per row, the same for every prompt
    argv = ["--random-weights", "tiny", "--dataset", "mini", "--data-dir", str(files / "data"), "--device", "cpu",
            "--max-samples", "1", "--max-new-tokens", "9", "--scripted-accept", "3", "--fair-interleave",
            "--fair-k-list", "1,2",
            "--results-dir", str(tmp_path), "--run-id", "rw", "--trace", str(tmp_path / "trace.jsonl")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    labels = ["random weights / scripted acceptance", "traced (steps replayed untimed)"]
    assert f"[{'; '.join(labels)}]" in out
    summary = json.loads((tmp_path / "rw" / "summary.json").read_text())
    assert summary["labels"] == labels  # every request lands on its 17 tokens exactly: no step cut, no "tau capped"
    # labels wherever a reader looks: the table's title line, a column of every CSV row, the folder's README
    title = (tmp_path / "rw" / "table.md").read_text().splitlines()[0]
    assert title.startswith(f"**RESULT  [{'; '.join(labels)}]")
    assert "max_new_tokens=9" in title and "rounds=6 (warmup [1] excluded, measured [2, 3, 4, 5, 6])" in title
    csv_rows = (tmp_path / "rw" / "table.csv").read_text().splitlines()
    assert csv_rows[0].endswith(",labels") and all(r.endswith("; traced (steps replayed untimed)")
                                                     for r in csv_rows[1:])
    assert "Conventions" in (tmp_path / "rw" / "README.md").read_text() and "\n  tau_per_step:" not in out
    assert (tmp_path / "trace.jsonl").read_text().count("\n") > 0
    config = json.loads((tmp_path / "rw" / "config.json").read_text())
    assert config["resolved"]["label"] == "random weights / scripted acceptance"
    assert config["resolved"]["kernels"] == "torch"  # auto: the Triton kernels only on CUDA
    assert set(summary["arms"]) == {"AR", "drafter-only", "Markov", "xPress(K=1)", "xPress(K=2)"}
    for name, arm in summary["arms"].items():
        # 8 decode tokens: two steps of 3 accepted drafts + 1, exactly (no stop ids with random weights)
        assert arm["tau_per_step"] == (1.0 if name == "AR" else 4.0), name
    rows = read_folder_rows(tmp_path / "rw")
    assert all(r["new_tokens"] == 9 and r["stop_reason"] == "max_new_tokens" for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["--random-weights", "nope"], "unknown preset"),
    (["--random-weights", "tiny", "--model-name-or-path", "x"], "drop the model"),
    (["--scripted-accept", "-1"], "--scripted-accept"),
    (["--kernels", "triton", "--device", "cpu"], "--kernels triton"),
    (["--kernels", "triton", "--attn-implementation", "eager"], "--kernels triton"),
])
def test_timing_flags_refuse_bad_input(files, tmp_path, argv, message, capsys):
    base = ["--dataset", "mini", "--data-dir", str(files / "data"), "--results-dir", str(tmp_path)]
    if "--random-weights" not in argv:
        base += ["--random-weights", "tiny"]
    assert cli.main(base + argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("extra, expect", [({}, "triton"), ({"compat_reference": True}, "torch"),
                                           ({"attn_implementation": "eager"}, "torch")])
def test_kernels_auto_keeps_torch_ops_for_reference_numerics(monkeypatch, extra, expect):
    """--kernels auto picks the Triton ops on CUDA bf16, but not under --compat-reference or an explicit
    --attn-implementation eager; decided from the config alone (no CUDA, no weights needed)."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    from core import kernels
    from harness.protocol import runner
    from harness.protocol.config import RunConfig
    from tiny import tiny_config
    monkeypatch.setattr(kernels, "available", lambda: True)
    plan = SimpleNamespace(backend=SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16),
                           target_config=tiny_config(), config=dataclasses.replace(RunConfig("t", "d", "mini"), **extra))
    assert runner.choose_ops(plan).name == expect


def test_a_run_reports_the_calls_its_kernels_handed_to_torch_ops(files, tmp_path, capsys, monkeypatch, no_plots):
    """Decode-sized calls the Triton ops did not take (a slower step than the kernels') are printed after the
    table and kept in summary.json, never silent."""
    from collections import Counter

    from core.ops import TorchOps

    class Leaky(TorchOps):  # stands in for TritonOps after some calls fell back
        fallbacks = Counter({("linear", "a bias"): 3})

    monkeypatch.setattr(runner, "choose_ops", lambda plan: Leaky())
    argv = ["--random-weights", "tiny", "--dataset", "mini", "--data-dir", str(files / "data"), "--device", "cpu",
            "--max-samples", "1", "--max-new-tokens", "6", "--xpress-refine-passes", "1",
            "--results-dir", str(tmp_path), "--run-id", "fb"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    note = "[kernels] decode-sized calls the Triton kernels do not take ran on torch ops"
    assert note in out and out.index("RESULT") < out.index(note)  # after the table
    assert "linear (a bias) x3" in out
    summary = json.loads((tmp_path / "fb" / "summary.json").read_text())
    assert summary["kernel_fallbacks"] == {"linear: a bias": 3}
    monkeypatch.setattr(runner, "choose_ops", lambda plan: TorchOps())  # none: no line, no key
    assert cli.main(argv[:-1] + ["fb2"]) == 0
    assert "[kernels]" not in capsys.readouterr().out
    assert "kernel_fallbacks" not in json.loads((tmp_path / "fb2" / "summary.json").read_text())


def test_one_ops_object_reaches_target_drafter_and_every_refiner():
    """The ops chosen once are the ones every model of the run holds (construction-time injection)."""
    from core.ops import TorchOps
    from harness.protocol.presets import build_random
    from tiny import CPU32
    ops = TorchOps()
    m = build_random("tiny", CPU32, block_size=4, ops=ops)
    assert m.target.ops is ops and m.drafter.ops is ops
    assert m.refiner("xpress", 2).ops is ops and m.refiner("markov").ops is ops


def test_first_turns_are_rendered_once_per_prompt_not_per_arm_and_round(traced_full_run):
    # a first turn is the same for every arm and round: the runner renders it once per prompt (later turns depend
    # on each arm's own replies and are rendered each time); counted in the module's run (a replay reuses the prompt)
    rows, calls = read_folder_rows(traced_full_run[0]), traced_full_run[2]
    arms, rounds = {r["arm"] for r in rows}, {r["round"] for r in rows}
    firsts = sum(1 for n in calls if n == 1)
    assert len(arms) == 5 and len(rounds) >= 2
    assert firsts <= 2 * 2 + 1  # presize's length check and one render each for 2 prompts, the warmup's prompt
    # the two-turn prompt's second turn, every time, and once with empty replies for presize's bound (prompt_bound)
    assert sum(1 for n in calls if n == 3) == len(arms) * len(rounds) + 1


def test_a_saved_config_with_a_non_finite_temperature_is_refused(full_run, tmp_path, capsys):
    """--resume takes config.json's values without parsing them as flags: validate checks them too."""
    shutil.copytree(full_run, tmp_path / "r")  # the module's run (parse_args validates before the finished check)
    path = tmp_path / "r" / "config.json"
    path.write_text(path.read_text().replace('"temperature": 0.0', '"temperature": NaN'))
    assert cli.main(["--resume", str(tmp_path / "r")]) == 2
    assert "--temperature nan: must be a finite number" in capsys.readouterr().err
