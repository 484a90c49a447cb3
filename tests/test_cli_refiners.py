"""The CLI with xPress and Markov checkpoints: lossless end to end, traces, and refusals before loading."""
import json

import pytest

import benchmark_compile_all as cli
from tiny import write_run_fixture

# tiny shapes: one intra-op thread (conftest.one_thread), as the other tiny-model modules run
pytestmark = pytest.mark.usefixtures("one_thread", "no_plots_module")


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
    one = ["--max-samples", "1"]  # one prompt's 14 sampled tokens: a replay's bytes and another seed's differ there too
    outs = []
    for i in range(2):
        out = tmp_path / f"r{i}.jsonl"
        argv = args(files, "--xpress-refiner-path", str(files / "xpress.pt"), "--xpress-refine-passes", "2",
                    "--temperature", "1.0", "--seed", "5", "--no-answer-timing", "--answer-file", str(out),
                    *one, *extra)
        assert cli.main(argv) == 0
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    assert "rejection sampling" in capsys.readouterr().out
    rows = [json.loads(x) for x in outs[0].decode().splitlines()]
    assert "wall_time" not in rows[0]["choices"][0] and "tstamp" not in rows[0]
    other = tmp_path / "other.jsonl"
    argv = args(files, "--xpress-refiner-path", str(files / "xpress.pt"), "--xpress-refine-passes", "2",
                "--temperature", "1.0", "--seed", "6", "--no-answer-timing", "--answer-file", str(other), *one, *extra)
    assert cli.main(argv) == 0
    assert other.read_bytes() != outs[0]  # the seed matters


def test_cotrained_drafter_only_arms_run_each_refiners_drafter_in_the_paired_rounds(files, tmp_path, capsys,
                                                                                   monkeypatch):
    """--cotrained-drafter-only: the reference's drafter-only carries the xPress checkpoint's co-trained drafter, our
    paired rounds' the base one; the flag adds one arm per checkpoint with a drafter of its own, lossless like every
    arm, while "drafter-only" (the base drafter) stays the gains' reference and the table's drafter-only choice.
    Power: the weights each arm swaps in are checked against the checkpoint's drafter and the base one (the tiny
    random drafters draft alike, so their drafts cannot tell them apart)."""
    import torch
    from harness.protocol import build, report
    swapped, real = {}, build.Arm.activate

    def spy(arm):
        if arm.state is not None:
            swapped[arm.name] = sum(float(t.double().sum()) for t in arm.state.values())
        return real(arm)
    monkeypatch.setattr(build.Arm, "activate", spy)
    trace, results = tmp_path / "trace.jsonl", tmp_path / "res"
    heads = ["--xpress-refiner-path", str(files / "xpress.pt"), "--markov-refiner-path", str(files / "markov.pt")]
    heads += ["--max-samples", "1", "--max-new-tokens", "8"]  # 6 arms x 7 rounds of one prompt: each arm's rows
    monkeypatch.setattr(report, "write_plots", lambda *a, **k: [])  # (and no plots: none is read here)
    assert cli.main(args(files, *heads, "--fair-interleave", "--fair-k-list", "1", "--cotrained-drafter-only",
                         "--trace", str(trace), "--run-id", "cot", "--results-dir", str(results))) == 0
    own = ["drafter-only (xPress's drafter)", "drafter-only (Markov's drafter)"]
    printed = capsys.readouterr().out
    assert all(a in printed for a in own)
    summary = json.loads((results / "cot" / "summary.json").read_text())
    assert set(own) <= set(summary["arms"]) and summary["drafter_only_arm"] == "drafter-only"
    assert summary["optimal"]["drafter-only"]["arm"] == "drafter-only"
    from harness.protocol.results_io import read_rows
    rows = read_rows(next((results / "cot").glob("samples.jsonl*")))
    ar = {(r["question_id"], r["turn"], r["round"]): r["tokens"] for r in rows if r["arm"] == "AR"}
    for name in own:
        mine = [r for r in rows if r["arm"] == name]
        assert mine and all(r["method"] == "drafter-only" and r["tokens"] == ar[(r["question_id"], r["turn"], r["round"])]
                            for r in mine)
    cot = sum(float(t.double().sum()) for t in torch.load(files / "xpress.pt", weights_only=False)["draft_state_dict"].values())
    assert swapped[own[0]] == pytest.approx(cot) and swapped[own[1]] == pytest.approx(cot)  # one drafter in both
    assert swapped["drafter-only"] != pytest.approx(cot)  # the base drafter's weights, swapped back in
    assert {s["arm"] for s in answers(trace)} >= set(own)


@pytest.mark.parametrize("extra, message", [
    (["--xpress-refiner-path", "xpress.pt", "--cotrained-drafter-only"], "--fair-interleave"),
    (["--fair-interleave", "--cotrained-drafter-only"], "no refiner is given"),
    (["--fair-interleave", "--xpress-refiner-path", "frozen", "--cotrained-drafter-only"], "no refiner checkpoint"),
    (["--fair-interleave", "--xpress-refiner-path", "xpress.pt", "--cotrained-drafter-only", "--batch-sizes", "1,2"],
     "sweeps"),
])
def test_cotrained_drafter_only_refusals_come_before_loading(files, tmp_path, extra, message, capsys, monkeypatch):
    import torch
    from safetensors.torch import save_file
    import harness.protocol.runner as runner
    head = torch.load(files / "xpress.pt", weights_only=False)["refiner_state_dict"]
    frozen = tmp_path / "frozen"  # a head trained on a frozen drafter, as training.ship writes it: no drafter of
    frozen.mkdir()  # its own (a serving folder whose tensors are the head's alone)
    cfg = json.loads((files / "drafter" / "config.json").read_text())
    (frozen / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3XPressModel"]}))
    save_file({"xpress_head." + k: v.contiguous() for k, v in head.items()}, str(frozen / "model.safetensors"))
    monkeypatch.setattr(runner, "load_target", lambda *a, **k: pytest.fail("a model was loaded"))
    extra = [str(frozen) if x == "frozen" else str(files / x) if x.endswith(".pt") else x for x in extra]
    assert cli.main(args(files, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "\n" not in err, err


def test_only_the_base_drafter_stands_for_drafter_only():
    """comparisons.method_arms, which the gains' reference (report) and the throughput-optimal choice both read: a
    co-trained drafter's arm, even listed first, never stands for drafter-only while the base one ran; alone, it
    does; other methods keep every arm."""
    from harness.protocol import comparisons, report
    arms = {"AR": {"method": "ar"}, "drafter-only (xPress's drafter)": {"method": "drafter-only"},
            "drafter-only": {"method": "drafter-only"}, "xPress(K=1)": {"method": "xpress"},
            "xPress(K=2)": {"method": "xpress"}}
    assert comparisons.method_arms(arms, "drafter-only") == ["drafter-only"]
    assert report._pick(arms, "drafter-only", comparisons.BASE_DRAFTER_ARM) == "drafter-only"
    alone = {k: v for k, v in arms.items() if k != "drafter-only"}
    assert comparisons.method_arms(alone, "drafter-only") == ["drafter-only (xPress's drafter)"]
    assert comparisons.method_arms(arms, "xpress") == ["xPress(K=1)", "xPress(K=2)"]
