"""--compile-all: the refinement steps compiled at fixed shapes, the cost reported, recompiles after warmup refused."""
import json

import pytest
import torch

import benchmark_compile_all as cli
from harness.decode.compiling import CompileWatch, recompile_error_types
from harness.protocol.results_io import read_folder_rows
from tiny import write_run_fixture

# tiny shapes: one intra-op thread (conftest.one_thread), as the other tiny-model modules run
pytestmark = pytest.mark.usefixtures("one_thread")


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


def test_release_puts_dynamo_settings_back():
    cfg = torch._dynamo.config
    names = [n for n in ("recompile_limit", "cache_size_limit") if hasattr(cfg, n)]
    before = {n: getattr(cfg, n) for n in names + ["error_on_recompile"]}
    watch = CompileWatch("eager")
    watch.freeze()
    assert cfg.error_on_recompile and all(getattr(cfg, n) >= 64 for n in names)
    watch.release()
    assert {n: getattr(cfg, n) for n in before} == before


def test_compile_refiner_uses_the_chosen_backend_without_the_guard(files, tmp_path, capsys, no_plots):
    torch._dynamo.reset()  # one prompt: what is checked is which functions were compiled, and how
    argv = ["--random-weights", "tiny", "--dataset", "mini", "--data-dir", str(files / "data"), "--device", "cpu",
            "--max-samples", "1", "--max-new-tokens", "8", "--fair-interleave", "--fair-k-list", "1",
            "--results-dir", str(tmp_path), "--compile-refiner", "--compile-backend", "eager"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    # every refiner (Markov too), with the backend asked for; no recompile guard without --compile-all
    assert "[compile] {'backend': 'eager', 'functions': 2" in out and "'recompile_guard': False" in out
    assert not torch._dynamo.config.error_on_recompile


def test_bad_backend():
    with pytest.raises(ValueError, match="compile backend"):
        CompileWatch("nope")


@pytest.mark.parametrize("temperature", ["0", "0.7"])
def test_cli_compile_all_reports_and_matches_uncompiled(files, tmp_path, capsys, temperature, no_plots):
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
    assert stats["graphs"] == 1 and stats["compile_s"] > 0 and stats["recompile_guard"] is True
    assert not torch._dynamo.config.error_on_recompile  # put back when the run ended
    plain, comp = ({(r["round"], r["arm"], r["question_id"], r["turn"]): r["tokens"]
                    for r in read_folder_rows(tmp_path / run)} for run in ("plain", "comp"))
    assert plain == comp and len(plain) > 4  # the same tokens, compiled or not


def test_compile_all_refuses_arms_the_warmup_never_compiled(files, tmp_path, capsys):
    """One new token: the warmup runs no speculative step, so the refiner would compile inside the timed rounds."""
    argv = ["--random-weights", "tiny", "--dataset", "mini", "--data-dir", str(files / "data"), "--device", "cpu",
            "--max-new-tokens", "1", "--fair-interleave", "--fair-k-list", "1", "--results-dir", str(tmp_path),
            "--compile-all", "--compile-backend", "eager"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "ran no speculative step for xPress(K=1)" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())  # no half-made results folder
    assert not torch._dynamo.config.error_on_recompile
