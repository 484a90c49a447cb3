"""harness.lab.bench_batch: the batched AR and verify steps at each (B, context), with their byte floors computed
from the shapes and the measured copy bandwidth; refusals are one line with exit 2 and no file."""
import json

import pytest

from harness.lab import bench_batch

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_point_is_timed_against_its_floor(tmp_path):
    out = tmp_path / "b.json"
    assert bench_batch.main(["--preset", "tiny", "--device", "cpu", "--batch-sizes", "1,3", "--contexts", "8,40",
                             "--block-size", "4", "--reps", "2", "--warmup", "1", "--one-row-pdl", "on",
                             "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["label"] == "random weights" and res["graphs"] is False and res["kernels"] == "torch"
    assert res["reps"] == 2 and res["warmup"] == 1 and res["one_row_pdl"] is False  # the torch ops launch nothing
    assert res["complete"] is True and res["planned_points"] == 8 and "Incomplete" not in (tmp_path / "b.md").read_text()
    assert not list(tmp_path.glob("*.partial.*"))  # a finished run leaves only OUT
    got = {(r["batch"], r["context"], r["width"]) for r in res["rows"]}
    assert got == {(b, c, w) for b in (1, 3) for c in (8, 40) for w in (1, 4)}
    bw = res["copy_bandwidth_GBps"] * 1e9
    # tiny: 4 layers, 2 K/V heads of 16, fp32 on the CPU
    for r in res["rows"]:
        assert r["kv_bytes"] == r["batch"] * (r["context"] + r["width"]) * 4 * 2 * 2 * 16 * 4
        assert r["floor_ms"] == pytest.approx(1000 * (r["weight_bytes"] + r["kv_bytes"]) / bw, rel=1e-3)
        assert r["ratio"] == pytest.approx(r["ms"] / r["floor_ms"], rel=1e-2)
        assert r["positions_per_s"] == pytest.approx(r["batch"] * r["width"] / r["ms"] * 1000, rel=1e-3)
        assert "tokens_per_s" not in r  # a verify's positions are not tokens decoded
        # tiny's parameters a step reads, counted by hand: per layer q/o 64x64, k/v 64x32, the MLP 3 x 64x128,
        # q/k norms 16 each and two 64-wide norms; then the final norm and lm_head 512x64 (untied)
        params = 4 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 16 + 2 * 64) + 64 + 512 * 64
        assert r["weight_bytes"] == params * 4
        rows, slots = r["batch"] * r["width"], r["context"] + r["width"]
        assert r["flop"] == 2 * rows * params + 4 * rows * slots * 4 * 16 * 4  # 4 query heads of 16, 4 layers
        assert r["compute_floor_ms"] == pytest.approx(1000 * r["flop"] / (res["matmul_TFLOPs"] * 1e12), rel=1e-3)
        roof = max(r["floor_ms"], r["compute_floor_ms"])
        assert r["roofline_ratio"] == pytest.approx(r["ms"] / roof, rel=1e-2)
    assert res["matmul_TFLOPs"] > 0 and res["matmul_shape"] == "256x256x256 float32"
    md = (tmp_path / "b.md").read_text()
    assert "| verify | 3 | 40 |" in md and "| positions/s |" in md and "tok/s" not in md
    assert "| compute floor ms | ratio to the higher |" in md and "matmul rate" in md


@pytest.mark.parametrize("args,says", [(["--batch-sizes", "0"], "out of range"),
                                       (["--contexts", "2000"], "max_position_embeddings"),
                                       (["--reps", "0"], "--reps"),
                                       (["--contexts", "8", "--graphs"], "--graphs captures CUDA graphs"),
                                       (["--wide-rows"], "add --kernels triton")])
def test_bad_arguments_are_one_line(tmp_path, capsys, monkeypatch, args, says):
    out = tmp_path / "b.json"
    monkeypatch.setattr(bench_batch, "build_random", lambda *a, **k: pytest.fail("a model was built"))
    assert bench_batch.main(["--preset", "tiny", "--device", "cpu", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and not out.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_graphed_points_are_timed_on_a_gpu(tmp_path):
    out = tmp_path / "g.json"
    assert bench_batch.main(["--preset", "tiny", "--device", "cuda", "--batch-sizes", "1,3", "--contexts", "8",
                             "--block-size", "4", "--reps", "3", "--warmup", "1", "--graphs", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["graphs"] is True and all(r["ms"] > 0 for r in res["rows"])
    assert "one CUDA graph per point" in (tmp_path / "g.md").read_text()


def test_a_point_that_fails_leaves_the_points_before_it_written(tmp_path, monkeypatch, capsys):
    """A run stopped by a point (on the H200 a verify's kernel was refused for shared memory, and every point
    before it was lost with the process) keeps the measured points in OUT's .partial JSON and table, marked
    incomplete with what stopped it, and leaves an earlier complete OUT as it was; the error still ends the run."""
    out = tmp_path / "b.json"
    out.write_text("{\"complete\": true}\n")  # an earlier run's result
    real = bench_batch.BatchTarget.verify

    def refuse_wide(self, ids, *a, **k):
        if ids.shape[1] > 1 and self.rows == 3:
            raise RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 232448")
        return real(self, ids, *a, **k)
    monkeypatch.setattr(bench_batch.BatchTarget, "verify", refuse_wide)
    with pytest.raises(RuntimeError, match="out of resource"):
        bench_batch.main(["--preset", "tiny", "--device", "cpu", "--batch-sizes", "1,3", "--contexts", "8",
                          "--block-size", "4", "--reps", "1", "--warmup", "0", "--out", str(out)])
    assert json.loads(out.read_text()) == {"complete": True} and not (tmp_path / "b.md").exists()
    res = json.loads((tmp_path / "b.partial.json").read_text())
    assert res["complete"] is False and res["planned_points"] == 4
    assert [(r["batch"], r["width"]) for r in res["rows"]] == [(1, 1), (1, 4), (3, 1)]
    assert res["stopped_by"].startswith("RuntimeError: out of resource")
    assert "**Incomplete**: 3 of 4 points measured (RuntimeError" in (tmp_path / "b.partial.md").read_text()
    assert "stopped after 3 points" in capsys.readouterr().out
