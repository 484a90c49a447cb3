"""--compile-all: the refinement steps compiled at fixed shapes, the cost reported, recompiles after warmup refused."""
import json

import pytest
import torch

import benchmark_compile_all as cli
from harness.compiling import CompileWatch, recompile_error_types
from harness.results_io import read_rows
from tiny import write_run_fixture


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_run_fixture(tmp_path_factory.mktemp("comp"), [{"turns": ["Add 2 and 3."]}, {"turns": ["Hi."]}])


def test_watch_counts_compiles_and_refuses_recompiles_after_freeze():
    torch._dynamo.reset()
    watch = CompileWatch("eager")  # dynamo's guards and counters are the same whatever the backend
    f = watch.compile(lambda x: (x * 2).sin() + 1)
    x = torch.randn(4, 3)
    torch.testing.assert_close(f(x), (x * 2).sin() + 1)
    f(torch.randn(4, 3))  # same shape: no new graph
    assert watch.stats()["graphs"] == 1 and watch.functions == 1 and watch.seconds > 0
    watch.freeze()
    try:
        with pytest.raises(recompile_error_types()):
            f(torch.randn(5, 3))  # another shape after warmup: refused
    finally:
        watch.release()
    assert not torch._dynamo.config.error_on_recompile


def test_bad_backend():
    with pytest.raises(ValueError, match="compile backend"):
        CompileWatch("nope")


@pytest.mark.parametrize("temperature", ["0", "0.7"])
def test_cli_compile_all_reports_and_matches_uncompiled(files, tmp_path, capsys, temperature):
    """Sampled drafts too: the run's one draft sampler is shared by every generation, so nothing recompiles."""
    torch._dynamo.reset()
    base = ["--random-weights", "tiny", "--dataset", "mini", "--data-dir", str(files / "data"), "--device", "cpu",
            "--max-new-tokens", "10", "--fair-interleave", "--fair-k-list", "2", "--results-dir", str(tmp_path),
            "--temperature", temperature]
    assert cli.main(base + ["--run-id", "plain"]) == 0
    assert cli.main(base + ["--run-id", "comp", "--compile-all", "--compile-backend", "eager"]) == 0
    out = capsys.readouterr().out
    # xPress(K=2) only: the Markov head declares compile_helps = False (slower compiled on the H200)
    assert "[compile] {'backend': 'eager', 'functions': 1" in out and "'recompile_guard': True" in out
    stats = json.loads((tmp_path / "comp" / "summary.json").read_text())["compile"]
    assert stats["graphs"] == 1 and stats["compile_s"] > 0
    plain, comp = ({(r["round"], r["arm"], r["question_id"], r["turn"]): r["tokens"]
                    for r in read_rows(tmp_path / run / "samples.jsonl")} for run in ("plain", "comp"))
    assert plain == comp and len(plain) > 4  # the same tokens, compiled or not
