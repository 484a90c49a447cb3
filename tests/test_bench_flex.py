"""bench_flex on the CPU at a tiny shape: end to end, its rows, the variants' check against the default (and that a
wrong variant fails it), its mask statistics against speculators' dense mask, the kernels' register report, and
the CUDA rows' gradient path with dense attention standing in for flex (which has no CPU backward)."""
import json

import pytest
import torch

from training import bench_flex

pytest.importorskip("speculators.models.dflash.attention", reason="speculators (training extras)")
pytestmark = pytest.mark.usefixtures("one_thread")
TINY = ["--device", "cpu", "--tokens", "512", "--anchors", "32", "--doc-len", "100", "--reps", "1", "--warmup", "1"]
COMPARED = ("fwd_bm64_bn64", "fwd_warps8", "gqa_repeat")


def test_runs_on_cpu_and_variants_match_the_default(tmp_path):
    out = tmp_path / "flex.json"
    names = ["default", *COMPARED, "noop_mask_mod", "unsorted", "flash"]
    assert bench_flex.main([*TINY, "--variants", ",".join(names), "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert out.with_suffix(".md").exists() and r["all_match"] is True
    assert "eager" in r["mode"] and r["device"] == "cpu" and r["dtype"] == "float32"
    rows = {w["variant"]: w for w in r["rows"]}
    assert list(rows) == names and rows["flash"] == {"variant": "flash", "skipped": "CUDA only"}
    assert all(rows[n]["fwd_ms"] > 0 and "bwd_ms" not in rows[n] for n in names[:-1])  # no flex backward on CPU
    for n in COMPARED:  # the same output as the default, within the dtype's tolerance
        c = rows[n]["check"]
        assert c["matches"] and c["tolerance"] == 8 * torch.finfo(torch.float32).eps and set(c["rel_err"]) == {"out"}
    assert rows["gqa_repeat"]["kv_heads_in_kernel"] == 9 and rows["default"]["kv_heads_in_kernel"] == 3
    assert "check" not in rows["noop_mask_mod"] and "check" not in rows["unsorted"]  # other masks: not compared
    m = r["masks"]
    assert set(m) == {"default", "noop", "unsorted"} and m["default"]["q_len"] == 32 * 16
    assert m["default"]["kv_len"] == 512 + 32 * 16 and m["noop"]["partial_blocks"] == m["default"]["partial_blocks"]
    # unsorted anchors scatter each Q block's anchors over the row: no fewer blocks than sorted ones
    assert m["unsorted"]["partial_blocks"] + m["unsorted"]["full_blocks"] >= \
        m["default"]["partial_blocks"] + m["default"]["full_blocks"]


def test_a_wrong_variant_fails_the_check(tmp_path, monkeypatch, capsys):
    # heads in the wrong order: query head h would read KV head h % 3 instead of h // 3
    monkeypatch.setattr(bench_flex, "expand_kv", lambda x, groups: x.repeat(1, groups, 1, 1))
    out = tmp_path / "flex.json"
    assert bench_flex.main([*TINY, "--variants", "default,gqa_repeat,fwd_bm64_bn64", "--out", str(out)]) == 1
    r = json.loads(out.read_text())
    rows = {w["variant"]: w for w in r["rows"]}
    assert r["all_match"] is False and not rows["gqa_repeat"]["check"]["matches"]
    assert rows["gqa_repeat"]["check"]["rel_err"]["out"] > 0.01 and rows["fwd_bm64_bn64"]["check"]["matches"]
    assert "differ from the default" in capsys.readouterr().err and "DIFFERS" in out.with_suffix(".md").read_text()


def test_mask_statistics_match_speculators_dense_mask():
    from speculators.models.dflash.attention import create_anchor_block_mask_mod
    from speculators.models.dflash.utils import select_anchors
    from torch.nn.attention.flex_attention import create_block_mask, create_mask
    tokens, block = 900, 8  # KV not a multiple of 128 (a partial last block); long documents (some full blocks)
    docs, loss = bench_flex.packed_row(tokens, 700, 0.3, seed=3)
    assert (docs[0, -1] == -1 or docs[0, -1] == docs.max()) and loss[docs == -1].sum() == 0
    torch.manual_seed(3)
    anchors, _ = select_anchors(loss, 48, block)
    mod, q_len, kv_len = create_anchor_block_mask_mod(docs.squeeze(0), tokens, anchors, block)
    dense = create_mask(mod, None, None, q_len, kv_len, device="cpu")[0, 0]
    assert bench_flex.useful_pairs(docs, anchors, block) == int(dense.sum())
    bm = create_block_mask(mod, None, None, q_len, kv_len, device="cpu")
    s = bench_flex.mask_stats(bm, int(dense.sum()), heads=9, head_dim=64)
    pad = torch.zeros(-(-q_len // 128) * 128, -(-kv_len // 128) * 128, dtype=torch.bool)
    pad[:q_len, :kv_len] = dense
    tiles = pad.view(pad.shape[0] // 128, 128, pad.shape[1] // 128, 128)
    seen, filled = tiles.any(3).any(1), tiles.all(3).all(1)
    assert s["partial_blocks"] + s["full_blocks"] == int(seen.sum()) and s["full_blocks"] == int(filled.sum()) > 0
    assert s["computed_pairs"] == int(seen.sum()) * 128 * 128 and s["kv_blocks"] == pad.shape[1] // 128
    assert s["fwd_gflop_useful"] == pytest.approx(4 * 64 * 9 * int(dense.sum()) / 1e9)


@pytest.mark.parametrize("args, words", [(["--variants", "default,nope"], "unknown nope"),
                                         (["--kv-heads", "2"], "multiple of --kv-heads"),
                                         (["--reps", "0"], "--reps")])
def test_bad_input_is_one_error_line(args, words, capsys):
    assert bench_flex.main([*TINY, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and words in err and "\n" not in err


def test_flex_kernels_reads_the_loaded_kernels(monkeypatch):
    import types
    from torch._inductor.codecache import PyCodeCache
    cfg = types.SimpleNamespace(num_warps=4, num_stages=3)
    src = ("def k(a):\n    BLOCK_M : tl.constexpr = 128\n    BLOCK_N : tl.constexpr = 128\n"
           "    IS_DIVISIBLE : tl.constexpr = False\n    INDEX_DTYPE : tl.constexpr = tl.int32\n")
    launcher = types.SimpleNamespace(n_regs=255, n_spills=96, shared=114688, config=cfg)
    kernel = types.SimpleNamespace(launchers=[launcher], fn=types.SimpleNamespace(src=src))
    mod = types.ModuleType("fake_output_code")
    mod.triton_tem_fused_flex_attention_0, mod.triton_poi_fused_0 = kernel, kernel
    monkeypatch.setattr(PyCodeCache, "modules", [mod])
    monkeypatch.setattr(PyCodeCache, "modules_no_attr", {})
    seen: set = set()
    got = bench_flex.flex_kernels(seen)
    assert got == [{"kernel": "triton_tem_fused_flex_attention_0", "n_regs": 255, "num_warps": 4, "n_spills": 96,
                    "shared_bytes": 114688, "num_stages": 3, "BLOCK_M": "128", "BLOCK_N": "128",
                    "IS_DIVISIBLE": "False", "tile_elems_per_thread": 128}]
    assert bench_flex.flex_kernels(seen) == []  # each kernel reported once


def test_gradient_path_with_a_dense_stand_in():
    """The CUDA rows' fwd+bwd timing, gradient folding of gqa_repeat and gradient check, on the CPU: flex attention
    replaced by dense SDPA over speculators' mask (flex has no CPU backward)."""
    import argparse
    from torch.nn.attention.flex_attention import create_mask

    def dense(q, k, v, block_mask, enable_gqa, scale, kernel_options=None):
        mask = create_mask(block_mask.mask_mod, None, None, q.shape[2], k.shape[2], device="cpu")
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                enable_gqa=enable_gqa)

    a = argparse.Namespace(tokens=256, doc_len=80, prompt_share=0.3, anchors=16, block_size=8, heads=6, kv_heads=2,
                           head_dim=32, seed=1, reps=2, warmup=1)
    bench = bench_flex.Bench(a, torch.device("cpu"), torch.float32)
    bench.grad, bench.flex = True, dense
    rows, got = zip(*(bench.run(n) for n in ("default", "gqa_repeat", "fwd_warps8")))
    assert all(r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["fwd_bwd_ms"] >= r["bwd_ms"] for r in rows)
    assert rows[0]["bwd_tflops_computed"] > 0 and got[0]["dk"].shape == (1, 2, 256 + 16 * 8, 32)
    for g in got[1:]:
        c = bench_flex.compare(g, got[0], torch.float32)
        assert set(c["rel_err"]) == {"out", "dq", "dk", "dv"} and c["matches"], c
    wrong = dict(got[1], dk=got[1]["dk"].flip(1))  # the KV heads' gradients swapped
    assert not bench_flex.compare(wrong, got[0], torch.float32)["matches"]
