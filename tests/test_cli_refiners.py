"""The CLI with xPress and Markov checkpoints: lossless end to end, traces, and refusals before loading."""
import argparse
import json

import pytest
import torch

import benchmark_compile_all as cli
from drafters.dflash import random_dflash, save_dflash
from refiners.markov import random_markov_head
from refiners.xpress import random_xpress_head
from tiny import save_tiny_checkpoint, tiny_drafter, tiny_target

XPRESS_ARGS = dict(markov_rank=8, mlp_ratio=2, no_residual=True, input_mode="concat", no_sublayer_norm=True,
                   no_mix_out=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_ref")
    save_tiny_checkpoint(root / "target")
    t = tiny_target("qwen3")
    base = tiny_drafter(t, block=4)
    save_dflash(base.model, root / "drafter")
    cotrained = random_dflash(base.model.config, seed=11).state_dict()
    head = random_xpress_head(128, 64, 8, 4, seed=2, std=0.3)
    raw = {k: v for k, v in head.state_dict().items()}
    torch.save({"draft_state_dict": cotrained, "refiner_state_dict": raw, "global_step": 7,
                "args": argparse.Namespace(**XPRESS_ARGS)}, root / "xpress.pt")
    mk = random_markov_head("vanilla", 128, 64, 8, seed=3, std=0.3)
    torch.save({"draft_state_dict": cotrained, "refiner_state_dict": mk.state_dict(), "global_step": 9,
                "args": argparse.Namespace(markov_rank=8)}, root / "markov.pt")
    data = root / "data"
    data.mkdir()
    rows = [{"turns": ["Add 2 and 3."]}, {"turns": ["Name a colour."]}, {"turns": ["Count to five."]}]
    (data / "mini.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


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
    import harness.runner as runner
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
