"""A head co-trained with its drafter, end to end on the CPU (models.xpress.freeze_backbone false and
backbone_lr_scale, training/cotrain.py): the drafter under the head moves, the export ships the head with its own
drafter, and the harness decodes with both, token for token AR's."""
import json
import shutil

import pytest
import torch

from training_fixtures import harness_from_export, run_cli, tiny_models, write_config, xpress_tokens_and_ar

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A drafter-only run, its export set aside, then xPress co-trained on it in the same workdir."""
    root = tmp_path_factory.mktemp("cotrain")
    work = root / "work"
    assert run_cli("all", "--config", write_config(root, tiny_models(heads=False)), "--workdir", work) == 0
    shutil.copytree(work / "export" / "drafter", root / "warm" / "drafter")
    head = tiny_models()["xpress"]
    head.update(init_from=str(root / "warm" / "drafter"), freeze_backbone=False, backbone_lr_scale=0.1)
    assert run_cli("all", "--config", write_config(root, {"xpress": head}), "--workdir", work) == 0
    return root


def test_the_drafter_under_a_co_trained_head_moves_and_ships_with_it(runs):
    from core.checkpoints import read_tensors, shard_files
    from refiners.formats import load_refiner_checkpoint
    from safetensors.torch import load_file
    from training.cotrain import HEAD_PREFIXES
    w = runs / "work"
    warm = read_tensors(shard_files(runs / "warm" / "drafter", "warm"))
    m = json.loads((w / "train" / "xpress" / "manifest.json").read_text())
    final = load_file(str(w / "train" / "xpress" / m["final"] / "model.safetensors"))
    moved = [k for k, v in warm.items() if not torch.equal(final[k], v.to(final[k].dtype))]
    assert moved, "every drafter tensor is where it started: the backbone did not train"
    shipped = read_tensors(shard_files(w / "export" / "xpress", "export"))
    assert any(not k.startswith(HEAD_PREFIXES) for k in shipped)  # the head's own drafter ships with it
    assert load_refiner_checkpoint(w / "export" / "xpress", "xpress").draft_state


def test_the_harness_decodes_with_the_co_trained_drafter_losslessly(runs):
    from harness.protocol.build import _device_state
    from refiners.formats import load_refiner_checkpoint
    w = runs / "work"
    shutil.copytree(runs / "warm" / "drafter", runs / "base" / "drafter")  # the base drafter the other arms run
    backend, target, drafter = harness_from_export(runs / "target", runs / "base")
    ck = load_refiner_checkpoint(w / "export" / "xpress", "xpress")
    base = {k: v.clone() for k, v in drafter.model.state_dict().items()}
    drafter.model.load_state_dict(_device_state(drafter.model, ck.draft_state, backend), strict=True)
    assert any(not torch.equal(v, base[k]) for k, v in drafter.model.state_dict().items())
    got, want = xpress_tokens_and_ar(backend, target, drafter, ck.head_state)
    assert got == want
