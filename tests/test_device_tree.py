"""The device session's scripts on the CPU (harness/lab/training_gpu.sh, tables_gpu.sh, sweeps_gpu.sh,
device_tree.sh's stash and mark): what each call carries back, brings, skips and records. The tree's size against
the 64 MiB cap: tests/test_device_tree_size.py."""
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_training_gpu_back_brings_records_and_the_export_not_data_or_checkpoints(tmp_path):
    """harness/lab/training_gpu.sh back: records.tgz holds the stage manifests, each model's JSON and metrics, the
    selection and held-out prompts and the log, but no training prompts, response parts or fp32 checkpoints; the export WHAT comes in parts that join to the
    files; without $OUT, or with no subcommand, it refuses (exit non-zero)."""
    import os
    import tarfile
    script = ROOT / "harness" / "lab" / "training_gpu.sh"
    work, out = tmp_path / "xrun", tmp_path / "out"
    files = {"stages.json": "{}", "responses/manifest.json": "{}", "responses/parts/part000.jsonl": "data",
             "prompts/train.jsonl": "data", "prompts/heldout.jsonl": "{}", "prompts/selection.jsonl": "{}",
             "train/drafter/box.json": "{}", "train/drafter/metrics.jsonl": "{}",
             "train/drafter/1/model.safetensors": "fp32", "export/manifest.json": "{}",
             "export/drafter/model.safetensors": "w" * 40_000, "export/drafter/config.json": "{}"}
    for name, text in files.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)
    (tmp_path / "xrun.log").write_text("log\n")
    out.mkdir()
    env = {**os.environ, "XRUN": str(work), "OUT": str(out)}
    subprocess.run(["bash", str(script), "back", "drafter"], env=env, check=True, capture_output=True)
    with tarfile.open(out / "records.tgz") as t:
        names = {n.lstrip("./") for n in t.getnames()}
    assert {"stages.json", "responses/manifest.json", "train/drafter/box.json", "train/drafter/metrics.jsonl",
            "export/manifest.json"} <= names
    assert {"prompts/heldout.jsonl", "prompts/selection.jsonl"} <= names  # the sets tau is measured on
    assert not any(n.startswith(("prompts/train", "responses/parts", "train/drafter/1", "export/drafter")) for n in names)
    assert any(n.endswith("xrun.log") for n in names)
    parts = sorted(out.glob("drafter.tar.part.*"))
    (tmp_path / "joined.tar").write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(tmp_path / "joined.tar") as t:
        assert set(t.getnames()) >= {"export/manifest.json", "export/drafter/model.safetensors"}
    env.pop("OUT")
    assert subprocess.run(["bash", str(script), "back"], env=env, capture_output=True).returncode != 0
    assert subprocess.run(["bash", str(script)], capture_output=True).returncode == 2


def test_back_takes_several_exports_in_one_set_of_parts(tmp_path):
    """`back xpress markov_gated`: both heads' exports in one tar, split in parts named after the first."""
    import os
    import tarfile
    script = ROOT / "harness" / "lab" / "training_gpu.sh"
    work, out = tmp_path / "xrun", tmp_path / "out"
    for name in ("export/manifest.json", "export/xpress/model.safetensors", "export/markov_gated/model.safetensors"):
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text("w")
    (tmp_path / "xrun.log").write_text("log\n")
    out.mkdir()
    env = {**os.environ, "XRUN": str(work), "OUT": str(out)}
    subprocess.run(["bash", str(script), "back", "xpress", "markov_gated"], env=env, check=True, capture_output=True)
    parts = sorted(out.glob("xpress.tar.part.*"))
    (tmp_path / "joined.tar").write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(tmp_path / "joined.tar") as t:
        assert set(t.getnames()) >= {"export/xpress/model.safetensors", "export/markov_gated/model.safetensors"}


def test_back_brings_what_one_call_can_and_rest_the_remainder(tmp_path):
    """A whole export (69.3 MB on 2026-12-04) is over the 64 MiB that one call brings back: `back` moved all its
    parts into $OUT, and the device tool left the last one behind. Now `back` moves records.tgz first, then parts
    while the call's limits allow (here lowered to 32 MB), says what is left, and `rest` brings that in the next
    call; the parts of both calls join to the export, and the compile cache (train.compile_cache) comes after them.
    `rest` with nothing staged refuses."""
    import os
    import tarfile
    script = ROOT / "harness" / "lab" / "training_gpu.sh"
    work = tmp_path / "xrun"
    big = work / "export" / "drafter" / "model.safetensors"
    big.parent.mkdir(parents=True)
    with open(big, "wb") as f:
        f.truncate(35_000_000)  # three parts of 15 MB
    (work / "export" / "manifest.json").write_text("{}")
    (tmp_path / "xrun.log").write_text("log\n")
    outs = [tmp_path / "out1", tmp_path / "out2"]
    for o in outs:
        o.mkdir()
    (tmp_path / "cc.bin").write_bytes(b"artifacts")  # train.compile_cache's file: after the export's parts
    env = {**os.environ, "XRUN": str(work), "MAX_BACK_BYTES": "32000000", "XB_CACHE": str(tmp_path / "cc.bin")}
    first = subprocess.run(["bash", str(script), "back", "drafter"], env={**env, "OUT": str(outs[0])}, check=True,
                           capture_output=True, text=True).stdout
    assert sorted(p.name for p in outs[0].iterdir()) == ["drafter.tar.part.aa", "drafter.tar.part.ab", "records.tgz"]
    assert "left on the machine: 2 file(s)" in first
    second = subprocess.run(["bash", str(script), "rest"], env={**env, "OUT": str(outs[1])}, check=True,
                            capture_output=True, text=True).stdout
    assert sorted(p.name for p in outs[1].iterdir()) == ["compile_cache.part.aa", "drafter.tar.part.ac"]
    assert "nothing left" in second and (outs[1] / "compile_cache.part.aa").read_bytes() == b"artifacts"
    parts = sorted(p for o in outs for p in o.glob("drafter.tar.part.*"))
    (tmp_path / "joined.tar").write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(tmp_path / "joined.tar") as t:
        assert t.getmember("export/drafter/model.safetensors").size == 35_000_000
    env["XRUN"] = str(tmp_path / "none")
    r = subprocess.run(["bash", str(script), "rest"], env={**env, "OUT": str(outs[1])}, capture_output=True, text=True)
    assert r.returncode == 3 and "run back first" in r.stderr
    # a model the export does not hold (a typo): the records still come back, the error names what it holds
    out3 = tmp_path / "out3"
    out3.mkdir()
    env["XRUN"] = str(work)
    r = subprocess.run(["bash", str(script), "back", "drafer"], env={**env, "OUT": str(out3)}, capture_output=True,
                       text=True)
    assert r.returncode == 3 and "no export/drafer" in r.stderr and "holds: drafter manifest.json" in r.stderr
    assert [p.name for p in out3.iterdir()] == ["records.tgz"]


@pytest.mark.parametrize("script, var", [("training_gpu.sh", "XRUN"), ("tables_gpu.sh", "XTAB"),
                                         ("sweeps_gpu.sh", "XSW")])
def test_a_poll_on_a_bare_machine_says_so_at_once(tmp_path, script, var):
    """A machine given back takes its job along; the next call's poll must not wait out its seconds for a job that
    is not there (one did, for 500 s of device time): it exits 3 at once, saying what to run again."""
    import os
    import time
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(ROOT / "harness" / "lab" / script), "poll", "60"], capture_output=True, text=True,
                       env={**os.environ, var: str(tmp_path / "none")})
    assert r.returncode == 3 and "no " in r.stderr and "given back" in r.stderr
    assert time.monotonic() - t0 < 30


def test_a_tables_poll_without_a_bench_log_still_lists_and_brings_back_the_cells(tmp_path):
    """With NOBENCH there is no bench log; the poll must still list the finished cells and put them in $OUT (on
    2026-12-03 its grep of the missing log ended it under set -e before either, and the machine was lost after)."""
    import os
    import tarfile
    jobs, res, out = tmp_path / "xtab", tmp_path / "res", tmp_path / "out"
    for d in (jobs, res / "gsm8k_t1", out):
        d.mkdir(parents=True)
    (jobs / "bench.done").write_text("rc=skipped\n")
    (jobs / "tables.log").write_text("== gsm8k_t1\n")
    (res / "gsm8k_t1" / "summary.json").write_text("{}")
    r = subprocess.run(["bash", str(ROOT / "harness" / "lab" / "tables_gpu.sh"), "poll", "0"], capture_output=True,
                       text=True, env={**os.environ, "XTAB": str(jobs), "XRES": str(res), "OUT": str(out)})
    assert r.returncode == 0, r.stderr
    assert "gsm8k_t1" in r.stdout and "== gsm8k_t1" in r.stdout
    with tarfile.open(out / "tables.tgz") as t:
        assert "./gsm8k_t1/summary.json" in t.getnames()


def test_shipped_puts_the_shipped_heads_beside_the_warm_drafter_and_tables_then_skips_the_ship(tmp_path):
    """`shipped`: the tables measure the shipped folder (its heads from `heads`, the drafter from `warm`) as it is,
    so a run whose new heads lost can still make tables of the weights that stay shipped."""
    import os
    warm, wdir, carry = tmp_path / "warm", tmp_path / "w", tmp_path / "gpu4"
    (warm / "drafter").mkdir(parents=True)
    (warm / "drafter" / "model.safetensors").write_text("d")
    (warm / "manifest.json").write_text("{}")
    for name in ("xpress/model.safetensors", "markov/model.safetensors", "heads.json"):
        (carry / "shipped" / name).parent.mkdir(parents=True, exist_ok=True)
        (carry / "shipped" / name).write_text(name)
    env = {**os.environ, "WARM": str(warm), "WDIR": str(wdir), "SHIPPED_DIR": str(carry)}
    script = ROOT / "harness" / "lab" / "training_gpu.sh"
    subprocess.run(["bash", str(script), "shipped"], env=env, check=True, capture_output=True)
    got = sorted(str(p.relative_to(wdir / "smollm2-135m")) for p in (wdir / "smollm2-135m").rglob("*") if p.is_file())
    assert got == ["drafter/model.safetensors", "heads.json", "manifest.json", "markov/model.safetensors",
                   "xpress/model.safetensors"]
    assert (wdir / ".shipped").exists()
    # without `shipped` (and with no finished job) tables refuses, naming both ways on
    (wdir / ".shipped").unlink()
    r = subprocess.run(["bash", str(script), "tables", "gsm8k:0"], env={**env, "XRUN": str(tmp_path / "xrun")},
                       capture_output=True, text=True)
    assert r.returncode == 3 and "poll first, or run shipped" in r.stderr
    # without a warm drafter there is nothing to put the heads beside: it says so and exits 3
    r = subprocess.run(["bash", str(script), "shipped"], env={**env, "WARM": str(tmp_path / "none")},
                       capture_output=True, text=True)
    assert r.returncode == 3 and "run warm first" in r.stderr


def test_a_second_tables_job_clears_the_first_ones_done_file(tmp_path):
    """`tables` twice on one machine (the T=1 cells after the T=0 ones): the first job's .done must go, or `tpoll`
    reports the second job finished at once (it did on 2026-12-06, while the second job's cells ran)."""
    import os
    wdir, xrun = tmp_path / "w", tmp_path / "xrun"
    wdir.mkdir()
    (wdir / ".shipped").write_text("")  # tables after `shipped`: no finished training job needed
    (tmp_path / "xrun.tables.done").write_text("rc=0\n")  # the first job's, beside its log
    (tmp_path / "xrun.tables.log").write_text("== gsm8k_t0\n")
    env = {**os.environ, "WDIR": str(wdir), "XRUN": str(xrun), "JOB_CODE": str(tmp_path / "no-code"),
           "TABLES_WAIT": "0"}  # no code copy there: the job cannot start, only the call's own steps run
    r = subprocess.run(["bash", str(ROOT / "harness" / "lab" / "training_gpu.sh"), "tables", "gsm8k:1"], env=env,
                       capture_output=True, text=True)
    assert not (tmp_path / "xrun.tables.done").exists(), r.stdout + r.stderr
    r = subprocess.run(["bash", str(ROOT / "harness" / "lab" / "training_gpu.sh"), "tpoll", "0"], env=env,
                       capture_output=True, text=True)
    assert r.stdout.startswith("running"), r.stdout


def test_heads_carries_the_shipped_folder_without_its_drafter(tmp_path):
    """`heads DIR` (here): every file of the shipped folder but drafter/ (which `warm` carries) into the carry."""
    import os
    src, carry = tmp_path / "w", tmp_path / "gpu4"
    for name in ("drafter/model.safetensors", "xpress/model.safetensors", "markov/model.safetensors", "heads.json"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(name)
    env = {**os.environ, "SHIPPED_DIR": str(carry)}
    subprocess.run(["bash", str(ROOT / "harness" / "lab" / "training_gpu.sh"), "heads", str(src)], env=env,
                   check=True, capture_output=True)
    got = sorted(str(p.relative_to(carry / "shipped")) for p in carry.rglob("*") if p.is_file())
    assert got == ["heads.json", "markov/model.safetensors", "xpress/model.safetensors"]


def test_every_carry_folder_is_ignored_by_the_committed_gitignore():
    """The carry folders training_gpu.sh makes are ignored by .gitignore itself, not by .git/info/exclude (which a
    checkout may lack: CI's did, and `heads` failed writing to it), so they never travel as tracked files."""
    import fnmatch
    import re
    script = (ROOT / "harness" / "lab" / "training_gpu.sh").read_text()
    folders = set(re.findall(r"\.gpu\d", script)) | {".whl"}
    assert {".gpu1", ".gpu2", ".gpu3", ".whl"} <= folders
    patterns = [ln.strip().strip("/") for ln in (ROOT / ".gitignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    for name in sorted(folders):
        assert any(fnmatch.fnmatch(name, p) for p in patterns), f"{name} is not in .gitignore"
    assert ".git/info" not in script


@pytest.mark.parametrize("table_args, want", [(None, "--run-id gsm8k_t0 --kernels triton --batch-invariant"),
                                              ("", "--run-id gsm8k_t0 "),
                                              ("--kernels auto", "--run-id gsm8k_t0 --kernels auto")])
def test_table_cells_take_the_shipped_tables_kernels_unless_told(tmp_path, table_args, want):
    """smollm2_gpu.sh tables: with TABLE_ARGS unset each cell gets the shipped tables' kernels (batch-invariant
    Triton, so T=0 output equals AR's in bf16); an empty TABLE_ARGS means none. A candidate's tables ran without
    them on 2026-12-05, their arms unequal to AR, because the default was empty."""
    import os
    import shutil
    (tmp_path / "harness" / "lab").mkdir(parents=True)
    shutil.copy(ROOT / "harness" / "lab" / "smollm2_gpu.sh", tmp_path / "harness" / "lab")
    stub = tmp_path / "bench_fair_fast.sh"  # prints what the cell would be given
    stub.write_text('#!/usr/bin/env bash\necho "EXTRA=$EXTRA_ARGS"\nmkdir -p "$OUTDIR/$1_t$2" && : > "$OUTDIR/$1_t$2/table.md"\n')
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "TABLE_ARGS"}
    env.update(DATASETS="gsm8k", RES=str(tmp_path / "res"))
    if table_args is not None:
        env["TABLE_ARGS"] = table_args
    r = subprocess.run(["bash", str(tmp_path / "harness" / "lab" / "smollm2_gpu.sh"), "tables", "0"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "res" / "gsm8k_t0.log").read_text() == f"EXTRA={want}\n"


def test_table_cells_take_a_comma_list_of_datasets(tmp_path):
    """DATASETS="math500,humaneval" is two cells, as "math500 humaneval" is (2026-12-06: the comma list ran as one
    cell of a dataset named "math500,humaneval", which failed)."""
    import os
    import shutil
    (tmp_path / "harness" / "lab").mkdir(parents=True)
    shutil.copy(ROOT / "harness" / "lab" / "smollm2_gpu.sh", tmp_path / "harness" / "lab")
    stub = tmp_path / "bench_fair_fast.sh"
    stub.write_text('#!/usr/bin/env bash\nmkdir -p "$OUTDIR/$1_t$2" && : > "$OUTDIR/$1_t$2/table.md"\n')
    stub.chmod(0o755)
    env = {**os.environ, "DATASETS": "math500,humaneval", "RES": str(tmp_path / "res")}
    r = subprocess.run(["bash", str(tmp_path / "harness" / "lab" / "smollm2_gpu.sh"), "tables", "1"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "res").glob("*.log")) == ["humaneval_t1.log", "math500_t1.log"]


def test_a_sweeps_job_with_nocheck_runs_no_gpu_tests_or_bench(tmp_path):
    """sweeps_gpu.sh job with NOCHECK=1 (a second job on one machine, or a session whose code ran them): neither
    the GPU tests nor bench_batch run first; without it both do."""
    import os
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text('#!/usr/bin/env bash\necho "$*" >> "$CALLS"\n')
    (fake / "python3").chmod(0o755)
    for nocheck, want in (("1", []), ("", ["pytest", "harness.lab.bench_batch"])):
        calls = tmp_path / f"calls{nocheck}"
        calls.write_text("")
        env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "CALLS": str(calls), "NOCHECK": nocheck,
               "ONLY": "none", "DEADLINE": "0", "XSW": str(tmp_path / "j"), "XSWRES": str(tmp_path / "r")}
        (tmp_path / "j").mkdir(exist_ok=True), (tmp_path / "r").mkdir(exist_ok=True)
        r = subprocess.run(["bash", str(ROOT / "harness" / "lab" / "sweeps_gpu.sh"), "job"], env=env,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert [ln.split()[1] for ln in calls.read_text().splitlines()] == want, calls.read_text()


@pytest.mark.parametrize("script, last", [("tables_gpu.sh", "the jobs die with the machine."),
                                          ("sweeps_gpu.sh", "the job dies with the machine.")])
def test_the_usage_is_the_whole_header(script, last):
    """With no command the script prints its header and exits 2; the header ran past the lines printed once, and
    the usage stopped mid-sentence."""
    r = subprocess.run(["bash", str(ROOT / "harness" / "lab" / script)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout.rstrip().endswith(last)


def test_stash_and_mark_record_the_commit_that_a_device_copy_reports_and_restore_removes_it(tmp_path, monkeypatch):
    """The device runs a copy of the tree without .git, so env.json's git_sha was null on every GPU run: stash (and
    mark, after a commit or an edit made while stashed) writes .xb_commit (the commit, +dirty when a file that
    travels differs, and when), the scripts copy it beside the code, and results_io.environment reads it where git
    cannot answer; restore removes it."""
    import os
    import shutil

    from harness.protocol import results_io
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no repository above tmp_path answers for a copy
    repo = tmp_path / "repo"
    (repo / "harness" / "lab").mkdir(parents=True)
    shutil.copy(ROOT / "harness" / "lab" / "device_tree.sh", repo / "harness" / "lab")
    for d in ("weights", "results"):
        (repo / d).mkdir()
        (repo / d / "f").write_text(d)
    git = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "x"]):
        subprocess.run(["git", *cmd], cwd=repo, env=git, check=True)
    head = lambda: subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,  # noqa: E731
                                  text=True).stdout.strip()
    sha = head()
    script = repo / "harness" / "lab" / "device_tree.sh"
    run = lambda *a: subprocess.run(["bash", str(script), *a], check=True, capture_output=True)  # noqa: E731
    run("stash", str(tmp_path / "s"))
    assert (repo / ".xb_commit").read_text().split()[0] == sha  # clean: weights/ and results/ moved aside
    copy = tmp_path / "copy"  # what a device call's job runs: the code, no .git, the commit file beside it
    copy.mkdir()
    shutil.copy(repo / ".xb_commit", copy)
    env = results_io.environment(repo=copy)
    assert env["git_sha"] == sha and env["git_dirty"] is False and ".xb_commit" in env["git_sha_from"]
    (repo / "new.py").write_text("x")  # an untracked file travels too: the tree is no longer the commit
    run("mark")
    assert (repo / ".xb_commit").read_text().split()[0] == f"{sha}+dirty"
    subprocess.run(["git", "add", "new.py"], cwd=repo, env=git, check=True)
    subprocess.run(["git", "commit", "-qm", "y"], cwd=repo, env=git, check=True)
    run("mark")  # a commit made while stashed: mark records it
    assert head() != sha and (repo / ".xb_commit").read_text().split()[0] == head()
    shutil.copy(repo / ".xb_commit", copy)
    assert results_io.environment(repo=copy)["git_sha"] == head()
    (copy / ".xb_commit").write_text(f"{sha}+dirty 2026-12-05T00:00:00Z\n")
    env = results_io.environment(repo=copy)
    assert env["git_dirty"] is True and "2026-12-05T00:00:00Z" in env["git_sha_from"]
    run("restore", str(tmp_path / "s"))
    assert not (repo / ".xb_commit").exists() and (repo / "weights" / "f").exists()
    assert results_io.environment(repo=tmp_path / "bare")["git_sha"] is None  # neither git nor the file


def test_pack_brings_the_data_stages_over_calls_and_they_unpack_whole(tmp_path):
    """`pack` (after the job): the prompts and responses stages as travel pieces, moved into $OUT while one call's
    limits allow (here 2 files), the remainder by `rest`; the pieces of all calls unpack to the same files (a
    later session's `data`). Before the job has ended it refuses, writing nothing."""
    import os
    from tests.test_training_travel import files_of, make_work
    from training import travel
    script = ROOT / "harness" / "lab" / "training_gpu.sh"
    w = make_work(tmp_path, big=4_000_000)  # 4 MB of hex, about 2.2 MB gzip'd: two pieces of PACK_MIB
    outs = [tmp_path / f"out{i}" for i in range(3)]
    for o in outs:
        o.mkdir()
    env = {**os.environ, "XRUN": str(w), "MAX_BACK": "2", "PACK_MIB": "2"}
    r = subprocess.run(["bash", str(script), "pack"], env={**env, "OUT": str(outs[0])}, capture_output=True, text=True)
    assert r.returncode == 3 and "has not ended" in r.stderr and not any(outs[0].iterdir())
    (tmp_path / "W.done").write_text("rc=0\n")
    first = subprocess.run(["bash", str(script), "pack"], env={**env, "OUT": str(outs[0])}, check=True,
                           capture_output=True, text=True).stdout
    assert len(list(outs[0].iterdir())) == 2 and "left on the machine: 1 file(s)" in first
    subprocess.run(["bash", str(script), "rest"], env={**env, "OUT": str(outs[1])}, check=True, capture_output=True)
    for p in (p for o in outs for p in o.iterdir()):
        p.rename(outs[2] / p.name)
    assert sorted(p.name for p in outs[2].iterdir()) == ["stages.json", "stages.part000", "stages.part001"]
    assert travel.main(["unpack", str(outs[2]), "--workdir", str(tmp_path / "W2")]) == 0
    assert files_of(tmp_path / "W2") == {k: v for k, v in files_of(w).items() if not k.endswith(".tmp")}
