"""bench_step and its pieces on the CPU: the tiny preset end to end (no graphs), stage timing, scripted
acceptance, and the refusal of --use-graph off CUDA."""
import json

import pytest
import torch

from harness.lab import bench_step
from core.errors import UsageError
from harness.decode.graphs import StepGraphs
from harness.decode.loop import DecodeSettings, generate
from harness.decode.timing import StageTimer
from tiny import CPU32, tiny_drafter, tiny_target


def test_use_graph_on_cpu_is_a_clear_error():
    t = tiny_target("qwen3")
    with pytest.raises(UsageError, match="needs --device cuda"):
        generate(t, [9, 10, 11], DecodeSettings(5, 512, (), use_graph=True), CPU32)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_scripted_accept_must_be_a_count(bad):
    t = tiny_target("qwen3")
    with pytest.raises(UsageError, match="scripted-accept"):
        generate(t, [9, 10, 11], DecodeSettings(5, 512, (), scripted_accept=bad), CPU32)


def test_scripted_acceptance_is_clipped_to_the_block_and_keeps_target_tokens():
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block=4)
    g = generate(t, [9, 10, 11], DecodeSettings(21, 512, (), scripted_accept=9), CPU32, drafter=d)
    assert g.accepted == [3] * 5 and g.accept_lengths == [4] * 5
    # N = 0: every step emits the target's own token after the anchor, which is plain greedy AR
    ar = generate(t, [9, 10, 11], DecodeSettings(12, 512, ()), CPU32)
    g = generate(t, [9, 10, 11], DecodeSettings(12, 512, (), scripted_accept=0), CPU32, drafter=d)
    assert g.tokens == ar.tokens and g.accepted == [0] * 11


def test_stage_timer_sees_every_stage_and_the_host_gap():
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block=4)
    timer = StageTimer(torch.device("cpu"))
    g = generate(t, [9, 10, 11], DecodeSettings(13, 512, (), scripted_accept=3), CPU32, drafter=d, mark=timer)
    steps = timer.steps()
    assert len(steps) == len(g.accepted) == 3
    assert set(steps[1]) == {"draft", "refine", "verify", "accept", "observe", "pack", "step", "host"}
    assert abs(sum(v for k, v in steps[1].items() if k not in ("step", "host")) - steps[1]["step"]) < 1e-6
    assert timer.summary(skip=1)["n_steps"] == 2


def test_graph_lengths_are_bucketed():
    assert StepGraphs.length(130, 256, 1024) == 256 and StepGraphs.length(257, 256, 1024) == 512
    assert StepGraphs.length(1000, 256, 1000) == 1000 and StepGraphs.length(3, 0, 777) == 777
    assert StepGraphs.capacity_for(300, 256) == 512 and StepGraphs.capacity_for(300, 0) == 300


def test_bench_step_tiny_on_cpu(tmp_path, capsys):
    out = tmp_path / "perf" / "cpu_tiny.json"
    rc = bench_step.main(["--preset", "tiny", "--device", "cpu", "--ks", "1,2", "--topc", "0,8", "--new-tokens",
                          "12", "--prompt-len", "16", "--hf-tokens", "4", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["label"] == "random weights / scripted acceptance"
    assert [a["arm"] for a in r["arms"]] == ["AR", "drafter-only", "Markov", "xPress(K=1)", "xPress(K=2)",
                                             "xPress(K=1, C=8)", "xPress(K=2, C=8)"]
    assert r["roofline_ms"] > 0 and r["arms"][1]["eager"]["verify"] > 0
    md = out.with_suffix(".md").read_text()
    assert "random weights / scripted acceptance" in md and "| xPress(K=2, C=8) |" in md


def test_bench_step_compile_reports_one_graph_per_refiner(tmp_path):
    import torch
    torch._dynamo.reset()  # compiled code cached by earlier tests would be reused, not counted
    out = tmp_path / "c.json"
    rc = bench_step.main(["--preset", "tiny", "--device", "cpu", "--ks", "2", "--topc", "0", "--new-tokens", "12",
                          "--prompt-len", "16", "--skip-hf", "--compile", "--compile-backend", "eager",
                          "--out", str(out)])
    assert rc == 0
    c = json.loads(out.read_text())["compile"]
    assert c["functions"] == 2 and c["graphs"] == 2  # Markov and xPress(K=2), each compiled once, never again


def test_markdown_shows_levers_long_prompt_and_profile():
    r = {"preset": "p", "label": "L", "device_name": "d", "dtype": "bf16", "prompt_len": 8, "block_size": 4,
         "torch": "t", "transformers": "tf", "scripted_accept_per_arm": 1, "copy_bandwidth_GBps": 1.0,
         "weight_bytes": 1e9, "weight_bytes_read_per_step": 1e9, "roofline_ms": 1.0, "roofline_read_ms": 1.0,
         "arms": [], "tau_sweep": [], "attention": {}, "hf_reference": {},
         "fusion": {"no PDL": 4.4}, "fusion_drafter_only": {"no PDL": 5.7},
         "long_prompt": {"prompt_len": 2048, "AR, attention split": 4.66},
         "profile": [{"arm": "ar", "steps": 3, "step_ms": 4.0, "kernel_sum_ms": 3.5, "gap_ms": 0.5,
                      "kernels": [{"kernel": "_linear_kernel", "calls_per_step": 145.0, "us_per_step": 3000.0}]}]}
    md = bench_step.markdown(r)
    assert "Drafter-only step, graphed device ms: no PDL: 5.700" in md
    assert "after a 2048-token prompt (ms): AR, attention split: 4.660" in md
    assert "| `_linear_kernel` | 145.0 | 3000.0 |" in md and "gaps 0.500 ms" in md
    assert "stages from CUDA events" in md  # no device recorded: a GPU run's file, as the committed ones
    assert "stages from the host clock" in bench_step.markdown({**r, "device": "cpu"})  # the CPU's timer, named


def test_long_prompt_leaves_room_in_the_models_context():
    assert bench_step.long_prompt_len(2048, 40960, 64, 16) == 2048
    assert bench_step.long_prompt_len(2048, 1024, 64, 16) == 1024 - 64 - 32  # the tiny preset's context
    assert bench_step.long_prompt_len(2048, 64, 64, 16) == 0
