"""models.X.init_from as an exported drafter folder (training/config.py check_init_export, training/train.py
init_state): heads train on a drafter that an earlier run exported (e.g. weights/smollm2-135m/drafter), with
no drafter in the config; training.ship then ships that folder as the drafter. Bad folders are refused in one line
before anything loads, and a head's fingerprint follows the folder's bytes, not its path."""
import json
import shutil

import pytest
import torch

from core.errors import UsageError
from training_fixtures import harness_from_export, run_cli, tiny_models, write_config, xpress_tokens_and_ar

pytestmark = pytest.mark.usefixtures("one_thread")


def heads_on(folder) -> dict:
    models = tiny_models()
    del models["drafter"]
    for m in models.values():
        m["init_from"] = str(folder)
    return models


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A drafter-only run, its export copied aside (the export stage of the next run replaces export/ whole), then a
    heads-only run in the same workdir (its data stages are the first run's, skipped)."""
    root = tmp_path_factory.mktemp("initfrom")
    work = root / "work"
    assert run_cli("all", "--config", write_config(root, tiny_models(heads=False)), "--workdir", work) == 0
    shutil.copytree(work / "export" / "drafter", root / "warm" / "drafter")
    heads = write_config(root, heads_on(root / "warm" / "drafter"))
    assert run_cli("all", "--config", heads, "--workdir", work) == 0
    return root


def test_heads_train_on_the_exported_drafter_and_keep_it_frozen(runs):
    from core.checkpoints import read_tensors, shard_files
    from safetensors.torch import load_file
    w = runs / "work"
    warm = read_tensors(shard_files(runs / "warm" / "drafter", "warm"))
    assert sorted(json.loads((w / "export" / "manifest.json").read_text())["models"]) == ["markov", "xpress"]
    for name in ("xpress", "markov"):
        m = json.loads((w / "train" / name / "manifest.json").read_text())
        assert m["complete"]
        final = load_file(str(w / "train" / name / m["final"] / "model.safetensors"))
        assert set(warm) <= set(final)
        for k, v in warm.items():  # the backbone is the folder's (bf16 there, exact in fp32) and stayed frozen
            assert torch.equal(final[k], v.to(final[k].dtype)), k
        acc = json.loads((w / "train" / name / "acceptance.json").read_text())
        assert acc["heldout"]["tau_drafter"] >= 1.0


def test_ship_takes_the_drafter_from_the_heads_folder_and_it_decodes(runs):
    from refiners.formats import load_refiner_checkpoint
    from training.ship import ship
    out = runs / "shipped"
    manifest = ship(runs / "work", out)
    warm = runs / "warm" / "drafter"
    assert manifest["shipped"]["drafter"] == str(warm)
    assert manifest["drafter_from"]["train_state"]["global_step"] == \
        json.loads((warm / "train_state.json").read_text())["global_step"]
    assert sorted(f.name for f in (out / "drafter").iterdir()) == sorted(f.name for f in warm.iterdir())
    backend, target, drafter = harness_from_export(runs / "target", out)
    xp = load_refiner_checkpoint(out / "xpress", "xpress")
    got, want = xpress_tokens_and_ar(backend, target, drafter, xp.head_state)
    assert got == want


def test_shipped_heads_continue_on_a_drafter_under_the_names_their_ship_manifest_gives(runs, tmp_path):
    """train.warm_start = a shipped folder: each head starts from the slot whose model has its name in the ship
    manifest (heads.json, as weights/smollm2-135m has it: markov/ holds the model markov_gated), on its init_from
    drafter's frozen backbone. At lr 1e-30 (the config takes no 0) a step moves a weight by about 1e-30, far below
    fp32's resolution at the weights' magnitudes, so each head ends as it started: the shipped tensors, where a head
    not loaded from its slot would differ from them by its random initialisation."""
    from core.checkpoints import read_tensors, shard_files
    from safetensors.torch import load_file
    from training.ship import ship
    shipped = tmp_path / "shipped"
    ship(runs / "work", shipped)
    manifest = json.loads((shipped / "manifest.json").read_text())
    manifest["shipped"]["markov"] = "markov_gated"  # the name the shipped weights' heads run gave its Markov head
    (shipped / "heads.json").write_text(json.dumps(manifest))
    (shipped / "manifest.json").unlink()  # heads.json alone makes it a warm-start folder (the config's check)
    cfg = json.loads((runs / "cfg.json").read_text())  # the heads run's: same target and data, so its stages hold
    cfg["models"] = {"xpress": cfg["models"]["xpress"], "markov_gated": cfg["models"]["markov"]}
    for m in cfg["models"].values():
        m["lr"] = 1e-30
    cfg["train"].update(warm_start=str(shipped), warm_mode="restart")
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    work = tmp_path / "work"
    shutil.copytree(runs / "work", work, ignore=lambda d, names: ["train", "export"] if d == str(runs / "work") else [])
    assert run_cli("train", "--config", tmp_path / "cfg.json", "--workdir", work) == 0
    backbone = read_tensors(shard_files(runs / "warm" / "drafter", "warm"))
    for name, slot in (("xpress", "xpress"), ("markov_gated", "markov")):
        m = json.loads((work / "train" / name / "manifest.json").read_text())
        start = json.loads((shipped / slot / "train_state.json").read_text())["global_step"]
        assert m["complete"] and m["global_step"] > start  # counted on from the shipped head's step
        final = load_file(str(work / "train" / name / m["final"] / "model.safetensors"))
        head = read_tensors(shard_files(shipped / slot, slot))
        for k, v in {**head, **backbone}.items():
            assert torch.allclose(final[k], v.to(final[k].dtype), rtol=0, atol=1e-20), (name, k)


def _ship_folder(root, shipped, slots=("drafter", "xpress", "markov")):
    for slot in slots:
        (root / slot).mkdir(parents=True)
        (root / slot / "config.json").write_text("{}")
    (root / "heads.json").write_text(shipped if isinstance(shipped, str) else json.dumps({"shipped": shipped}))
    return root


def test_a_slot_is_the_models_its_ship_manifest_names(tmp_path):
    """A folder named after one model that the ship manifest says holds another is that other's alone (a D-PACE
    drafter shipped from the model drafter_dpace is not the control drafter's start), so no two models share one; a
    path as the drafter's entry (an init_from drafter) leaves drafter/ to the model drafter."""
    from training.warm import source
    root = _ship_folder(tmp_path / "w", {"drafter": "drafter_dpace", "xpress": "xpress", "markov": "markov_gated"})

    def cfg(*names):
        return {"train": {"warm_start": str(root)}, "models": {n: {"grow": False} for n in names}}

    c = cfg("drafter", "drafter_dpace", "markov", "markov_gated", "xpress")
    assert [source(c, n) for n in c["models"]] == [None, root / "drafter", None, root / "markov", root / "xpress"]
    (root / "heads.json").write_text(json.dumps({"shipped": {"drafter": "weights/x/drafter", "xpress": "xpress"}}))
    assert source(cfg("drafter"), "drafter") == root / "drafter"


@pytest.mark.parametrize("heads, message", [
    ("{not json", "does not read as JSON"),
    (json.dumps({"shipped": ["xpress"]}), "must map slot folders"),
    (json.dumps({"shipped": {"../other/xpress": "xpress"}}), "must map slot folders"),
])
def test_a_ship_manifest_that_cannot_be_read_is_refused_with_the_config(tmp_path, heads, message):
    """Ignored, it would leave a head meant to continue training from scratch; a slot must be a folder of the
    shipped folder, not a path out of it."""
    from training.config import load_config
    root = _ship_folder(tmp_path / "w", heads)
    with pytest.raises(UsageError, match=message) as e:
        load_config(str(write_config(tmp_path, tiny_models(heads=False))), [f"train.warm_start={root}"])
    assert "\n" not in str(e.value)


def test_bad_init_from_folders_are_refused_before_loading(runs, tmp_path):
    from training.config import load_config

    def refused(models, **sections):
        with pytest.raises(UsageError) as e:
            load_config(str(write_config(tmp_path, models, **sections)))
        msg = str(e.value)
        assert "\n" not in msg
        return msg

    assert "no exported drafter folder" in refused(heads_on(tmp_path / "nowhere"))
    assert "is a 'xpress' export" in refused(heads_on(runs / "work" / "export" / "xpress"))
    deeper = heads_on(runs / "warm" / "drafter")
    deeper["xpress"]["num_layers"] = 2
    assert "num_layers=2 differs from its init_from drafter" in refused(deeper)
    assert "set hidden.layer_ids to [1, 3, 5]" in refused(heads_on(runs / "warm" / "drafter"),
                                                          hidden={"layer_ids": [1, 2, 5]})
    models = heads_on(runs / "warm" / "drafter")
    models["xpress"]["init_from"] = 3
    assert "init_from must be a model name of this config or an exported drafter folder" in refused(models)


def test_the_fingerprint_follows_the_folders_bytes_not_its_path(runs, tmp_path):
    from safetensors.torch import load_file, save_file
    from training.config import load_config, model_fingerprint
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(runs / "warm" / "drafter", a)
    shutil.copytree(runs / "warm" / "drafter", b)

    def key(folder):
        return model_fingerprint(load_config(str(write_config(tmp_path, heads_on(folder)))), "xpress")

    assert key(a) == key(b)
    shard = sorted(b.glob("*.safetensors"))[0]
    t = load_file(str(shard))
    k = sorted(t)[0]
    t[k] = t[k].clone()
    t[k].view(-1)[0] += 1
    save_file(t, str(shard), metadata={"format": "pt"})
    assert key(a) != key(b)


def test_a_warm_start_fingerprint_follows_the_folders_bytes_and_step_not_its_path(runs, tmp_path):
    """train.warm_start: a model's fingerprint holds its folder's digest and step, so another export copied to the
    same path trains again (the path alone kept the old checkpoint as up to date); a model with no folder there is
    not warm-started, and its fingerprint is the one without warm_start."""
    from training.config import load_config, model_fingerprint
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        shutil.copytree(runs / "warm" / "drafter", d / "drafter")
        (d / "manifest.json").write_text("{}")
    cfg = str(write_config(tmp_path, tiny_models()))

    def key(folder, name="drafter"):
        return model_fingerprint(load_config(cfg, [f"train.warm_start={folder}"] if folder else []), name)

    assert key(a) == key(b) != key(None)
    assert key(a, "xpress") == key(b, "xpress") == key(None, "xpress")  # no xpress/ in the export
    state = json.loads((b / "drafter" / "train_state.json").read_text())
    (b / "drafter" / "train_state.json").write_text(json.dumps({**state, "global_step": state["global_step"] + 1}))
    assert key(a) != key(b)
    shutil.rmtree(b)
    shutil.copytree(a, b)
    cfg_b = json.loads((b / "drafter" / "config.json").read_text())
    (b / "drafter" / "config.json").write_text(json.dumps({**cfg_b, "note": "another export"}))
    assert key(a) != key(b)


def test_the_heads_preset_starts_every_head_from_the_warm_drafter_and_shares_the_data_keys():
    """smollm2-gpu-heads trains the three heads on weights/smollm2-135m/drafter, the shipped drafter (checked against that folder
    when the config loads) and keeps smollm2-gpu's data sections, so stages packed by a drafter run unpack for it."""
    from training import prompts
    from training.config import load_config
    base, heads = load_config("smollm2-gpu"), load_config("smollm2-gpu-heads")
    assert sorted(heads["models"]) == ["markov_gated", "markov_vanilla", "xpress"]
    assert {m["init_from"] for m in heads["models"].values()} == {"weights/smollm2-135m/drafter"}
    assert all(m["freeze_backbone"] for m in heads["models"].values())
    assert {k for k in base if base[k] != heads[k]} == {"models", "name", "workdir"}
    assert prompts.stage_key(heads, ["a.jsonl"]) == prompts.stage_key(base, ["a.jsonl"])
    # the longer heads recipe (xPress and gated Markov only) shares the same data and the same starting drafter
    long = load_config("smollm2-gpu-heads-long")
    assert sorted(long["models"]) == ["markov_gated", "xpress"]
    assert {m["init_from"] for m in long["models"].values()} == {"weights/smollm2-135m/drafter"}
    assert all(m["freeze_backbone"] for m in long["models"].values())
    assert all(long["models"][k]["epochs"] > heads["models"][k]["epochs"] for k in long["models"])
    assert {k for k in base if base[k] != long[k]} == {"models", "name", "workdir"}
    # the consistency recipes side by side (training.ship ships the xPress one with the best selection tau): the
    # shipped recipe's settings (consistency weight 0.3, lr 1e-2) as the control, then weight 1.0 at the same rate
    cons = load_config("smollm2-gpu-heads-consistency")
    xp = {k: m for k, m in cons["models"].items() if m["type"] == "xpress"}
    assert sorted(xp) == ["xpress", "xpress_cw1"] and "markov_gated" in cons["models"]
    assert {(m["consistency_weight"], m["lr"]) for m in xp.values()} == {(0.3, 1e-2), (1.0, 1e-2)}
    assert all(m["init_from"] == "weights/smollm2-135m/drafter" and m["freeze_backbone"]
               for m in cons["models"].values())
    assert {k for k in base if base[k] != cons[k]} == {"models", "name", "workdir"}
