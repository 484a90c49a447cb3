"""The CLI end to end on tiny checkpoints written to disk, and its refusals of bad input."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import benchmark_compile_all as cli
from drafters.dflash import save_dflash
from tiny import save_tiny_checkpoint, tiny_drafter, tiny_target

# tiny shapes: one intra-op thread (conftest.one_thread), as the other tiny-model modules run
pytestmark = pytest.mark.usefixtures("one_thread", "no_plots_module")


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    save_tiny_checkpoint(root / "target")
    t = tiny_target("qwen3")
    save_dflash(tiny_drafter(t, block=4).model, root / "drafter")
    data = root / "data"
    data.mkdir()
    rows = [{"turns": ["Add 2 and 3."]}, {"turns": ["Name a colour.", "And another one?"]},
            {"turns": ["Write a haiku about the sea, please."]}]
    (data / "mini.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def args(files, *extra):
    return ["--model-name-or-path", str(files / "target"), "--draft-name-or-path", str(files / "drafter"),
            "--dataset", "mini", "--data-dir", str(files / "data"), "--max-new-tokens", "12", "--device", "cpu",
            "--results-dir", str(files / "results"), *extra]


def test_end_to_end_ar_and_drafter_only(files, tmp_path, capsys):
    answers = tmp_path / "answers.jsonl"
    assert cli.main(args(files, "--answer-file", str(answers))) == 0
    out = capsys.readouterr().out
    assert "tau/step" in out and "POOLED tok/s" in out and "drafter-only" in out and "AR" in out
    rows = [json.loads(line) for line in answers.read_text().splitlines()]
    assert [r["question_id"] for r in rows] == [0, 1, 2]
    assert [r["dataset_row"] for r in rows] == [0, 1, 2] and rows[0]["dataset"] == "mini"
    for r in rows:
        ar, spec = r["choices"]
        assert ar["block_size"] == 1 and spec["block_size"] == 4
        for key in ("turns", "new_tokens", "wall_time", "prefill_times", "decode_times", "acceptance_lengths",
                    "stop_reason"):
            assert len(ar[key]) == len(spec[key]) == len(r["choices"][1]["turns"])
        assert ar["turns"] == spec["turns"]  # greedy: drafter-only is lossless through the whole stack
        assert ar["new_tokens"] == spec["new_tokens"]
        assert all(sum(x) == n - 1 for x, n in zip(spec["acceptance_lengths"], spec["new_tokens"]))
    assert len(rows[1]["choices"][1]["turns"]) == 2


def test_ar_only_and_skip_ar(files, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert cli.main(args(files, "--ar-only", "--answer-file", str(a))) == 0
    assert cli.main(args(files, "--skip-ar", "--answer-file", str(b))) == 0
    ra = [json.loads(x) for x in a.read_text().splitlines()]
    rb = [json.loads(x) for x in b.read_text().splitlines()]
    assert ra[0]["choices"][1]["turns"] == [] and rb[0]["choices"][0]["turns"] == []
    assert ra[0]["choices"][0]["turns"] == rb[0]["choices"][1]["turns"]


@pytest.mark.parametrize("extra, message", [
    (["--ar-only", "--skip-ar"], "exclude each other"),
    (["--ar-only", "--drafter-only"], "--ar-only and --drafter-only exclude each other"),  # both ran AR alone
    (["--ar-only", "--xpress-refine-passes", "4"], "--ar-only and --xpress-refine-passes exclude each other"),
    (["--ar-only", "--fair-k-list", "2"], "--ar-only and --fair-k-list exclude each other"),
    (["--drafter-only", "--xpress-refine-passes", "4"], "--drafter-only runs no xPress arm"),  # K was ignored
    (["--drafter-only", "--xpress-topc", "16"], "--xpress-topc would have no effect: --drafter-only runs no refiner"),
    (["--ar-only", "--block-size", "4", "--compile-refiner"],
     "--compile-refiner and --block-size would have no effect: --ar-only runs AR alone; drop them or --ar-only"),
    (["--block-size", "1"], "--block-size 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--draft-noise", "uniform"], "--draft-noise uniform"),  # greedy drafts draw no noise: it had no effect
    (["--record-logit-gaps", "--temperature", "1"], "--record-logit-gaps"),  # T>0: no divergence is reported
    (["--answer-file", "/nonexistent-dir/x.jsonl"], "does not exist"),
    (["--answer-file", str(ROOT)], "names a directory"),  # it failed only after the whole run, on a temporary name
    (["--trace", str(ROOT)], "names a directory"),
    (["--trace", "new-folder/"], "--trace new-folder/: names a directory"),  # not there yet, but named as a folder
    (["--attn-implementation", "flash_attention_2"], "attn-implementation"),
    (["--max-samples", "0"], "max"),
    (["--max-model-len", "10"], "raise --max-model-len above"),  # a prompt longer than the limit: what to raise
])
def test_bad_arguments_fail_before_loading(files, extra, message, capsys, monkeypatch):
    import harness.protocol.runner as runner
    monkeypatch.setattr(runner, "load_target", lambda *a, **k: pytest.fail("a model was loaded"))
    assert cli.main(args(files, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "\n" not in err


def test_bad_drafter_checkpoint_fails_before_loading(files, tmp_path, capsys, monkeypatch):
    import shutil
    import harness.protocol.runner as runner
    bad = tmp_path / "drafter"
    shutil.copytree(files / "drafter", bad)
    state = load_file(str(bad / "model.safetensors"))
    state.pop("fc.weight")
    save_file(state, str(bad / "model.safetensors"))
    monkeypatch.setattr(runner, "load_target", lambda *a, **k: pytest.fail("a model was loaded"))
    answers = tmp_path / "answers.jsonl"
    argv = args(files, "--answer-file", str(answers))
    argv[argv.index("--draft-name-or-path") + 1] = str(bad)
    assert cli.main(argv) == 2
    assert "fc.weight" in capsys.readouterr().err
    assert not answers.exists() and os.listdir(tmp_path) == ["drafter"]


def test_subprocess_error_has_no_traceback(files, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmark_compile_all.py"),
                           *args(files, "--dataset", "nope", "--answer-file", str(tmp_path / "x.jsonl"))],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("error:")
    assert not (tmp_path / "x.jsonl").exists()


def test_the_answer_file_help_names_the_files_a_paired_run_writes(tmp_path):
    """--answer-file F with several speculative arms writes F.<arm>.jsonl per arm and never F: --help says so (it
    said only "write per-sample JSONL results here"), with the names write_answer_files gives."""
    from types import SimpleNamespace
    from harness.protocol.answers import write_answer_files
    from harness.protocol.flags import build_parser
    text = " ".join(build_parser().format_help().split())
    assert "F itself is not written" in text and "answers.xpress-k-2.jsonl" in text
    f = tmp_path / "answers.jsonl"
    cfg = SimpleNamespace(answer_file=str(f), dataset="d", no_answer_timing=True)
    arms = [SimpleNamespace(name=n, spec=SimpleNamespace(method=m)) for n, m in
            (("AR", "ar"), ("drafter-only", "drafter-only"), ("xPress(K=2)", "xpress"))]
    written = [p for p, _ in write_answer_files(cfg, [{"round": 1, "arm": "AR", "question_id": 0, "turn": 0}], [],
                                                None, arms)]
    assert [os.path.basename(p) for p in written] == ["answers.drafter-only.jsonl", "answers.xpress-k-2.jsonl"]
    assert not f.exists()


def test_answer_files_are_written_before_the_summary_that_marks_the_run_finished(files, tmp_path, monkeypatch):
    """summary.json is the run's last file (--resume refuses a folder that has one): an interruption while the
    results folder is written leaves the answers written already, and no summary, so the run can still resume."""
    from harness.protocol import report, runner

    def stop(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(report, "write_results", stop)
    answers = tmp_path / "answers.jsonl"
    assert cli.main(args(files, "--answer-file", str(answers), "--run-id", "ans")) == 130
    assert answers.is_file() and not (files / "results" / "ans" / "summary.json").exists()
    assert runner.report is report  # the runner writes through the module patched here
