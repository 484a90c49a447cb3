"""Tiny end-to-end runs as a new user meets them: progress, resume, provenance, plots and bench_fair_fast.sh."""
import gzip
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

import benchmark_compile_all as cli
from core.errors import UsageError
import harness.protocol.runner as runner
from harness.protocol import plots, results_io
from harness.protocol.results_io import read_rows
from tiny import write_run_fixture

# tiny shapes: one intra-op thread (conftest.one_thread), as the other tiny-model modules run
pytestmark = pytest.mark.usefixtures("one_thread")


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    rows = [{"turns": ["Add 2 and 3."]}, {"turns": ["Name a colour."]}]
    return write_run_fixture(tmp_path_factory.mktemp("fh_runs"), rows, xpress_std=0.02, markov_std=0.02)


def fair(files, results, *extra, refiners=True):
    heads = ["--xpress-refiner-path", str(files / "xpress.pt"), "--markov-refiner-path", str(files / "markov.pt")]
    return ["--model-name-or-path", str(files / "target"), "--draft-name-or-path", str(files / "drafter"),
            *(heads if refiners else []), "--dataset", "mini", "--data-dir", str(files / "data"),
            "--max-new-tokens", "6", "--device", "cpu", "--fair-interleave", "--fair-k-list", "1,2",
            "--results-dir", str(results), *extra]


@pytest.fixture(scope="module")
def shown_run(files, tmp_path_factory):
    """One full run (2 prompts, 5 arms), made once, as a person at a terminal sees it: its folder, the order of its
    generations and progress updates, its stderr, and the figures its plots were drawn on (one run serves the
    progress test and the plots test; neither's checks depend on the other's spies)."""
    import contextlib
    import io
    events, err, folder = [], io.StringIO(), tmp_path_factory.mktemp("shown")
    real_generate, real_show = runner.generate, runner.show_progress

    def generate(*a, **k):
        events.append("start")
        g = real_generate(*a, **k)
        events.append("end")
        return g

    def show(bar, *a):
        events.append("progress")
        return real_show(bar, *a)

    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err):
        mp.setattr(runner, "generate", generate)
        mp.setattr(runner, "show_progress", show)
        mp.setattr(runner, "on_terminal", lambda: True)
        try:  # matplotlib is optional (requirements.txt): without it the run draws none, and the plots test skips
            seen = _figures(mp)
        except ImportError:
            seen = None
        assert cli.main(fair(files, folder, "--run-id", "full")) == 0
    return folder / "full", events, err.getvalue(), seen


def test_progress_shows_arm_prompt_rate_and_stays_between_decodes(files, shown_run, tmp_path, monkeypatch, capsys,
                                                                  no_plots):
    _, events, err, _ = shown_run
    assert "tok/s" in err and "prompt 2/2" in err and "round 6/6" in err and "xPress(K=2)" in err
    assert events.count("progress") == 6 * 5 * 2  # rounds x arms x prompts: one update per finished decode
    inside = False
    for e in events:  # never while a (timed) generation runs
        inside = {"start": True, "end": False}.get(e, inside)
        assert not (e == "progress" and inside)
    events = []  # (one prompt from here: these runs only show no progress)
    monkeypatch.setattr(runner, "show_progress", lambda *a: events.append("progress"))
    monkeypatch.setattr(runner, "on_terminal", lambda: True)
    assert cli.main(fair(files, tmp_path, "--run-id", "q", "--quiet", "--max-samples", "1")) == 0
    assert "progress" not in events and "tok/s" not in capsys.readouterr().err
    monkeypatch.setattr(runner, "on_terminal", lambda: False)
    assert cli.main(fair(files, tmp_path, "--run-id", "r", "--max-samples", "1")) == 0
    assert "progress" not in events and "tok/s" not in capsys.readouterr().err


def test_ctrl_c_prints_the_resume_command_and_resume_dir_alone_finishes(files, tmp_path, monkeypatch, capsys,
                                                                        no_plots):
    calls = {"n": 0}
    real = runner.generate

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 17:  # 5 warmup generations, round 1 (10 decodes), then part of round 2
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(runner, "generate", flaky)
    assert cli.main(fair(files, tmp_path, "--run-id", "c")) == 130
    err = capsys.readouterr().err
    line = next(x.strip() for x in err.splitlines() if "--resume" in x)
    argv = shlex.split(line)
    folder = str(tmp_path / "c")
    assert argv[:2] == ["python3", "benchmark_compile_all.py"] and argv[2:] == ["--resume", folder]
    saved = len(read_rows(Path(folder) / "samples.jsonl"))  # interrupted: the plain rows it appended
    monkeypatch.setattr(runner, "generate", real)
    assert cli.main(argv[2:]) == 0  # --resume DIR and nothing else: config.json has every setting
    out = capsys.readouterr().out
    assert f"reusing {saved} of 60 (round, arm, prompt) decodes" in out
    assert len(read_rows(Path(folder) / "samples.jsonl.gz")) == 60 and not (Path(folder) / "samples.jsonl").exists()
    argv = script_argv(tmp_path, {**os.environ, "RESUME": folder}, rc=2)  # the same through the script: it
    assert argv == ["--resume", folder] and cli.main(argv) == 2  # passes --resume DIR alone and the exit code on;
    assert "the run is finished" in capsys.readouterr().err  # the run is finished now, so the resume is refused
    assert len(read_rows(Path(folder) / "samples.jsonl.gz")) == 60  # and its files are kept


def git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def test_git_dirty_ignores_the_runs_own_output(tmp_path):
    repo = tmp_path / "repo"
    (repo / "results").mkdir(parents=True)
    (repo / "code.py").write_text("x = 1\n")
    git(repo, "init", "-q")
    git(repo, "add", "code.py")
    git(repo, "commit", "-q", "-m", "c")
    run = repo / "results" / "run1"
    run.mkdir()
    (run / "samples.jsonl").write_text("{}\n")
    env = results_io.environment(exclude=[run], repo=repo)
    assert env["git_dirty"] is False and env["git_untracked_files"] == 0
    assert "untracked-files=no" in env["git_dirty_counts"]
    # an earlier run's --run-id folder (untracked, not ignored) used to make every later run dirty: counted apart
    (repo / "results" / "X").mkdir()
    (repo / "results" / "X" / "summary.json").write_text("{}\n")
    env = results_io.environment(exclude=[run], repo=repo)
    assert env["git_dirty"] is False and env["git_untracked_files"] == 1
    assert results_io.environment(repo=repo)["git_untracked_files"] == 2
    (repo / "code.py").write_text("x = 2\n")  # a tracked file changed: dirty
    assert results_io.environment(exclude=[run], repo=repo)["git_dirty"] is True


def _figures(monkeypatch):
    from matplotlib.figure import Figure
    seen = []
    real = Figure.savefig

    def savefig(self, *a, **k):
        seen.append(self)
        return real(self, *a, **k)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return seen


def test_plots_colour_per_method_ar_line_titles_and_no_empty_k_plots(files, shown_run, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex
    folder, _, _, seen = shown_run
    names = {p.name for p in folder.glob("*.png")}
    assert names == {"summary_by_arm.png", "tau_vs_K.png", "speedup_vs_K.png", "acceptance_per_position.png"}
    summary = json.loads((folder / "summary.json").read_text())
    colors = plots.arm_colors(summary["arms"])
    assert to_hex(colors["Markov"]) == plots.COLORS["markov"]
    assert to_hex(colors["xPress(K=2)"]) == plots.COLORS["xpress"]
    by_arm, tau_k, speed_k, per_pos = seen
    for fig in seen:
        title = fig.axes[0].get_title()
        assert "target" in title and "mini" in title and "T=0" in title and "2 prompts x 5 measured rounds" in title
    for ax in (by_arm.axes[0], by_arm.axes[1], tau_k.axes[0], speed_k.axes[0]):
        ones = [ln for ln in ax.get_lines() if ln.get_label() == "AR = 1" and list(ln.get_ydata()) == [1.0, 1.0]]
        assert ones and to_hex(ones[0].get_color()) == plots.COLORS["ar"]
        lo, hi = ax.get_ylim()
        assert lo < 1 < hi
    bars = {p.get_x(): to_hex(p.get_facecolor()) for p in by_arm.axes[0].patches}
    assert list(bars.values())[0] == plots.COLORS["ar"] and list(bars.values())[2] == plots.COLORS["markov"]
    refs = {ln.get_label().split(" (")[0]: to_hex(ln.get_color()) for ln in speed_k.axes[0].get_lines()}
    assert refs["drafter-only"] == plots.COLORS["drafter-only"] and refs["Markov"] == plots.COLORS["markov"]
    pos = {ln.get_label(): to_hex(ln.get_color()) for ln in per_pos.axes[0].get_lines()}
    assert pos["Markov"] == plots.COLORS["markov"] and pos["drafter-only"] == plots.COLORS["drafter-only"]
    plain = fair(files, tmp_path, "--run-id", "plain", "--quiet", "--max-samples", "1", refiners=False)
    assert cli.main(plain) == 0
    assert {p.name for p in (tmp_path / "plain").glob("*.png")} == {"summary_by_arm.png",
                                                                      "acceptance_per_position.png"}


def test_speedup_error_bars_are_the_ci(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    seen = _figures(monkeypatch)
    arm = lambda name, method, K, sp: {"arm": name, "method": method, "K": K, "tau_per_step": 2.0, "per_position": [],
                                       "speedup": sp}
    summary = {"temperature": 0.0, "prompts": 3, "rounds": {"measured": [2]}, "reference_arm": "AR",
               "label": "random weights", "arms": {"AR": arm("AR", "ar", None, {"value": 1.0, "ci95": [1.0, 1.0]}),
                        "xPress(K=4)": arm("xPress(K=4)", "xpress", 4, {"value": 1.5, "mean": 1.4,
                                                                        "ci95": [1.2, 1.9]})}}
    plots.write_plots(tmp_path, summary, "gsm8k")
    speed = seen[2].axes[0]
    assert "[random weights]" in speed.get_title() and "1 measured round" in speed.get_title()
    (bars,) = [c for c in speed.collections if c.get_segments() and len(c.get_segments()) == 1]
    ((x0, y0), (x1, y1)) = bars.get_segments()[0]
    assert (x0, x1) == (4, 4) and (round(y0, 9), round(y1, 9)) == (1.2, 1.9)


def run_script(tmp_path, env, *args, rc=0):
    """Runs bench_fair_fast.sh with a python3 on PATH that hands its -c checks to the real one and records the
    command the script execs (benchmark_compile_all.py's argv) instead of running it, exiting with rc (the script
    must pass it on: it execs). Returns the process and that argv (None: the script never reached its exec)."""
    import sys
    shim, out = tmp_path / "bin", tmp_path / "argv"
    shim.mkdir(exist_ok=True)
    out.unlink(missing_ok=True)  # a run that never reaches its exec must not read an earlier run's argv
    (shim / "python3").write_text(f'#!/usr/bin/env bash\nif [ "$1" = benchmark_compile_all.py ]; then shift; '
                                  f'printf "%s\\0" "$@" > {shlex.quote(str(out))}; exit {rc}; fi\n'
                                  f'exec {shlex.quote(sys.executable)} "$@"\n')
    (shim / "python3").chmod(0o755)
    env = {**env, "PATH": f"{shim}{os.pathsep}{env.get('PATH', '')}"}
    proc = subprocess.run(["bash", str(ROOT / "bench_fair_fast.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=600)
    return proc, out.read_text().split("\0")[:-1] if out.exists() else None


def script_argv(tmp_path, env, *args, rc=0):
    """run_script's argv, the exit code checked: the script's exit code and the argv it builds are its behaviour;
    the CLI then runs in-process (no interpreter start, no torch import). test_protocol's script run execs the real
    python3."""
    proc, argv = run_script(tmp_path, env, *args, rc=rc)
    assert proc.returncode == rc and argv is not None, proc.stderr[-2000:]
    return argv


@pytest.mark.parametrize("args, env, says", [(["--dataset", "gsm8k"], {}, "'--dataset' is not a dataset"),
                                             (["gsm8k", "0", "extra"], {}, "3 arguments (gsm8k 0 extra)"),
                                             (["gsm8k"], {"USE_GRAPH": "yes"}, "USE_GRAPH='yes': use 1"),
                                             (["gsm8k", "x"], {}, "temperature 'x' is not a number")])
def test_the_bench_script_refuses_what_it_would_drop_or_misread(tmp_path, args, env, says):
    """A flag where the dataset goes, a third argument and a USE_GRAPH that is neither 1 nor 0 were run as if
    absent (or failed later in the CLI's argument parser); one line, exit 2, nothing run. --help prints the
    header's usage and runs nothing."""
    base = {k: v for k, v in os.environ.items() if k not in ("USE_GRAPH", "RESUME", "EXTRA_ARGS")}
    proc, argv = run_script(tmp_path, {**base, **env}, *args)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and says in proc.stderr, proc.stderr
    assert argv is None
    proc, argv = run_script(tmp_path, base, "--help")
    assert proc.returncode == 0 and argv is None and proc.stdout.startswith("The paired protocol as one run")
    assert "EXTRA_ARGS" in proc.stdout and "set -e" not in proc.stdout


def test_bench_script_offline_random_weights_and_dropped_arms(files, tmp_path, monkeypatch, capsys, no_plots):
    env = {k: v for k, v in os.environ.items() if k not in ("DEVICE", "USE_GRAPH", "TARGET", "PRESET")}
    env.update(EXTRA_ARGS="--random-weights tiny --quiet", MAX_SAMPLES="1", MAX_NEW_TOKENS="4", K_LIST="1",
               OUTDIR=str(tmp_path / "rw"), ROUNDS="2")  # 2 rounds: only the run's settings are checked
    argv = script_argv(tmp_path, env)
    monkeypatch.chdir(ROOT)  # where the script runs it (cd "$(dirname "$0")"): data/eval/ and weights/ relative
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "random weights" in out and "use-graph" not in err and "--use-graph" not in argv  # CPU: no CUDA graphs
    (folder,) = (tmp_path / "rw").iterdir()
    config = json.loads((folder / "config.json").read_text())
    assert config["preset"] == "smollm2-135m" and config["use_graph"] is False and config["dataset"] == "gsm8k"
    assert config["resolved"]["arms"] == ["AR", "drafter-only", "Markov", "xPress(K=1)"]
    assert config["resolved"]["weights"] == {"random_weights": "tiny"}  # no files: the random preset names them
    env = {k: v for k, v in os.environ.items() if k not in ("DEVICE", "USE_GRAPH", "PRESET", "EXTRA_ARGS")}
    env.update(TARGET=str(files / "target"), DRAFT=str(files / "drafter"), XPRESS_CKPT="",
               MK_CKPT=str(files / "markov.pt"), DATA_DIR=str(files / "data"), MAX_SAMPLES="1", MAX_NEW_TOKENS="4",
               OUTDIR=str(tmp_path / "drop"), ROUNDS="2")
    assert cli.main(script_argv(tmp_path, env, "mini")) == 0
    (folder,) = (tmp_path / "drop").iterdir()
    resolved = json.loads((folder / "config.json").read_text())["resolved"]
    assert resolved["arms"] == ["AR", "drafter-only", "Markov"]
    # which weights it measured: the drafter folder's weight files and the Markov checkpoint, by content
    drafter = [f for f in (files / "drafter").rglob("*") if f.suffix in (".safetensors", ".bin")]
    assert resolved["weights"]["drafter"]["bytes"] == sum(f.stat().st_size for f in drafter) > 0
    assert resolved["weights"]["markov"]["bytes"] == (files / "markov.pt").stat().st_size
    assert resolved["weights"]["markov"]["files"] == 1 and len(resolved["weights"]["drafter"]["digest"]) == 16


def test_a_resume_with_other_weights_at_the_same_paths_is_refused(files, tmp_path, capsys, no_plots):
    """config.json records the drafter's and refiners' digests; a --resume after the weights at those paths
    changed would put two models' rows in one table: one line, exit 2, before any model loads, rows untouched.
    With the weights put back it resumes."""
    assert cli.main(fair(files, tmp_path, "--fair-k-list", "1", "--max-samples", "1", "--run-id", "r", "--quiet")) == 0
    folder = tmp_path / "r"
    rows = gzip.decompress((folder / "samples.jsonl.gz").read_bytes()).decode().splitlines()
    (folder / "samples.jsonl.gz").unlink()  # as if it stopped after its first decode
    (folder / "samples.jsonl").write_text(rows[0] + "\n")
    original = (files / "markov.pt").read_bytes()
    try:
        (files / "markov.pt").write_bytes(original + b"\0")
        capsys.readouterr()
        assert cli.main(["--resume", str(folder), "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "the markov weights differ" in err[0]
        assert (folder / "samples.jsonl").read_text() == rows[0] + "\n" and not (folder / "resumes.json").exists()
    finally:
        (files / "markov.pt").write_bytes(original)
    # a digest of another recipe (assets.DIGEST_SCHEME) is not compared: an older folder still resumes
    from harness.protocol.plan import check_resume_weights
    saved = json.loads((folder / "config.json").read_text())["resolved"]["weights"]
    changed = {**saved, "markov": {**saved["markov"], "digest": "0" * 16}}
    with pytest.raises(UsageError, match="the markov weights differ"):
        check_resume_weights(str(folder), changed)
    check_resume_weights(str(folder), {**changed, "markov": {**changed["markov"], "scheme": 0}})
    # arms this version names otherwise than the folder (an older version's names) are refused the same way
    config = (folder / "config.json").read_text()
    arms = json.loads(config)["resolved"]["arms"]
    (folder / "config.json").write_text(config.replace('"drafter-only"', '"drafter-only (co-trained)"'))
    capsys.readouterr()
    assert cli.main(["--resume", str(folder), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "started with" in err[0] and "drafter-only (co-trained)" in err[0], err
    assert (folder / "samples.jsonl").read_text() == rows[0] + "\n" and not (folder / "resumes.json").exists()
    (folder / "config.json").write_text(config)
    assert "drafter-only" in arms
    # a dataset file that changed since the run started (its sha256 in resolved.dataset), or other rows of it
    # (resolved.prompt_rows), would mix two prompt sets in one table: refused the same way
    data = next((files / "data").glob("mini*"))
    text = data.read_text()
    try:
        data.write_text(text.replace("Add 2 and 3.", "Add 2 and 4."))  # the same rows, one prompt edited
        capsys.readouterr()
        assert cli.main(["--resume", str(folder), "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"the dataset file {data} changed since it started (sha256 " in err[0] and \
            "put that data back" in err[0], err
    finally:
        data.write_text(text)
    saved = json.loads(config)
    resolved, saved["resolved"]["prompt_rows"] = dict(saved["resolved"]), [7]
    (folder / "config.json").write_text(json.dumps(saved, indent=2))
    assert cli.main(["--resume", str(folder), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "this harness picks 1 dataset row(s) for its prompts, the run planned 1 (config.json " \
        f"resolved.prompt_rows), first apart at question id 0 ({resolved['prompt_rows'][0]} against 7)" in err[0], err
    assert (folder / "samples.jsonl").read_text() == rows[0] + "\n" and not (folder / "resumes.json").exists()
    # a folder written before runs recorded either (no prompt_rows, no dataset sha256) resumes unchecked
    del saved["resolved"]["prompt_rows"], saved["resolved"]["dataset"]["sha256"]
    (folder / "config.json").write_text(json.dumps(saved, indent=2))
    assert cli.main(["--resume", str(folder), "--quiet"]) == 0


def test_a_torchrun_runs_resume_command_names_its_processes():
    """Under torchrun the Ctrl-C hint printed the one-process command, which --resume then refuses (the run's
    processes must match); it names torchrun and the count now."""
    assert runner.resume_command("results/r", 2).startswith("torchrun --nproc-per-node 2 ")
    assert runner.resume_command("results/r").startswith("python3 ")
    assert runner.resume_command("results/r", 1).startswith("torchrun --nproc-per-node 1 ")  # one launched process
