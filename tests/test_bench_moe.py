"""The MoE verify-cost bench at a tiny Gemma 4 scale on CPU, and the gemma4-26b-a4b preset's shapes on meta."""
import json

import pytest
import torch

from core.devices import Backend
from harness.lab import bench_moe
from harness.protocol.presets import build_random

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bench_runs_on_cpu_and_counts_expert_unions(tmp_path):
    out = tmp_path / "moe.json"
    assert bench_moe.main(["--preset", "gemma4-tiny", "--device", "cpu", "--blocks", "2,4,8", "--context", "24",
                           "--steps", "2", "--reps", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["label"] == "random weights / scripted acceptance" and (out.with_suffix(".md")).exists()
    unions = [r["rows"][b]["expert_union"] for b in ("2", "4", "8")]
    assert r["rows"]["AR"]["expert_union"] == 4 and 4 < unions[0] <= unions[1] <= unions[2] <= 16
    assert all(r["rows"][b]["verify_ms"] > 0 and r["rows"][b]["spec_step_ms"] > 0 for b in ("2", "4", "8"))
    # the spec step's own verifies check the random drafter's blocks, which repeat a few tokens: their union is
    # measured apart (the verify alone routes the prompt's distinct ids), and it is what the spec step's time read
    spec = [r["rows"][b]["spec_expert_union"] for b in ("2", "4", "8")]
    assert all(4 <= u <= 16 for u in spec) and spec[2] < unions[2]
    assert "expert union / layer (spec step)" in out.with_suffix(".md").read_text()
    assert set(r["best_block_at_tau"].values()) <= {2, 4, 8}


def test_bench_refuses_dense_presets(capsys):
    assert bench_moe.main(["--preset", "tiny", "--device", "cpu", "--context", "8", "--steps", "1"]) == 2
    assert "no mixture-of-experts" in capsys.readouterr().err


def test_gemma4_26b_a4b_preset_shapes_on_meta():
    m = build_random("gemma4-26b-a4b", Backend(torch.device("meta"), torch.bfloat16))
    t, d = m.target, m.drafter
    assert round(sum(p.numel() for p in t.model.parameters()) / 1e9, 2) == 25.23  # "25.2B total" as published
    assert t.n_layers == 30 and t.kinds.count("full_attention") == 5 and t.window == 1024 and t.cap == 30.0
    assert t.lm_head.weight is t.embed.weight and t.vocab_size == 262144
    assert t.taps == d.target_layer_ids == (1, 6, 11, 17, 22, 27) and d.mask_token_id == 4
    assert d.model.config.layer_types == ("sliding_attention",) * 4 + ("full_attention",)
    assert d.model.fc.weight.shape == (2816, 6 * 2816) and d.model.config.sliding_window == 2048
    assert t.layers[5].self_attn.v_proj is None and t.layers[5].self_attn.head_dim == 512  # k = v on full layers
    assert t.layers[0].experts.gate_up_proj.shape == (128, 2 * 704, 2816)
