"""A drafter that train.warm_start continued is measured as it started, beside what it became (training/evaluate.py
WARM_FILE), on the same prompts with the same settings, so the two pair prompt by prompt (training/compare_tau.py).
Power: without the warm measurement there is no acceptance_warm.json; measured on other prompts, compare_tau refuses
the pair; the rerun that found both records kept measures nothing again."""
import json
import shutil

import pytest

from training_fixtures import run_cli, tiny_models, write_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_warm_started_drafter_is_measured_as_it_started_and_pairs(tmp_path, capsys):
    from training import compare_tau
    cfg = write_config(tmp_path, tiny_models(heads=False), train={"epochs": 2})
    assert run_cli("all", "--config", cfg, "--workdir", tmp_path / "one") == 0
    export = tmp_path / "one" / "export"
    assert len(list((export / "drafter").glob("model-*.safetensors"))) > 1  # shards (export.max_shard_mib)
    for stage in ("prompts", "responses", "hidden"):
        shutil.copytree(tmp_path / "one" / stage, tmp_path / "warm" / stage)
    sets = ["--set", f"train.warm_start={export}", "--set", "train.warm_mode=extend", "--set", "train.epochs=1"]
    capsys.readouterr()
    assert run_cli("all", "--config", cfg, "--workdir", tmp_path / "warm", *sets) == 0
    assert "acceptance drafter (its warm start" in capsys.readouterr().out
    d = tmp_path / "warm" / "train" / "drafter"
    warm, new = (json.loads((d / f).read_text()) for f in ("acceptance_warm.json", "acceptance.json"))
    step = json.loads((export / "drafter" / "train_state.json").read_text())["global_step"]
    assert warm["warm_start"] == str(export / "drafter") and warm["global_step"] == step < new["global_step"]
    assert warm["key"] != new["key"] and warm["dtype"] == new["dtype"]
    for s in ("selection", "heldout"):
        assert warm[s]["per_prompt"]["keys"] == new[s]["per_prompt"]["keys"] and warm[s]["prompts"] == new[s]["prompts"]
    rows = compare_tau.compare(str(d / "acceptance_warm.json"), str(d / "acceptance.json"))
    assert {r["set"] for r in rows} == {"selection", "heldout"} and all(r["prompts"] >= 1 for r in rows)
    # the same records, kept: a rerun measures neither again
    assert run_cli("all", "--config", cfg, "--workdir", tmp_path / "warm", *sets) == 0
    assert "acceptance drafter" not in capsys.readouterr().out
    # a record of other prompts does not pair
    other = json.loads((d / "acceptance_warm.json").read_text())
    other["heldout"]["per_prompt"]["keys"][0] = "ffffffff"
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(Exception, match="prompt 0 differs"):
        compare_tau.compare(str(tmp_path / "other.json"), str(d / "acceptance.json"), "heldout")
