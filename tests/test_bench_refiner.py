import json

from harness.lab import bench_refiner


def test_bench_refiner_writes_json_and_markdown(tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert bench_refiner.main(["--preset", "tiny", "--device", "cpu", "--repeats", "2", "--passes", "0,1,3",
                               "--topc", "0,4", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    kinds = {(r["refiner"], r["K"], r["topc"]) for r in data["rows"]}
    assert ("xpress", "per pass", 0) in kinds and ("xpress", 3, 4) in kinds and ("markov-rnn", "7 steps", 0) in kinds
    assert all(r["ms"] >= 0 for r in data["rows"] if r["K"] != "per pass")
    assert (tmp_path / "cost.md").read_text().startswith("Refinement cost")
    assert bench_refiner.main(["--preset", "tiny", "--passes", "-1"]) == 2
