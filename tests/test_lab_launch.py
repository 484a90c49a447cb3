"""The lab scripts' `start` calls return while their job runs on (harness/lab/training_gpu.sh, tables_gpu.sh,
sweeps_gpu.sh). The device tool ends a call when the command's output pipe closes; a job launched as
`(cd DIR && setsid nohup CMD > LOG &)` left the backgrounded and-list's shell holding that pipe until the job ended,
so every `start` call of 2026-12-06 ran to its limit (60 s of device time a call, the log's tail never shown)."""
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE = "core data drafters harness refiners training scripts".split()
FILES = "benchmark_compile_all.py bench_fair_fast.sh requirements.txt".split()


def _copy_script(repo: Path, name: str = "training_gpu.sh") -> Path:
    (repo / "harness" / "lab").mkdir(parents=True)
    shutil.copy(ROOT / "harness" / "lab" / name, repo / "harness" / "lab")
    return repo / "harness" / "lab" / name


def _wait_for(path: Path, tries: int = 300) -> None:
    """Until a background job writes `path` (30 s at most: a loaded 2-core machine): nothing it started is left
    running after the test; the test's own check of the file then says what is missing."""
    for _ in range(tries):
        if path.is_file():
            return
        time.sleep(0.1)


def test_training_start_returns_while_the_job_runs(tmp_path):
    """`training_gpu.sh start` in a copy of the layout it expects, with a fake python3 whose job lasts 30 s: the
    call returns after START_WAIT with the job's first log line, the job still running. Before the fix the call
    lasted as long as the job (30 s)."""
    repo = tmp_path / "repo"
    script = _copy_script(repo)
    for d in CODE:
        (repo / d).mkdir(exist_ok=True)
    for f in FILES:
        (repo / f).write_text("")
    (repo / ".gpu2").mkdir()
    (repo / ".gpu2" / "gguf.part.ab").write_bytes(b"second")
    parts, xb, fakebin = tmp_path / "g", tmp_path / "xb", tmp_path / "bin"
    for d in (parts, xb, fakebin):
        d.mkdir()
    (parts / "gguf.part.aa").write_bytes(b"first")
    pid = tmp_path / "job.pid"
    fake = fakebin / "python3"
    fake.write_text(f'#!/bin/sh\necho $$ > {pid}\necho "job started: $*"\nexec sleep 30\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fakebin}:{os.environ['PATH']}", "GPARTS": str(parts), "XB_DIR": str(xb),
           "XRUN": str(tmp_path / "xrun"), "JOB_CODE": str(tmp_path / "code"), "WARM": str(tmp_path / "no-warm"),
           "WDIR": str(tmp_path / "w"), "XB_CACHE": str(tmp_path / "cc.bin"), "START_WAIT": "3"}
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(script), "start", "--set", "a=1"],
                       capture_output=True, text=True, env=env, timeout=90)
    took = time.monotonic() - t0
    try:
        assert r.returncode == 0, r.stderr
        assert took < 20, f"start held its call {took:.1f} s, as long as the job"
        assert "job started: -m training all --config smollm2-gpu --workdir" in r.stdout  # the log's tail
        assert "--set a=1" in r.stdout
        assert (xb / "SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes() == b"firstsecond"
        assert not (tmp_path / "xrun.done").exists()  # the job runs on
    finally:
        if pid.is_file():
            try:
                os.kill(int(pid.read_text()), signal.SIGTERM)
            except ProcessLookupError:
                pass


def test_no_lab_script_launches_a_job_that_holds_the_calls_output():
    """Every background job of the lab scripts redirects the launching subshell, not the command inside it: a
    redirection before `&)` leaves the and-list's shell on the call's pipe (the pattern the test above caught in
    training_gpu.sh; tables_gpu.sh and sweeps_gpu.sh had it too)."""
    bad = []
    for f in sorted((ROOT / "harness" / "lab").glob("*.sh")):
        text = f.read_text()
        # the command's redirections right before the subshell's `&)` (with or without stdin from /dev/null)
        pattern = r"[^\n]*>\s*[^'\"\s]+(\s+2>&1)?(\s*<\s*/dev/null)?\s*&\)"
        bad += [f"{f.name}: {m.group(0)!r}" for m in re.finditer(pattern, text)]
    assert not bad, bad


def _weights(tmp_path: Path) -> dict:
    """A warm drafter, the shipped heads (as `heads` carries them) and a heads-only job's export, each file saying
    where it came from; the environment that points training_gpu.sh at them."""
    for d, what in (("warm/drafter", "warm drafter"), ("gpu4/shipped/xpress", "shipped xpress"),
                    ("gpu4/shipped/markov", "shipped markov"), ("xrun/export/xpress", "job xpress"),
                    ("xrun/export/markov_gated", "job markov_gated")):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "config.json").write_text(what)
    (tmp_path / "warm" / "manifest.json").write_text("{}")
    (tmp_path / "xrun.done").write_text("rc=0\n")  # the job has ended
    return {**os.environ, "WARM": str(tmp_path / "warm"), "SHIPPED_DIR": str(tmp_path / "gpu4"),
            "WDIR": str(tmp_path / "w"), "XRUN": str(tmp_path / "xrun"), "JOB_CODE": str(tmp_path / "code"),
            "TRES": str(tmp_path / "res2"), "TABLES_WAIT": "3"}


def test_jobhead_swaps_the_jobs_head_into_the_shipped_folder(tmp_path):
    """A heads-only job's export has no drafter for training.ship: `shipped` assembles the shipped folder and
    `jobhead` puts the job's head in place of the shipped one of its kind, saying so in JOBHEAD; the drafter and the
    other head stay the shipped ones. Refused before `shipped`, for a name that is no head, and for a head the
    export lacks, and while the job has not ended (its export may be another job's)."""
    script, env = _copy_script(tmp_path / "repo"), _weights(tmp_path)
    run = lambda *a: subprocess.run(["bash", str(script), *a], capture_output=True, text=True, env=env, timeout=60)
    r = run("jobhead")
    assert r.returncode == 3 and "run shipped after the job's start" in r.stderr
    assert run("shipped").returncode == 0
    (tmp_path / "xrun.done").unlink()  # a job still running (or another job's export in its workdir)
    r = run("jobhead")
    assert r.returncode == 3 and "has not ended" in r.stderr
    (tmp_path / "xrun.done").write_text("rc=0\n")
    assert run("jobhead", "drafter").returncode == 2
    r = run("jobhead", "markov_vanilla")
    assert r.returncode == 3 and "the export holds: markov_gated xpress" in r.stderr
    r = run("jobhead")
    assert r.returncode == 0, r.stderr
    w = tmp_path / "w" / "smollm2-135m"
    read = lambda d: (w / d / "config.json").read_text()
    assert (read("drafter"), read("xpress"), read("markov")) == ("warm drafter", "job xpress", "shipped markov")
    assert run("jobhead", "markov_gated").returncode == 0
    assert read("markov") == "job markov_gated"
    assert (w / "JOBHEAD").read_text().splitlines() == [
        f"xpress: the job's export/xpress ({tmp_path / 'xrun'}), not the shipped head",
        f"markov: the job's export/markov_gated ({tmp_path / 'xrun'}), not the shipped head"]


def test_warmheads_puts_the_shipped_heads_beside_the_warm_drafter_for_the_continue_preset(tmp_path):
    """`warmheads` copies the shipped heads and their heads.json next to the warm drafter, keeping the warm
    export's manifest.json; smollm2-gpu-heads-continue then warm-starts each head from the slot heads.json gives its
    name (markov/ for markov_gated). Refused before `warm`, and when the carry lacks a head."""
    from training.config import load_config
    from training.warm import source
    script, env = _copy_script(tmp_path / "repo"), _weights(tmp_path)
    heads = {"shipped": {"drafter": "weights/smollm2-135m/drafter", "xpress": "xpress", "markov": "markov_gated"}}
    (tmp_path / "gpu4" / "shipped" / "heads.json").write_text(json.dumps(heads))
    (tmp_path / "gpu4" / "shipped" / "manifest.json").write_text('{"shipped drafter": 1}')
    run = lambda *a: subprocess.run(["bash", str(script), *a], capture_output=True, text=True, env=env, timeout=60)
    warm = tmp_path / "warm"
    shutil.move(warm / "drafter", tmp_path / "away")
    r = run("warmheads")
    assert r.returncode == 3 and "run warm first" in r.stderr
    shutil.move(tmp_path / "away", warm / "drafter")
    shutil.move(tmp_path / "gpu4" / "shipped" / "markov", tmp_path / "away")
    r = run("warmheads")
    assert r.returncode == 3 and "shipped/markov is missing" in r.stderr
    assert not (warm / "xpress").exists()  # nothing copied before every head is found
    shutil.move(tmp_path / "away", tmp_path / "gpu4" / "shipped" / "markov")
    r = run("warmheads")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in warm.iterdir()) == ["drafter", "heads.json", "manifest.json", "markov", "xpress"]
    assert (warm / "manifest.json").read_text() == "{}"  # the warm export's, not the shipped drafter's
    cfg = load_config("smollm2-gpu-heads-continue", [f"train.warm_start={warm}"])
    assert cfg["train"]["warm_mode"] == "restart"
    assert source(cfg, "xpress") == warm / "xpress" and source(cfg, "markov_gated") == warm / "markov"
    assert source(cfg, "markov_vanilla") is None


@pytest.mark.parametrize("tres", [None, "res2"])
def test_tables_after_jobhead_says_so_and_writes_where_tres_says(tmp_path, tres):
    """`tables` after `shipped` and `jobhead` starts its cells in the background (the call returns at once), logs
    the swapped head, and hands its TRES to the cells: the default when none is given (a script variable, not in
    the environment: it must be passed to the cells' shell), another folder when given (a second set of cells on
    one machine, instead of finding the first set done)."""
    script, env = _copy_script(tmp_path / "repo"), _weights(tmp_path)
    env.pop("TRES")
    if tres:
        env["TRES"] = str(tmp_path / tres)
    cells = tmp_path / "code" / "harness" / "lab"
    cells.mkdir(parents=True)
    # the fake cells only say where they would write (the default, /tmp/res, is outside the test's folder), then
    # last until the test lets them end: `tables` must return while they run
    go = tmp_path / "go"
    (cells / "smollm2_gpu.sh").write_text('echo "cell $DATASETS T=$2 in [$RES] of $XPRESS_BENCH_WEIGHTS"\n'
                                          f'while [ ! -f {go} ]; do sleep 0.05; done\n')
    run = lambda *a: subprocess.run(["bash", str(script), *a], capture_output=True, text=True, env=env, timeout=60)
    assert run("shipped").returncode == 0 and run("jobhead").returncode == 0
    done = tmp_path / "xrun.tables.done"
    try:
        r = run("tables", "gsm8k:0")
        assert r.returncode == 0, r.stderr
        assert not done.exists()  # returned with the cells still running
    finally:
        go.write_text("")
    assert "ship: the shipped weights" in r.stdout and "xpress: the job's export/xpress" in r.stdout
    where = str(tmp_path / tres) if tres else "/tmp/res"
    assert f"cell gsm8k T=0 in [{where}] of {tmp_path / 'w' / 'smollm2-135m'}" in r.stdout
    _wait_for(done)  # the cells' job ends: nothing left running after the test
    assert done.read_text().strip() == "rc=0"


def test_a_second_tables_job_without_benchmarks_starts_in_its_own_xtab(tmp_path):
    """`tables_gpu.sh start` with NOBENCH=1 and an XTAB/XRES of its own (a second set of cells on one machine, whose
    `setup` never wrote that XTAB's bench.done): the cells run and end. Before, the job waited for a bench.done that
    nothing would write (a hand-written one was the workaround, twenty-first session), and its paths were fixed
    under /tmp (JOB_CODE and WDIR move them now)."""
    repo = tmp_path / "repo"
    script = _copy_script(repo, "tables_gpu.sh")
    code, w = tmp_path / "code", tmp_path / "w"
    (code / "harness" / "lab").mkdir(parents=True)
    (code / "harness" / "lab" / "smollm2_gpu.sh").write_text(
        'echo "cells $2 into $RES of $XPRESS_BENCH_WEIGHTS without [$SKIP]"\n')
    for m in ("drafter", "xpress", "markov"):
        (w / "smollm2-135m" / m).mkdir(parents=True)
    xtab, xres = tmp_path / "xtab2", tmp_path / "res2"
    env = {**os.environ, "NOBENCH": "1", "XTAB": str(xtab), "XRES": str(xres), "JOB_CODE": str(code),
           "WDIR": str(w), "DATASETS": "gsm8k", "START_WAIT": "0", "SKIP": "mbpp_t0 gsm8k_t1"}
    r = subprocess.run(["bash", str(script), "start", "0"], cwd=repo,
                       capture_output=True, text=True, env=env, timeout=60)
    done = xtab / "tables.done"
    try:
        assert r.returncode == 0, r.stderr
        _wait_for(done)
        assert done.is_file() and done.read_text().strip() == "rc=0", (xtab / "tables.log").read_text()
        assert f"cells 0 into {xres} of {w / 'smollm2-135m'} without [mbpp_t0 gsm8k_t1]" in \
            (xtab / "tables.log").read_text()  # SKIP reaches the job (the cells another session measured)
    finally:  # a job still waiting for its bench.done (the bug) is released, so nothing is left running
        if xtab.is_dir() and not (xtab / "bench.done").exists():
            (xtab / "bench.done").write_text("rc=released by the test\n")


def test_tables_skip_names_cells_not_to_run(tmp_path):
    """SKIP="gsm8k_t0,mbpp_t1" (commas or spaces): `tables 0 1` over gsm8k and mbpp runs the other two cells and
    says which it skipped (the thirty-third session marked four measured cells done with empty summary.json files
    instead)."""
    repo = tmp_path / "repo"
    script = _copy_script(repo, "smollm2_gpu.sh")
    (repo / "bench_fair_fast.sh").write_text('#!/bin/bash\nd="$OUTDIR/${1}_t$2"\nmkdir -p "$d" && touch "$d/r"\n')
    (repo / "bench_fair_fast.sh").chmod(0o755)
    env = dict(os.environ, DATASETS="gsm8k mbpp", RES=str(tmp_path / "res"), SKIP="gsm8k_t0,mbpp_t1")
    out = subprocess.run(["bash", str(script), "tables", "0", "1"], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert {p.parent.name for p in (tmp_path / "res").glob("*/r")} == {"mbpp_t0", "gsm8k_t1"}, out
    assert "gsm8k_t0: skipped (SKIP)" in out and "mbpp_t1: skipped (SKIP)" in out


@pytest.mark.parametrize("cell_s, runs", [("", {"gsm8k_t0"}), ("100", {"gsm8k_t0", "gsm8k_t1"}),
                                          ("150", set())])
def test_tables_deadline_estimates_a_cell_by_its_temperature(tmp_path, cell_s, runs):
    """`smollm2_gpu.sh tables 0 1` with 145 s to its DEADLINE, in a copy whose bench_fair_fast.sh only writes the
    cell: unset, CELL_S is 130 s at T=0 (the cell runs) and 160 s at T=1 (skipped); a set CELL_S holds for both.
    The old flat 200 s skipped both, as it skipped humaneval and mt-bench with 197 s of 470 unused (2026-12-07)."""
    repo = tmp_path / "repo"
    script = _copy_script(repo, "smollm2_gpu.sh")
    (repo / "bench_fair_fast.sh").write_text('#!/bin/bash\nd="$OUTDIR/${1}_t$2"\n'
                                             'mkdir -p "$d" && touch "$d/r" "$d/table.md"\n')
    (repo / "bench_fair_fast.sh").chmod(0o755)
    env = dict(os.environ, DATASETS="gsm8k", RES=str(tmp_path / "res"), DEADLINE=str(int(time.time()) + 145))
    env.pop("CELL_S", None)
    if cell_s:
        env["CELL_S"] = cell_s
    out = subprocess.run(["bash", str(script), "tables", "0", "1"], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    ran = {p.parent.name for p in (tmp_path / "res").glob("*/r")}
    assert ran == runs, out
    assert out.count("skipped (deadline)") == 2 - len(runs), out
