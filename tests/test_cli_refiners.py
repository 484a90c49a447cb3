"""The CLI with xPress and Markov checkpoints: lossless end to end, traces, and refusals before loading."""
import json

import pytest

import benchmark_compile_all as cli
from tiny import write_run_fixture

# tiny shapes: one intra-op thread (conftest.one_thread), as the other tiny-model modules run
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    rows = [{"turns": ["Add 2 and 3."]}, {"turns": ["Name a colour."]}, {"turns": ["Count to five."]}]
    return write_run_fixture(tmp_path_factory.mktemp("cli_ref"), rows)


def args(files, *extra):
    return ["--model-name-or-path", str(files / "target"), "--draft-name-or-path", str(files / "drafter"),
            "--dataset", "mini", "--data-dir", str(files / "data"), "--max-new-tokens", "14", "--device", "cpu",
            "--results-dir", str(files / "results"), *extra]


def answers(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.parametrize("extra, method", [
    (["--xpress-refiner-path", "xpress.pt", "--xpress-refine-passes", "2"], "xPress(K=2)"),
    (["--xpress-refiner-path", "xpress.pt", "--xpress-refine-passes", "3", "--xpress-topc", "5"], "xPress(K=3, C=5)"),
    (["--xpress-refiner-path", "xpress.pt", "--xpress-refine-passes", "1", "--xpress-prev-anchor",
      "--no-fold-mixer"], "xPress(K=1)"),
    (["--markov-refiner-path", "markov.pt"], "Markov"),
    (["--xpress-refiner-path", "xpress.pt", "--drafter-only"], "drafter-only (co-trained)"),
])
def test_refiner_runs_are_lossless(files, tmp_path, extra, method, capsys):
    extra = [str(files / x) if x.endswith(".pt") else x for x in extra]
    out, trace = tmp_path / "a.jsonl", tmp_path / "trace.jsonl"
    assert cli.main(args(files, *extra, "--answer-file", str(out), "--trace", str(trace))) == 0
    printed = capsys.readouterr().out
    assert method in printed and "[refiner]" in printed
    for row in answers(out):
        ar, spec = row["choices"]
        assert spec["method"] == method
        assert ar["turns"] == spec["turns"] and ar["new_tokens"] == spec["new_tokens"]
    steps = answers(trace)
    spec_steps = [s for s in steps if s["arm"] == method]
    assert spec_steps and all(len(s["draft"]) == 3 and len(s["seed_draft"]) == 3 for s in spec_steps)
    assert {s["question_id"] for s in spec_steps} == {0, 1, 2}
    if method.startswith(("xPress", "Markov")):
        assert any(s["draft"] != s["seed_draft"] for s in spec_steps), "the refiner never changed a draft"
    else:
        assert all(s["draft"] == s["seed_draft"] for s in spec_steps)


@pytest.mark.parametrize("extra, message", [
    (["--xpress-refiner-path", "xpress.pt", "--markov-refiner-path", "markov.pt"], "both given"),
    (["--xpress-refiner-path", "xpress.pt", "--xpress-topc", "200"], "--xpress-topc"),
    (["--xpress-topc", "2000"], "--xpress-topc"),
    (["--xpress-refine-passes", "-1"], "--xpress-refine-passes"),
    (["--xpress-refiner-path", "xpress.pt", "--block-size", "3"], "block"),
    (["--markov-refiner-path", "xpress.pt"], "xPress"),
    (["--xpress-refiner-path", "nope/a/b"], "user/repo"),
    (["--use-graph"], "--use-graph"),
])
def test_bad_refiner_input_fails_before_loading(files, tmp_path, extra, message, capsys, monkeypatch):
    import harness.protocol.runner as runner
    monkeypatch.setattr(runner, "load_target", lambda *a, **k: pytest.fail("a model was loaded"))
    extra = [str(files / x) if x.endswith(".pt") else x for x in extra]
    out = tmp_path / "a.jsonl"
    assert cli.main(args(files, *extra, "--answer-file", str(out))) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "\n" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("extra", [[], ["--compat-reference"], ["--draft-noise", "uniform", "--top-p", "0.9"]])
def test_seeded_replay_is_byte_identical_at_t1(files, tmp_path, extra, capsys):
    outs = []
    for i in range(2):
        out = tmp_path / f"r{i}.jsonl"
        argv = args(files, "--xpress-refiner-path", str(files / "xpress.pt"), "--xpress-refine-passes", "2",
                    "--temperature", "1.0", "--seed", "5", "--no-answer-timing", "--answer-file", str(out), *extra)
        assert cli.main(argv) == 0
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    assert "rejection sampling" in capsys.readouterr().out
    rows = [json.loads(x) for x in outs[0].decode().splitlines()]
    assert "wall_time" not in rows[0]["choices"][0] and "tstamp" not in rows[0]
    other = tmp_path / "other.jsonl"
    argv = args(files, "--xpress-refiner-path", str(files / "xpress.pt"), "--xpress-refine-passes", "2",
                "--temperature", "1.0", "--seed", "6", "--no-answer-timing", "--answer-file", str(other), *extra)
    assert cli.main(argv) == 0
    assert other.read_bytes() != outs[0]  # the seed matters
