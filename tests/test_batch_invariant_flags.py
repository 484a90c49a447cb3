"""--batch-invariant (issue 28): refused without --kernels triton before anything loads, handed to the kernels as
Launch(batch_invariant=True), recorded in config.json and named wherever the tables label the kernels; the torch
ops on CUDA are labelled near-equal. bench_step times both kinds."""
import dataclasses
import json

import pytest

from core.errors import UsageError
from harness.protocol import facts, flags
from harness.protocol.config import RunConfig


def test_batch_invariant_needs_the_triton_kernels():
    """Guards the refusal: before, the flag did not exist; now it is a one-line UsageError from parsing (no model
    is loaded), naming --kernels triton."""
    for kernels in ("auto", "torch"):
        with pytest.raises(UsageError, match=r"--batch-invariant .*needs --kernels triton") as e:
            flags.parse_args(["--batch-invariant", "--kernels", kernels])
        assert "\n" not in str(e.value)


def test_config_json_records_the_setting():
    """Guards the record: the run's config (config.json's top level is dataclasses.asdict of it) holds the flag
    (the runner handing it to the kernels: tests/test_batch_invariant.py)."""
    cfg = flags.parse_args(["--random-weights", "tiny", "--kernels", "torch"])
    assert dataclasses.asdict(cfg)["batch_invariant"] is False
    cfg = dataclasses.replace(cfg, kernels="triton", batch_invariant=True)
    assert json.loads(json.dumps(dataclasses.asdict(cfg)))["batch_invariant"] is True


def test_the_kernels_label_says_whether_outputs_are_bitwise_ar():
    """Guards the labels: a batch-invariant run is 'triton batch-invariant (not yet verified on a GPU)' in the run
    facts (table titles, CSV, plots) unless its config.json records the GPU run that verified the kernels (then
    'triton batch-invariant'; before, it was that label unverified); the torch ops on CUDA are 'torch
    (near-equal)'; elsewhere the kernels as before."""
    res = {"device": "cuda:0", "dtype": "bfloat16", "kernels": "triton"}
    unverified = "triton batch-invariant (not yet verified on a GPU)"
    for record in ({}, {"batch_invariant_verified_on_gpu": None}):
        inv = facts.run_facts({"batch_invariant": True, "resolved": {**res, **record}})
        assert inv["kernels"] == unverified and f"kernels={unverified}" in facts.describe(inv)
    done = {**res, "batch_invariant_verified_on_gpu": "2026-12-03 abc1234"}
    assert facts.run_facts({"batch_invariant": True, "resolved": done})["kernels"] == "triton batch-invariant"
    assert facts.run_facts({"resolved": res})["kernels"] == "triton"
    assert facts.run_facts({"resolved": {**res, "kernels": "torch"}})["kernels"] == "torch (near-equal)"
    assert facts.run_facts({"resolved": {**res, "device": "cpu", "kernels": "torch"}})["kernels"] == "torch"
    assert facts.run_facts({})["kernels"] == facts.UNKNOWN


def test_config_json_records_whether_a_gpu_run_verified_the_kernels(monkeypatch):
    """Guards the record behind the label: with --batch-invariant the plan's "resolved" section (config.json)
    holds core.kernels.invariant.VERIFIED_ON_GPU, None until the lead sets it after a GPU run; without the flag,
    nothing. Before, config.json did not say."""
    from core.kernels import invariant
    from harness.protocol.plan import invariant_record
    cfg = RunConfig(model_name_or_path="m", draft_name_or_path=None, dataset="d", kernels="triton")
    assert invariant_record(cfg) == {}
    on = dataclasses.replace(cfg, batch_invariant=True)
    assert invariant_record(on) == {"batch_invariant_verified_on_gpu": invariant.VERIFIED_ON_GPU}
    monkeypatch.setattr(invariant, "VERIFIED_ON_GPU", None)
    assert invariant_record(on) == {"batch_invariant_verified_on_gpu": None}
    monkeypatch.setattr(invariant, "VERIFIED_ON_GPU", "2026-12-03 abc1234")
    assert invariant_record(on) == {"batch_invariant_verified_on_gpu": "2026-12-03 abc1234"}


def test_a_run_from_before_the_flag_still_resumes(tmp_path):
    """Guards --resume of a folder whose config.json predates --batch-invariant: it ran with it off."""
    from harness.protocol.plan import check_resume
    cfg = RunConfig(model_name_or_path="m", draft_name_or_path=None, dataset="d")
    old = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "batch_invariant"}
    (tmp_path / "config.json").write_text(json.dumps(old))
    check_resume(cfg, str(tmp_path))
    with pytest.raises(UsageError, match="--batch-invariant"):
        check_resume(dataclasses.replace(cfg, kernels="triton", batch_invariant=True), str(tmp_path))


def test_bench_step_refuses_it_on_the_torch_ops(capsys):
    """Guards bench_step's --batch-invariant: refused on the torch ops (one line, exit 2)."""
    from harness.lab import bench_step
    assert bench_step.main(["--preset", "tiny", "--batch-invariant", "--kernels", "torch", "--device", "cpu"]) == 2
    assert "--batch-invariant" in capsys.readouterr().err
