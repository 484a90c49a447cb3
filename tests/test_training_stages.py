"""training/stages.py: a stage's seconds are the call that did its work; a call that only measured acceptance again
keeps them and records its own beside them (it once replaced the train stage's seconds with the re-measure's)."""
import json
import time

from training.stages import FILE, stage_clock


def test_a_remeasure_keeps_the_training_calls_seconds(tmp_path):
    d = tmp_path / "train" / "drafter"
    d.mkdir(parents=True)
    with stage_clock(tmp_path, "train"):
        (d / "manifest.json").write_text("{}")
        time.sleep(0.3)
    trained = json.loads((tmp_path / FILE).read_text())["train"]
    assert trained["seconds"] >= 0.3 and "remeasured_seconds" not in trained
    with stage_clock(tmp_path, "train"):  # acceptance measured again, the training records untouched
        (d / "acceptance_warm.json").write_text("{}")
    rec = json.loads((tmp_path / FILE).read_text())["train"]
    assert rec["seconds"] == trained["seconds"] and rec["remeasured_seconds"] < 0.3
    before = (tmp_path / FILE).read_text()
    with stage_clock(tmp_path, "train"):  # up to date: nothing written
        pass
    assert (tmp_path / FILE).read_text() == before
    with stage_clock(tmp_path, "train"):  # trained again: its own seconds, the old note gone
        (d / "manifest.json").write_text('{"again": 1}')
    assert set(json.loads((tmp_path / FILE).read_text())["train"]) == {"seconds"}


def test_a_remeasure_with_no_training_seconds_records_only_its_own(tmp_path):
    """A train stage whose training call recorded nothing (interrupted after its manifest): the re-measure's
    seconds are not given as the stage's."""
    d = tmp_path / "train" / "drafter"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text("{}")
    with stage_clock(tmp_path, "train"):
        (d / "acceptance.json").write_text("{}")
    assert set(json.loads((tmp_path / FILE).read_text())["train"]) == {"remeasured_seconds"}

