import json

from harness.lab import bench_refiner


def interpreter_sized(monkeypatch):
    """For the runs on Triton's CPU interpreter, which runs a launch's programs one by one in Python: a 64-token
    vocabulary (w2's readout, a one-row launch of 16 columns a program: 4 programs, not the tiny preset's 32) and
    no warmup calls (each call ran ~20 s at the tiny preset's 512). These tests check which ops and latents run and
    what is recorded, not the times."""
    monkeypatch.setitem(bench_refiner.PRESETS, "tiny", (64, *bench_refiner.PRESETS["tiny"][1:]))
    timed = bench_refiner.time_call
    monkeypatch.setattr(bench_refiner, "time_call", lambda fn, backend, repeats: timed(fn, backend, repeats, warmup=0))


def test_bench_refiner_writes_json_and_markdown(tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert bench_refiner.main(["--preset", "tiny", "--device", "cpu", "--repeats", "2", "--passes", "0,1,3",
                               "--topc", "0,4", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    kinds = {(r["refiner"], r["K"], r["topc"]) for r in data["rows"]}
    assert ("xpress", "per pass", 0) in kinds and ("xpress", 3, 4) in kinds and ("markov-rnn", "7 steps", 0) in kinds
    assert all(r["ms"] >= 0 for r in data["rows"] if r["K"] != "per pass")
    assert (tmp_path / "cost.md").read_text().startswith("Refinement cost") and "profile" not in data
    assert bench_refiner.main(["--preset", "tiny", "--passes", "-1"]) == 2
    assert bench_refiner.main(["--preset", "tiny", "--rank", "0"]) == 2


def test_bench_refiner_rank_overrides_the_presets_alone(tmp_path):
    """--rank: a recipe's head rank at a preset's vocab, hidden and block (smollm2-gpu-heads-xpress-r160's 160 at
    SmolLM2's shapes), recorded with the shapes the heads were built at."""
    out = tmp_path / "cost.json"
    assert bench_refiner.main(["--preset", "tiny", "--rank", "24", "--device", "cpu", "--repeats", "1", "--passes",
                               "1", "--topc", "0", "--out", str(out)]) == 0
    vocab, hidden, _, block = bench_refiner.PRESETS["tiny"]
    assert json.loads(out.read_text())["shapes"] == {"vocab": vocab, "hidden": hidden, "rank": 24, "block": block,
                                                     "xpress_mlp": 48}
    assert bench_refiner.main(["--preset", "tiny", "--profile", "-1"]) == 2


def test_bench_refiner_mlp_ratio_builds_the_head_it_records(tmp_path, monkeypatch):
    """--mlp-ratio: a recipe's xpress_mlp_ratio (the MLP's hidden over the rank); the head timed has that MLP, and
    the file says so. Power: an option not passed on builds the default 2 x rank."""
    built = []
    real = bench_refiner.random_xpress_head
    monkeypatch.setattr(bench_refiner, "random_xpress_head",
                        lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    out = tmp_path / "cost.json"
    assert bench_refiner.main(["--preset", "tiny", "--rank", "24", "--mlp-ratio", "4", "--device", "cpu", "--repeats",
                               "1", "--passes", "1", "--topc", "0", "--out", str(out)]) == 0
    assert built[0].mlp.gate_proj.weight.shape[0] == 96 and json.loads(out.read_text())["shapes"]["xpress_mlp"] == 96
    assert bench_refiner.main(["--preset", "tiny", "--mlp-ratio", "0"]) == 2


def test_bench_refiner_profiles_a_pass(tmp_path):
    """--profile K: xPress at K once more under torch.profiler (eager), each op's time per call, in the JSON and
    the markdown; on the CPU the ops' own host times (no kernels)."""
    out = tmp_path / "cost.json"
    assert bench_refiner.main(["--preset", "tiny", "--device", "cpu", "--repeats", "2", "--passes", "1",
                               "--topc", "0", "--profile", "2", "--out", str(out)]) == 0
    prof = json.loads(out.read_text())["profile"]
    assert prof["refiner"] == "xpress K=2" and prof["steps"] == 2 and prof["per"] == "call"
    assert prof["top"] and prof["wall_s_per_step"] > 0 and prof["sort"] == "own host time"
    assert "Profile of xpress K=2, eager, per call" in (tmp_path / "cost.md").read_text()


def test_bench_refiner_times_xpress_on_the_chosen_ops_and_compiled(tmp_path, monkeypatch):
    """--kernels triton scores each pass on TritonOps (the decode's fused w2 product, base add and argmax; Triton's
    interpreter here), --compile wraps every refiner in CompiledRefiner first (a stand-in here: compiling on this
    CPU takes minutes); both are named in the JSON and the markdown."""
    import pytest
    from core import ops as core_ops
    if not core_ops.interpreted():
        pytest.skip("needs Triton's CPU interpreter (TRITON_INTERPRET=1 and triton installed)")
    wrapped = []

    class Spy:
        def __init__(self, refiner, watch=None):
            wrapped.append(refiner.name)
            self.inner, self.name, self.passes = refiner, refiner.name, getattr(refiner, "passes", None)

        def refine(self, proposal, ctx):
            return self.inner.refine(proposal, ctx)
    monkeypatch.setattr(bench_refiner, "CompiledRefiner", Spy)
    interpreter_sized(monkeypatch)
    out = tmp_path / "cost.json"
    assert bench_refiner.main(["--preset", "tiny", "--device", "cpu", "--repeats", "1", "--passes", "1,2",
                               "--topc", "0", "--kernels", "triton", "--compile", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["kernels"] == "TritonOps" and data["compiled"] is True
    assert wrapped.count("xpress") == 2 and wrapped.count("markov") == 3
    assert "xPress ops TritonOps, latents fused (Triton) (mix " in (tmp_path / "cost.md").read_text()
    assert ", compiled=True" in (tmp_path / "cost.md").read_text()


def test_the_file_names_the_fused_latents_launch_it_timed(tmp_path, monkeypatch):
    """The fused latent's launch setting (the mix path and warps, module constants of core.kernels.xpress) is in
    the file and its table, so two files timed before and after a change of setting say which is which; a run on
    the torch ops records none. Power: a file that did not read the constants records the same setting twice."""
    import pytest
    from core import ops as core_ops
    from core.kernels import xpress
    if not core_ops.interpreted():
        pytest.skip("needs Triton's CPU interpreter (TRITON_INTERPRET=1 and triton installed)")
    interpreter_sized(monkeypatch)
    args = ["--preset", "tiny", "--device", "cpu", "--repeats", "1", "--passes", "1", "--topc", "0"]
    seen = []
    for mixt, warps in ((False, 4), (True, 8)):
        monkeypatch.setattr(xpress, "MIX_TRANSPOSED", mixt)
        monkeypatch.setattr(xpress, "WARPS", warps)
        out = tmp_path / f"cost{warps}.json"
        assert bench_refiner.main(args + ["--kernels", "triton", "--out", str(out)]) == 0
        seen.append(json.loads(out.read_text())["latent_launch"])
    assert [(s["mix"], s["num_warps"]) for s in seen] == [("by slot columns", 4), ("by rows (transposed)", 8)]
    assert "mix by rows (transposed), 8 warps" in (tmp_path / "cost8.md").read_text()
    assert bench_refiner.main(args + ["--kernels", "torch", "--out", str(tmp_path / "t.json")]) == 0
    assert json.loads((tmp_path / "t.json").read_text())["latent_launch"] is None
    # a head the kernel hands to the torch ops (MLP wider than one program takes): no launch recorded
    wide = str(4 * xpress.MAX_RANK // bench_refiner.PRESETS["tiny"][2] + 1)  # the MLP past 4 x MAX_RANK
    assert bench_refiner.main(args + ["--kernels", "triton", "--mlp-ratio", wide, "--out", str(tmp_path / "w.json")]) == 0
    assert json.loads((tmp_path / "w.json").read_text())["latent_launch"] is None


def test_bench_refiner_refuses_triton_where_it_cannot_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert bench_refiner.main(["--preset", "tiny", "--device", "cpu", "--kernels", "triton",
                               "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--kernels triton" in err[0] and not (tmp_path / "c.json").exists()


def test_unfused_latents_run_on_the_heads_modules_and_the_rest_on_the_kernels(tmp_path, monkeypatch):
    """--unfused-latents: the xPress pass's and the gated Markov step's latents on the heads' torch modules while the
    readout stays on --kernels triton (the fused kernels' effect on one machine); without it both latents launch
    their kernels. Launches counted in Triton's interpreter."""
    import pytest
    from core import kernels, ops as core_ops
    if not core_ops.interpreted():
        pytest.skip("needs Triton's CPU interpreter (TRITON_INTERPRET=1 and triton installed)")
    calls = {"xpress": 0, "markov": 0, "linear": 0}
    for attr, key in (("xpress_latent", "xpress"), ("markov_gated_latent", "markov"), ("linear", "linear")):
        real = getattr(kernels, attr)
        monkeypatch.setattr(kernels, attr, lambda *a, _r=real, _k=key, **kw: calls.__setitem__(_k, calls[_k] + 1)
                            or _r(*a, **kw))
    interpreter_sized(monkeypatch)
    args = ["--preset", "tiny", "--device", "cpu", "--repeats", "1", "--passes", "1", "--topc", "0",
            "--kernels", "triton"]
    out = tmp_path / "cost.json"
    assert bench_refiner.main(args + ["--out", str(out)]) == 0
    assert calls["xpress"] > 0 and calls["markov"] > 0
    assert json.loads(out.read_text())["latents"] == "fused (Triton)"
    calls.update(xpress=0, markov=0, linear=0)
    assert bench_refiner.main(args + ["--unfused-latents", "--out", str(out)]) == 0
    assert calls["xpress"] == calls["markov"] == 0 and calls["linear"] > 0
    assert json.loads(out.read_text())["latents"] == "torch modules (--unfused-latents)"
    assert "latents torch modules (--unfused-latents)" in (tmp_path / "cost.md").read_text()
