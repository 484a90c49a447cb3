"""Scale-out over gloo with 2 CPU processes: launched by torchrun, by accelerate launch, and forked here (a rank killed
mid-prompt, as torchrun would see it). The merged folder must hold a single-process run's rows and tables."""
import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import benchmark_compile_all as cli
import harness.protocol.runner as runner
from harness.protocol.results_io import read_folder_rows, read_rows

ROOT = Path(__file__).resolve().parents[1]
NOT_COMPARED = {"ttft_s", "drafter_prefill_s", "decode_s", "rank"}  # timings, and the rank that decoded a row
PROMPTS = [{"turns": ["Add 2 and 3."]}, {"turns": ["Name a colour.", "Another?"]}, {"turns": ["Count to 4."]}]
TIMING_CELLS = (1, 2, 3, 4, 6, 8)  # POOLED tok/s, Sp., E2E Sp., break-even tau, per-sample tok/s, x gain (table.md)
TIMING_CSV = {"pooled_tok_s_mean", "pooled_tok_s_std", "speedup", "speedup_mean", "speedup_std", "speedup_median",
              "speedup_ci_lo", "speedup_ci_hi", "speedup_pooled", "speedup_pooled_ci_lo", "speedup_pooled_ci_hi",
              "per_sample_tok_s_mean", "per_sample_tok_s_std", "gain", "gain_mean", "gain_std", "ttft_s",
              "drafter_prefill_s", "speedup_e2e", "speedup_e2e_ci_lo", "speedup_e2e_ci_hi", "step_s", "break_even_tau"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist_data")
    (d / "mini.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return d


def args(data, results, temperature="0", *extra):
    return ["--random-weights", "tiny", "--dataset", "mini", "--data-dir", str(data), "--device", "cpu",
            "--max-new-tokens", "6", "--fair-interleave", "--fair-k-list", "2", "--temperature", temperature,
            "--results-dir", str(results), "--run-id", "r", *extra]


@pytest.fixture(scope="module")
def single(data, tmp_path_factory, one_thread):
    """One plain process per temperature: the rows and tables every distributed run must reproduce. At T=1 the
    near-uniform random models accept many drafts, so tau differs from 1 and between prompts. No plots drawn (about
    3 s of CPU a run): no check compares them (the launched runs still draw theirs)."""
    from harness.protocol import report
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(report, "write_plots", lambda *a, **k: [])
        for t in ("0", "1"):
            res = tmp_path_factory.mktemp(f"single{t}")
            assert cli.main(args(data, res, t)) == 0
            out[t] = res / "r"
    return out


def strip(rows):
    return [{k: v for k, v in r.items() if k not in NOT_COMPARED} for r in rows]


def masked_markdown(folder: Path, labels: bool = True) -> list[str]:
    text = (folder / "table.md").read_text().split("\n**Ranks (")[0]
    lines = []
    for line in text.splitlines():
        if not labels:  # the title's [labels] (e.g. "traced", for rows decoded with --trace) left out
            line = re.sub(r"^\*\*RESULT  \[[^\]]*\]", "**RESULT  [...]", line)
        if line.startswith(("- FLAGGED: AR round", "- why: ")):  # timing noise flags and step costs differ per run
            continue
        if line.startswith("| ") and not line.startswith("| method"):
            cells = line.strip("| ").split(" | ")
            line = " | ".join("T" if i in TIMING_CELLS else c for i, c in enumerate(cells))
        lines.append(re.sub(r"[\d.]+ (ms|POOLED tok/s)", r"T \1", line))
    return lines


def masked_csv(folder: Path, labels: bool = True) -> list[list[str]]:
    head, *body = [line.split(",") for line in (folder / "table.csv").read_text().splitlines()]
    drop = TIMING_CSV if labels else TIMING_CSV | {"labels"}
    return [[c for h, c in zip(head, row) if h not in drop] for row in [head] + body]


def assert_same_run(dist: Path, single: Path, world: int = 2, same_labels: bool = True):
    merged = read_folder_rows(dist)
    assert strip(merged) == strip(read_folder_rows(single))  # same prompts, tokens, tau, same order
    per_rank = [read_rows(dist / f"samples.rank{r}.jsonl") for r in range(world)]
    for r, rows in enumerate(per_rank):
        assert rows and {x["rank"] for x in rows} == {r}
        assert {x["question_id"] for x in rows} == set(range(r, len(PROMPTS), world))  # round-robin shards
    assert sorted(map(json.dumps, strip(merged))) == sorted(json.dumps(x) for p in per_rank for x in strip(p))
    a, b = (json.loads((f / "summary.json").read_text()) for f in (dist, single))
    for name, arm in b["arms"].items():
        for key in ("tau_per_step", "tau_per_sample", "histogram", "per_position", "token_match", "samples"):
            assert a["arms"][name][key] == arm[key], (name, key)
    assert masked_markdown(dist, same_labels) == masked_markdown(single, same_labels)
    assert masked_csv(dist, same_labels) == masked_csv(single, same_labels)
    assert "**Ranks (2 processes)**" in (dist / "table.md").read_text()
    env = json.loads((dist / "env.json").read_text())
    assert [e["rank"] for e in env["ranks"]] == list(range(world))
    assert all(e["device"] == "cpu" and e["gpu_before"] is None and e["loop_s"] > 0 for e in env["ranks"])
    assert [r["rank"] for r in a["ranks"]["ranks"]] == list(range(world))
    config = json.loads((dist / "config.json").read_text())
    assert config["resolved"]["distributed"]["world_size"] == world


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def test_torchrun_two_processes_merge_to_the_single_process_run(data, single, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "benchmark_compile_all.py"), *args(data, tmp_path)]
    proc = subprocess.run(cmd, env=launcher_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sum(ln.startswith("RESULT  ") and "dataset=mini" in ln for ln in proc.stdout.splitlines()) == 1  # rank 0 only
    assert "RANKS (2 processes)" in proc.stdout
    assert_same_run(tmp_path / "r", single["0"])


def test_accelerate_launch_two_processes_at_t1(data, single, tmp_path):
    pytest.importorskip("accelerate")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
           str(free_port()), str(ROOT / "benchmark_compile_all.py"), *args(data, tmp_path, "1")]
    proc = subprocess.run(cmd, env=launcher_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(tmp_path / "r", single["1"])
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    taus = {a["tau_per_step"] for a in summary["arms"].values()}
    assert len(taus) > 1 and max(taus) > 1.5  # sampling: the check above compares real, varied acceptance


# ------------------------------------------------------------------- forked ranks: a rank killed mid-prompt

def _rank(rank, world, port, argv, die, env):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), **env)
    torch.set_num_threads(1)
    if die is not None and die[0] == rank:
        real, calls = runner.decode_sample, [0]

        def dying(*a, **k):  # dies inside its (die[1] + 1)-th prompt, as a SIGKILL would: no cleanup, no row
            calls[0] += 1
            if calls[0] > die[1]:
                os._exit(9)
            return real(*a, **k)
        runner.decode_sample = dying
    sys.stdout.flush()
    os._exit(cli.main(argv))


def fork_ranks(argv, world=2, die=None, timeout=300, env=None):
    """Forked ranks with the launcher's variables; like torchrun, the others are stopped when one fails."""
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, argv, die, env or {})) for r in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < end:
        if any(p.exitcode not in (None, 0) for p in procs):
            for p in procs:
                if p.is_alive():
                    p.terminate()
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    return [p.exitcode for p in procs]


def keys(rows):
    return [(r["round"], r["arm"], r["question_id"], r["turn"]) for r in rows]


@pytest.mark.parametrize("how", ["--resume", "torchrun restart"])
def test_killed_rank_loses_only_its_prompt_and_resumes_without_duplicates(data, single, tmp_path, capsys, how,
                                                                         monkeypatch):
    from harness.protocol import report
    monkeypatch.setattr(report, "write_plots", lambda *a, **k: [])  # (forked ranks inherit it) no check reads them
    codes = fork_ranks(args(data, tmp_path, "1"), die=(1, 2))
    assert codes[1] == 9 and codes[0] != 0  # rank 1 died; rank 0 was stopped as torchrun stops it
    folder = tmp_path / "r"
    assert not (folder / "samples.jsonl.gz").exists()  # nothing merged from a broken run
    before = read_rows(folder / "samples.rank1.jsonl")
    assert len({k[:3] for k in keys(before)}) == 2  # two finished prompt-arms kept; the third, unfinished, lost
    # a resume needs the launcher and process count the run started with
    assert cli.main(args(data, tmp_path, "1", "--resume", str(folder))) == 2
    assert "started by 2 processes" in capsys.readouterr().err
    trace = tmp_path / "trace.jsonl"
    rank0_before = read_rows(folder / "samples.rank0.jsonl") if (folder / "samples.rank0.jsonl").exists() else []
    if how == "--resume":
        assert fork_ranks(args(data, tmp_path, "1", "--resume", str(folder), "--trace", str(trace))) == [0, 0]
        # a trace per rank; rank 0 traces only if it had prompts left (torchrun's stop can find it done, waiting at
        # the merge: a CI run on 2026-12-04 did), rank 1 always (its lost prompt)
        left0 = len(read_rows(folder / "samples.rank0.jsonl")) > len(rank0_before)
        assert bool((tmp_path / "trace.rank0.jsonl").stat().st_size) == left0
        assert (tmp_path / "trace.rank1.jsonl").stat().st_size
        assert not trace.exists()  # one trace per rank, never two ranks in one file
    else:  # torchrun --max-restarts relaunches the same command: the --run-id folder is continued, not refused
        assert fork_ranks(args(data, tmp_path, "1"), env={"TORCHELASTIC_RESTART_COUNT": "1"}) == [0, 0]
    after = [read_rows(folder / f"samples.rank{r}.jsonl") for r in (0, 1)]
    assert after[1][:len(before)] == before  # what was written stays as written
    for rows in after:
        assert len(keys(rows)) == len(set(keys(rows)))  # nothing decoded twice
    assert json.loads((folder / "summary.json").read_text())["duplicate_rows_dropped"] == 0
    traced = how == "--resume"  # rows decoded with --trace: the run says so (its tables are otherwise the same)
    first = (folder / "table.md").read_text().splitlines()[0]
    # both continue the run in new processes (each rank's resumes.rank{r}.json): its rounds span processes, said so
    assert ("traced" in first) == traced and "resumed 1x" in first
    assert_same_run(folder, single["1"], same_labels=False)
    check_compare(folder, single["1"])


def check_compare(multi: Path, single: Path):
    """harness.lab.scaleout_compare on CPU folders: the numbers it prints are the summaries' (CPU timings are
    noise, so only the arithmetic and the verdicts' consistency are checked, not PASS)."""
    from harness.lab.scaleout_compare import compare
    text, data, ok = compare(str(multi), str(single), 10.0, 25.0)
    ranks = json.loads((multi / "summary.json").read_text())["ranks"]["ranks"]
    steps = [r["ar_step_ms"] for r in ranks]
    assert data["ar_step_ms"] == steps and data["spread"] == pytest.approx(max(steps) / min(steps) - 1)
    ar = json.loads((single / "summary.json").read_text())["arms"]["AR"]["pooled_tok_s"]["mean"]
    assert data["ar_step_ms_one_gpu"] == pytest.approx(1000 / ar)  # a plain single-process run has no ranks
    assert ok == (data["spread"] <= 0.03 and all(abs(v) <= 0.03 for v in data["vs_one_gpu"]))
    assert "ratio 2.50x" in text and text.count("| 2 GPUs |") == 2


def test_an_error_of_rank_0_reaches_every_rank(data, tmp_path, capfd):
    """Rank 0 picks the folder; when it refuses (the run id is taken), every rank exits with its line, none hangs."""
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.json").write_text("{}")
    assert fork_ranks(args(data, tmp_path), timeout=120) == [2, 2]
    err = capfd.readouterr().err
    assert err.count("already holds a run") == 2, err[-2000:]


def test_the_training_pipeline_refuses_several_processes(monkeypatch, capsys):
    """Its distributed mode is not wired: N ranks would each train the same models into the same files."""
    from training.__main__ import main
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    assert main(["train", "--config", "tiny-cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: python -m training runs in one process") and "2 processes" in err


def test_close_meets_at_a_barrier_only_past_the_merge(monkeypatch):
    """Shard.close: past the merge (the last collective) the ranks meet at a barrier before tearing the group down,
    rank 0 too if its report then fails; a rank that fails before it destroys its side at once (a barrier could meet
    another rank's unfinished collective). Power: a close without the barrier, or with it on every path, fails one
    of the two."""
    import torch.distributed as dist
    from harness.protocol.distributed import Shard
    calls = []
    monkeypatch.setattr(dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    monkeypatch.setattr(dist, "gather_object", lambda obj, parts, dst: calls.append("gather"))
    done = Shard(rank=1, world=2, launched=True, _group=True)
    assert done.merge([], []) is None
    done.close()
    assert calls == ["gather", "barrier", "destroy"] and not done._group
    calls.clear()
    Shard(rank=1, world=2, launched=True, _group=True).close()
    assert calls == ["destroy"]


LEAVE = """import atexit, sys
sys.path.insert(0, {root!r})
from harness.protocol.distributed import leave
atexit.register(lambda: print("finalized"))
print("rows written", end="")  # unflushed on a pipe: leave flushes it
leave(3)
print(" and returned")
sys.exit(0)
"""


@pytest.mark.parametrize("launched", [True, False])
def test_a_launched_rank_leaves_without_finalization(launched):
    """distributed.leave: a rank of torchrun or accelerate ends at once with the run's exit code, its output
    flushed, the interpreter's finalization (where a gloo thread's late GIL request once aborted a finished rank)
    skipped, here shown by an atexit handler that never runs; a plain process returns and exits as usual.
    benchmark_compile_all's __main__ calls it. Power: a leave that did nothing, or exited 0, or lost the unflushed
    line, fails the launched case; one that left a plain process fails the other."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    if launched:
        env.update(RANK="1", WORLD_SIZE="2")
    proc = subprocess.run([sys.executable, "-c", LEAVE.format(root=str(ROOT))], env=env, capture_output=True,
                          text=True, timeout=60)
    if launched:
        assert (proc.returncode, proc.stdout) == (3, "rows written"), proc
    else:
        assert (proc.returncode, proc.stdout) == (0, "rows written and returned\nfinalized\n"), proc
    main_block = (ROOT / "benchmark_compile_all.py").read_text().split('if __name__ == "__main__":')[1]
    assert "leave(code)" in main_block and main_block.index("leave(code)") < main_block.index("sys.exit(code)")


def test_a_single_process_resume_of_a_run_stopped_before_its_first_row_starts_from_none(tmp_path):
    """Shard.done: a run stopped after config.json and before its first row has no rows file; its --resume starts
    from no rows (it was refused: "no samples.jsonl.gz"), as a torchrun rank that died before its first row does.
    With rows there, plain or gzip'd, they are read."""
    from harness.protocol.distributed import Shard
    from harness.protocol.results_io import append_rows, write_rows
    (tmp_path / "config.json").write_text("{}")
    rows_path = str(tmp_path / "samples.jsonl")
    assert Shard().done(rows_path, resume=True) == []
    append_rows(rows_path, [{"a": 1}])
    assert Shard().done(rows_path, resume=True) == [{"a": 1}] and Shard().done(rows_path, resume=False) == []
    write_rows(tmp_path, [{"a": 1}, {"a": 2}])
    assert Shard().done(rows_path, resume=True) == [{"a": 1}, {"a": 2}]
