"""models.NAME.grow (training/grow.py): a dflash drafter deeper, with a wider MLP and tapping more target layers than
its init_from drafter starts out computing exactly what that drafter computes, then trains every tensor, new and old, and decodes through the
harness; sizes it cannot grow to are refused with the config, in one line, before anything loads.

Power: appending the new layers at random (not zeroing their output projections), or the wider MLP's new
down_proj columns, moves the logits by a fraction of their size, far outside the fp32 allowance; so does putting a
source layer in the wrong place. A grown layer left at zero after training (frozen, or its output projection never
reaching the optimizer) fails the training test."""
import json
from pathlib import Path

import pytest
import torch

from core.errors import UsageError
from tolerance import assert_close
from training_fixtures import run_cli, write_config

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK, SPEC_IDS, LENGTH, PROMPT = 4, [1, 3, 5], 24, 4
SMALL = {"num_layers": 2, "intermediate_size": 64}
BIG = {"num_layers": 3, "intermediate_size": 96}


MORE_TAPS = [1, 2, 3, 5]  # SPEC_IDS and one more: the grown drafter taps a layer its source did not


def grown_model(src: str, **over) -> dict:
    return {"drafter": {"type": "dflash", "block_size": BLOCK, "max_anchors": 16, **BIG, "init_from": src,
                        "grow": True, **over}}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """An exported-looking drafter folder (speculators' save_pretrained, as the train stage writes it) over
    write_config's tiny target, with trained-looking scales so that every layer moves the logits."""
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.train.cli import create_transformer_layer_config
    root = tmp_path_factory.mktemp("grow")
    write_config(root)  # the tiny target under root/target
    tl = create_transformer_layer_config(str(root / "target"), SMALL["num_layers"], "qwen3", None, 4096,
                                         list(range(SMALL["num_layers"])))
    tl.intermediate_size = SMALL["intermediate_size"]
    torch.manual_seed(7)
    model = DFlashDraftModel.from_training_args(
        tl, verifier_name_or_path=str(root / "target"), target_layer_ids=SPEC_IDS, block_size=BLOCK,
        draft_vocab_size=tl.vocab_size, mask_token_id=tl.vocab_size - 1, sample_from_anchor=False,
        draft_attn_impl="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and "norm" not in name and p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.save_pretrained(root / "source")
    return root, model


def block_logits(model, seed: int = 0) -> torch.Tensor:
    """The training forward's logits at every anchor of one random sequence (as many anchors as valid positions:
    all of them, sorted, so two models see the same draw)."""
    from speculators_forward import every_anchor_logits
    g = torch.Generator().manual_seed(seed)
    h = model.config.transformer_layer_config.hidden_size
    ids = torch.randint(8, 100, (1, LENGTH), generator=g)
    layers = [torch.randn(1, LENGTH, h, generator=g) for _ in range(6)]  # each target layer's states, tapped or not
    taps = torch.cat([layers[t] for t in model.target_layer_ids], dim=-1)
    return every_anchor_logits(model, taps, ids, torch.randn(1, LENGTH, h, generator=g), PROMPT, BLOCK)


def build(root, models: dict, taps: list[int]):
    from training.config import load_config
    from training.train import build_model
    cfg = load_config(str(write_config(root, models, hidden={"layer_ids": taps})))
    torch.manual_seed(cfg["seed"])
    return build_model(cfg, "drafter", str(root / "target"), taps, "eager").eval()


@pytest.mark.parametrize("taps", [SPEC_IDS, MORE_TAPS])
def test_a_grown_drafter_computes_what_its_source_did(source, taps):
    root, model = source
    grown = build(root, grown_model(str(root / "source")), taps)
    assert len(grown.layers) == BIG["num_layers"] and list(grown.target_layer_ids) == taps
    assert grown.layers[0].mlp.gate_proj.weight.shape[0] == BIG["intermediate_size"]
    assert grown.grown_from == {"num_layers": [2, 3], "intermediate_size": [64, 96],
                                "taps": None if taps == SPEC_IDS else [SPEC_IDS, taps]}
    want = block_logits(model)
    assert_close(block_logits(grown), want, steps=BIG["num_layers"] + 1)
    # the new tensors are live, not zeros everywhere: the new layer's attention and the new MLP units have weights,
    # only the projections back into the residual stream start at zero
    new = grown.layers[2]
    assert new.self_attn.q_proj.weight.abs().sum() > 0 and new.mlp.gate_proj.weight.abs().sum() > 0
    assert not new.self_attn.o_proj.weight.any() and not new.mlp.down_proj.weight.any()
    assert not grown.layers[0].mlp.down_proj.weight[:, SMALL["intermediate_size"]:].any()
    assert grown.layers[0].mlp.up_proj.weight[SMALL["intermediate_size"]:].abs().sum() > 0
    if taps == MORE_TAPS:  # the new tap (layer 2, second of four) reads nothing yet; the others where they were
        h = grown.fc.weight.shape[0]
        assert not grown.fc.weight[:, h:2 * h].any()
        assert torch.equal(grown.fc.weight[:, 2 * h:3 * h], model.fc.weight[:, h:2 * h])
    # the same model without grow's zeros is a different function: what the comparison above would catch
    with torch.no_grad():
        new.mlp.down_proj.weight.normal_(0.0, 0.15)
    assert (block_logits(grown) - want).abs().max() > 1e-2 * want.abs().max()


def test_a_grown_drafter_trains_every_tensor_and_decodes(source, tmp_path):
    from safetensors.torch import load_file
    root, _ = source
    src = load_file(str(root / "source" / "model.safetensors"))
    work = tmp_path / "work"
    cfg = write_config(root, grown_model(str(root / "source"), epochs=2),  # the recipe's online target and cache
                       hidden={"layer_ids": MORE_TAPS, "mode": "online"}, train={"taps_cache_gib": 1})
    assert run_cli("all", "--config", cfg, "--workdir", work) == 0
    box = json.loads((work / "train" / "drafter" / "box.json").read_text())
    assert box["taps_cache"]["hit_tokens"] > 0  # the second epoch's rows came from the cache, four taps each
    man = json.loads((work / "train" / "drafter" / "manifest.json").read_text())
    assert man["complete"] and man["grown_from"] == {"num_layers": [2, 3], "intermediate_size": [64, 96],
                                                     "taps": [SPEC_IDS, MORE_TAPS]}
    final = load_file(str(work / "train" / "drafter" / man["final"] / "model.safetensors"))
    w = final["layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(w, src["layers.0.self_attn.q_proj.weight"].to(w.dtype))  # the source layers train too
    assert final["layers.2.self_attn.o_proj.weight"].any() and final["layers.2.mlp.down_proj.weight"].any()
    assert final["layers.1.mlp.down_proj.weight"][:, SMALL["intermediate_size"]:].any()
    h = final["fc.weight"].shape[0]
    assert final["fc.weight"][:, h:2 * h].any()  # the new tap's columns trained away from zero
    spec = json.loads((work / "export" / "drafter" / "config.json").read_text())
    assert spec["transformer_layer_config"]["num_hidden_layers"] == 3
    assert spec["aux_hidden_state_layer_ids"] == MORE_TAPS
    acc = json.loads((work / "train" / "drafter" / "acceptance.json").read_text())
    assert acc["heldout"]["tau_drafter"] >= 1.0  # the harness decoded with the grown export
    start = json.loads((work / "train" / "drafter" / "acceptance_warm.json").read_text())  # its start, to pair with
    assert start["grown"] and start["warm_start"] == str(root / "source") and start["global_step"] is None
    assert [s["prompts"] for s in (start["selection"], start["heldout"])] == \
        [acc[s]["prompts"] for s in ("selection", "heldout")]


def test_a_grown_starts_record_is_not_a_warm_starts():
    """The start's acceptance record is keyed by the folder's bytes and, for a grown model, by growth: a record that
    a warm start from the same folder wrote (no "grown") is not kept for a grown model, and the card would misname
    it otherwise."""
    from training.evaluate import eval_key
    from training.prompts import out_dir
    from training.store import write_json
    cfg = {"models": {"drafter": {"grow": True}}, "train": {"eval_max_new_tokens": 8, "eval_k": [1]},
           "acceptance": {}, "workdir": "/nonexistent"}
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        cfg["workdir"] = d
        out_dir(cfg).mkdir(parents=True)
        write_json(out_dir(cfg) / "manifest.json", {"key": "k"})
        folder = Path(d) / "src"
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        grown = eval_key(cfg, "drafter", folder, warm=folder)
        cfg["models"]["drafter"]["grow"] = False
        assert grown != eval_key(cfg, "drafter", folder, warm=folder)


def test_the_card_says_a_drafter_was_grown():
    from training.card_md import warm_start_lines
    w = {"global_step": 3588, "grown": True, "folder": "weights/smollm2-135m/drafter",
         "selection": {"tau_drafter": 2.5}, "heldout": {"tau_drafter": 2.4}, "paired": []}
    line = warm_start_lines({"model": "drafter", "warm_start": w})[0]
    assert line.startswith("`drafter` was grown from `weights/smollm2-135m/drafter` (step 3588; training/grow.py)")
    assert "continued a warm start" in warm_start_lines({"model": "drafter", "warm_start": {**w, "grown": False}})[0]


def test_sizes_grow_cannot_reach_are_refused_before_loading(source, tmp_path):
    import shutil
    from training.config import load_config
    root, _ = source
    folder = str(root / "source")

    def refused(models) -> str:
        with pytest.raises(UsageError) as e:
            load_config(str(write_config(tmp_path, models)))
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "num_layers=1 is below its init_from drafter" in refused(grown_model(folder, num_layers=1))
    assert "intermediate_size=32 is below" in refused(grown_model(folder, intermediate_size=32))
    assert "block_size=8 differs" in refused(grown_model(folder, block_size=8))
    assert "or grow: true to enlarge the drafter" in refused(grown_model(folder, grow=False))
    assert "grow must be true or false" in refused(grown_model(folder, grow="yes"))
    with pytest.raises(UsageError, match=r"without the init_from drafter .*'s taps \[3\]; grow adds taps"):
        load_config(str(write_config(tmp_path, grown_model(folder), hidden={"layer_ids": [1, 2, 5]})))
    with pytest.raises(UsageError, match=r"set hidden.layer_ids to \[1, 3, 5\] \(or grow: true to add taps\)"):
        load_config(str(write_config(tmp_path, grown_model(folder, grow=False, **SMALL),
                                     hidden={"layer_ids": MORE_TAPS})))
    assert "it needs type dflash, init_from set" in refused(grown_model(None))
    head = {"xpress": {"type": "xpress", **BIG, "block_size": BLOCK, "init_from": folder, "freeze_backbone": True}}
    said = refused(head)  # a head cannot grow: the size's own fix, not grow's
    assert "num_layers=3 differs from its init_from drafter" in said and "grow: true" not in said
    sliding = tmp_path / "sliding"
    shutil.copytree(root / "source", sliding)
    spec = json.loads((sliding / "config.json").read_text())
    spec["transformer_layer_config"]["layer_types"] = ["sliding_attention", "full_attention"]
    (sliding / "config.json").write_text(json.dumps(spec))
    assert "has sliding_attention layers; the train stage builds full attention only" in refused(
        grown_model(str(sliding)))
    xp = {"drafter": {"type": "dflash", **SMALL, "block_size": BLOCK},
          "xpress": {"type": "xpress", **SMALL, "block_size": BLOCK, "init_from": "drafter", "grow": True}}
    assert "it needs type dflash" in refused(xp)
    # a drafter of this config grown into another: allowed, and shrinking it refused
    two = {"small": {"type": "dflash", **SMALL, "block_size": BLOCK},
           "big": {"type": "dflash", **BIG, "block_size": BLOCK, "init_from": "small", "grow": True}}
    assert load_config(str(write_config(tmp_path, two)))["models"]["big"]["grow"] is True
    two["big"]["num_layers"] = 1
    assert "num_layers=1 is below its init_from drafter 'small'" in refused(two)


def test_a_grown_model_with_a_warm_start_folder_is_refused(source, tmp_path):
    """grow starts a model at step 0 from init_from; train.warm_start with a folder for it would continue it instead
    (and load a shallower drafter into it)."""
    import shutil
    from training.config import load_config
    root, _ = source
    warm = tmp_path / "export"
    shutil.copytree(root / "source", warm / "drafter")
    (warm / "manifest.json").write_text("{}")
    with pytest.raises(UsageError, match="grow starts it from init_from at step 0, and train.warm_start"):
        load_config(str(write_config(tmp_path, grown_model(str(root / "source")), train={"warm_start": str(warm)})))
    shutil.rmtree(warm / "drafter")  # a warm folder without this model: the grown drafter starts from init_from
    assert load_config(str(write_config(tmp_path, grown_model(str(root / "source")),
                                        train={"warm_start": str(warm)})))["models"]["drafter"]["grow"]


def test_grown_refuses_tensors_it_cannot_place():
    from training.grow import grown
    own = {"layers.0.self_attn.q_proj.weight": torch.zeros(8, 4), "norm.weight": torch.ones(4)}
    with pytest.raises(UsageError, match="cannot take layers.0.self_attn.q_proj.weight from"):
        grown({"layers.0.self_attn.q_proj.weight": torch.zeros(6, 4)}, own, "models.d")
    with pytest.raises(UsageError, match="has no place in this model"):
        grown({"layers.1.self_attn.q_proj.weight": torch.zeros(8, 4)}, own, "models.d")
