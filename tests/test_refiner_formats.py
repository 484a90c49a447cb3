"""Refiner checkpoints: co-training .pt and serving layout, both converter directions, and every refusal."""
import argparse
import datetime
import json

import pytest
import torch
from safetensors.torch import load_file

import scripts.convert_refiner as convert
from drafters.dflash import IGNORED_KEYS
from core.errors import UsageError
from refiners.formats import RefinerCheckpoint, load_refiner_checkpoint, validate_against
from refiner_fixtures import (B, H, M, R, V, TaggedDict, assert_same_tensors, base_dir, drafter, listing,
                              markov_head, one_line, save_pt, write_serving, xpress_args, xpress_head)


# --- round trips -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["xpress", "markov"])
def test_round_trip_through_both_converters(tmp_path, drafter, base_dir, kind, capsys):
    pt = save_pt(tmp_path / "in.pt", drafter, kind)
    original = torch.load(pt, weights_only=False)
    serving = tmp_path / "serving"
    assert convert.main(["pt-to-serving", "--ckpt", str(pt), "--base-config", str(base_dir),
                         "--out", str(serving)]) == 0
    assert listing(serving) == ["config.json", "model.safetensors"]
    cfg = json.loads((serving / "config.json").read_text())
    base = json.loads((base_dir / "config.json").read_text())
    assert cfg["sample_from_anchor"] is False
    assert {k: v for k, v in cfg.items() if k in base and k != "architectures"} == \
        {k: v for k, v in base.items() if k != "architectures"}
    tensors = load_file(str(serving / "model.safetensors"))
    if kind == "xpress":
        assert cfg["architectures"] == ["Qwen3XPressModel"]
        assert (cfg["xpress_rank"], cfg["xpress_mlp_hidden"], cfg["xpress_block_size"], cfg["xpress_num_passes"]) == \
            (R, M, B, 6)
        assert torch.equal(tensors["xpress_head.mix.L"], original["refiner_state_dict"]["mix.L"])  # raw, not folded
        assert {k for k in tensors if k.startswith("xpress_head.")} == \
            {"xpress_head." + k for k in original["refiner_state_dict"]}
    else:
        assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["markov_rank"] == R
        assert {k for k in tensors if k.startswith("markov_head.")} == \
            {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
    assert_same_tensors({k: v for k, v in tensors.items() if "_head." not in k}, original["draft_state_dict"])

    back = tmp_path / "back.pt"
    assert convert.main(["serving-to-pt", "--src", str(serving), "--out", str(back)]) == 0
    assert listing(tmp_path) == sorted(["back.pt", "base", "in.pt", "serving"])
    with torch.serialization.safe_globals([argparse.Namespace]):
        again = torch.load(back, weights_only=True)
    assert_same_tensors(again["refiner_state_dict"], original["refiner_state_dict"])
    assert_same_tensors(again["draft_state_dict"], original["draft_state_dict"])
    assert again["args"].markov_rank == R
    if kind == "xpress":
        assert again["args"].mlp_ratio == M // R

    for path in (pt, serving, back):
        ck = load_refiner_checkpoint(path, kind)
        assert isinstance(ck, RefinerCheckpoint)
        assert (ck.kind, ck.rank, ck.mixer) == (kind, R, "raw")
        assert_same_tensors(ck.head_state, original["refiner_state_dict"])
        assert_same_tensors(ck.draft_state, original["draft_state_dict"])
        validate_against(ck, V, H, B, drafter[0].expected_shapes())
        if kind == "xpress":
            assert (ck.mlp_hidden, ck.block_size) == (M, B)
    assert load_refiner_checkpoint(pt, kind).step == 403000
    assert load_refiner_checkpoint(serving, kind).num_passes == (6 if kind == "xpress" else None)


def test_bf16_tensors_and_dropped_tril_survive(tmp_path, drafter, base_dir):
    head = {k: v.to(torch.bfloat16) for k, v in xpress_head().items()}
    pt = save_pt(tmp_path / "in.pt", drafter, head={**head, "mix.tril": torch.tril(torch.ones(B, B))})
    ck = load_refiner_checkpoint(pt, "xpress")
    assert "mix.tril" not in ck.head_state
    assert_same_tensors(ck.head_state, head)
    convert.pt_to_serving(str(pt), str(base_dir / "config.json"), str(tmp_path / "s"), num_passes=3)
    assert json.loads((tmp_path / "s" / "config.json").read_text())["xpress_num_passes"] == 3
    assert_same_tensors(load_refiner_checkpoint(tmp_path / "s", "xpress").head_state, head)


def test_args_may_be_a_plain_dict(tmp_path, drafter):
    pt = save_pt(tmp_path / "in.pt", drafter, args={"markov_rank": R, "mlp_ratio": 2})
    assert load_refiner_checkpoint(pt, "xpress").mlp_hidden == M


# --- serving layout ------------------------------------------------------------------------------------------

def test_prefolded_mixer_reads_as_folded_and_is_not_refolded(tmp_path, drafter):
    head = xpress_head()
    folded = head["mix.L"] * torch.tril(torch.ones(B, B)) + torch.eye(B)
    served = {k: v for k, v in head.items() if k != "mix.L"}
    served["mix_L"] = folded
    d = write_serving(tmp_path / "s", drafter, served, xpress_rank=R, xpress_block_size=B, xpress_topc=0)
    ck = load_refiner_checkpoint(d, "xpress")
    assert ck.mixer == "folded" and torch.equal(ck.head_state["mix.L"], folded) and ck.topc == 0
    with pytest.raises(UsageError, match="folded"):
        convert.serving_to_pt(str(d), str(tmp_path / "x.pt"))
    assert not (tmp_path / "x.pt").exists()

    both = write_serving(tmp_path / "both", drafter, {**head, "mix_L": folded})
    with pytest.raises(UsageError, match=r"both .*mix\.L.*mix_L"):
        load_refiner_checkpoint(both, "xpress")


def test_serving_aliases_and_config_cross_checks(tmp_path, drafter):
    head = xpress_head()
    served = {k.replace("mlp.gate_proj", "mlp_gate").replace("mlp.up_proj", "mlp_up").replace("mlp.down_proj",
                                                                                              "mlp_down"): v
              for k, v in head.items()}
    ck = load_refiner_checkpoint(write_serving(tmp_path / "a", drafter, served), "xpress")
    assert_same_tensors(ck.head_state, head)
    bad = write_serving(tmp_path / "b", drafter, head, xpress_block_size=16)
    with pytest.raises(UsageError, match="xpress_block_size=16 differs"):
        load_refiner_checkpoint(bad, "xpress")
    anchor = write_serving(tmp_path / "c", drafter, head, sample_from_anchor=True)
    with pytest.raises(UsageError, match="sample_from_anchor"):
        load_refiner_checkpoint(anchor, "xpress")
    plain = write_serving(tmp_path / "d", drafter, {})
    with pytest.raises(UsageError, match="no refiner head found"):
        load_refiner_checkpoint(plain, None)


# --- refusals ----------------------------------------------------------------------------------------------------

def test_missing_and_unexpected_head_keys(tmp_path, drafter):
    head = xpress_head()
    del head["in_proj.weight"]
    with pytest.raises(UsageError, match="1 missing key.*in_proj.weight") as e:
        load_refiner_checkpoint(save_pt(tmp_path / "a.pt", drafter, head=head), "xpress")
    one_line(e)
    with pytest.raises(UsageError, match="unexpected key.*norm.weight"):
        extra = {**xpress_head(), "norm.weight": torch.ones(R)}
        load_refiner_checkpoint(save_pt(tmp_path / "b.pt", drafter, head=extra), "xpress")
    with pytest.raises(UsageError, match="unexpected key.*gate.weight.*vanilla"):
        load_refiner_checkpoint(save_pt(tmp_path / "c.pt", drafter, "markov",
                                        head={**markov_head(), "gate.weight": torch.ones(R, R + H)}), "markov")
    ck = load_refiner_checkpoint(save_pt(tmp_path / "d.pt", drafter), "xpress")
    del ck.head_state["w2.weight"]
    with pytest.raises(UsageError, match="missing key.*w2.weight"):
        validate_against(ck, V, H, B)
    bad_shape = xpress_head()
    bad_shape["in_proj.weight"] = torch.zeros(R, 2 * R)
    with pytest.raises(UsageError, match=r"in_proj.weight has shape \[8, 16\], expected \[8, 24\]"):
        load_refiner_checkpoint(save_pt(tmp_path / "e.pt", drafter, head=bad_shape), "xpress")


def test_run_mismatches(tmp_path, drafter):
    ck = load_refiner_checkpoint(save_pt(tmp_path / "a.pt", drafter), "xpress")
    with pytest.raises(UsageError, match="vocab 128 .* target's vocab 256") as e:
        validate_against(ck, 256, H, B)
    one_line(e)
    with pytest.raises(UsageError, match="hidden size 64.*is 32"):
        validate_against(ck, V, 32, B)
    with pytest.raises(UsageError, match="mixer was trained for block 4, the run uses block 16; pass --block-size 4"):
        validate_against(ck, V, H, 16)
    expected = dict(drafter[0].expected_shapes())
    expected["fc.weight"] = (H, H * 3)
    with pytest.raises(UsageError, match="co-trained drafter.*fc.weight has shape"):
        validate_against(ck, V, H, B, expected)
    ck.draft_state.pop("norm.weight")
    with pytest.raises(UsageError, match="missing key.*norm.weight"):
        validate_against(ck, V, H, B, drafter[0].expected_shapes())
    ck.draft_state["norm.weight"] = torch.ones(H)
    ck.draft_state["embed_tokens.weight"] = torch.zeros(V, H)  # ignored, as for the drafter loader
    assert "embed_tokens." in IGNORED_KEYS
    validate_against(ck, V, H, B, drafter[0].expected_shapes())
    mk = load_refiner_checkpoint(save_pt(tmp_path / "m.pt", drafter, "markov"), "markov")
    validate_against(mk, V, H, 16)  # the Markov head decodes sequentially: any block
    with pytest.raises(UsageError, match="vocab"):
        validate_against(mk, 100, H, B)


@pytest.mark.parametrize("flag,value", [("no_mixer", True), ("input_mode", "sum"), ("markov_only", True),
                                        ("lowrank_base_rank", 64)])
def test_unsupported_training_flags(tmp_path, drafter, flag, value):
    pt = save_pt(tmp_path / "a.pt", drafter, args=xpress_args(**{flag: value}))
    with pytest.raises(UsageError, match=f"{flag}={value!r}.*variant is not supported") as e:
        load_refiner_checkpoint(pt, "xpress")
    one_line(e)


def test_args_cross_checks_and_required_keys(tmp_path, drafter):
    with pytest.raises(UsageError, match="markov_rank=16.*width 8"):
        load_refiner_checkpoint(save_pt(tmp_path / "a.pt", drafter, args=xpress_args(markov_rank=16)), "xpress")
    with pytest.raises(UsageError, match="no markov_rank \\(default 256\\)"):
        load_refiner_checkpoint(save_pt(tmp_path / "b.pt", drafter, args={"mlp_ratio": 2}), "xpress")
    with pytest.raises(UsageError, match="mlp_ratio=4 gives an MLP hidden of 32.*16 rows"):
        load_refiner_checkpoint(save_pt(tmp_path / "c.pt", drafter, args=xpress_args(mlp_ratio=4)), "xpress")
    torch.save({"refiner_state_dict": xpress_head(), "args": xpress_args()}, tmp_path / "d.pt")
    with pytest.raises(UsageError, match="draft_state_dict missing"):
        load_refiner_checkpoint(tmp_path / "d.pt", "xpress")
    torch.save({"draft_state_dict": {}, "refiner_state_dict": xpress_head()}, tmp_path / "e.pt")
    with pytest.raises(UsageError, match="args missing"):
        load_refiner_checkpoint(tmp_path / "e.pt", "xpress")
    (tmp_path / "f.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UsageError, match="cannot be read as a torch checkpoint"):
        load_refiner_checkpoint(tmp_path / "f.pt", "xpress")
    with pytest.raises(UsageError, match="no such file"):
        load_refiner_checkpoint(tmp_path / "nope.pt", "xpress")


@pytest.mark.parametrize("payload,name", [(TaggedDict(a=1), "TaggedDict"),
                                          (datetime.datetime(2025, 1, 1), "datetime.datetime")])
def test_disallowed_pickle_class_names_it_and_trust_pickle_loads(tmp_path, drafter, payload, name):
    pt = save_pt(tmp_path / "a.pt", drafter, extra_info=payload)
    with pytest.raises(UsageError, match=f"{name}.*--trust-pickle") as e:
        load_refiner_checkpoint(pt, "xpress")
    one_line(e)
    ck = load_refiner_checkpoint(pt, "xpress", trust_pickle=True)
    assert ck.rank == R and ck.step == 403000


def test_kind_mismatch(tmp_path, drafter, base_dir):
    mk = save_pt(tmp_path / "m.pt", drafter, "markov")
    with pytest.raises(UsageError, match="Markov-head checkpoint.*xPress head was expected.*--markov-refiner-path"):
        load_refiner_checkpoint(mk, "xpress")
    xp = save_pt(tmp_path / "x.pt", drafter)
    with pytest.raises(UsageError, match="xPress-head checkpoint.*--xpress-refiner-path"):
        load_refiner_checkpoint(xp, "markov")
    convert.pt_to_serving(str(mk), str(base_dir), str(tmp_path / "ms"))
    with pytest.raises(UsageError, match="Markov-head checkpoint"):
        load_refiner_checkpoint(tmp_path / "ms", "xpress")
    with pytest.raises(UsageError, match="Markov-head checkpoint"):  # a file inside the dir stands for the dir
        load_refiner_checkpoint(tmp_path / "ms" / "config.json", "xpress")




def test_a_heads_only_export_says_there_is_nothing_to_convert(tmp_path):
    """The shipped heads were trained on a frozen drafter: no drafter tensors, so no co-training checkpoint can be
    made of them; the refusal says the harness loads the folder as it is (it said only what was missing)."""
    from pathlib import Path
    shipped = Path(__file__).resolve().parents[1] / "weights" / "smollm2-135m" / "xpress"
    if not (shipped / "config.json").is_file():
        pytest.skip("a clone without the shipped weights")
    with pytest.raises(UsageError, match="nothing to convert: the harness loads this folder as it is"):
        convert.serving_to_pt(str(shipped), str(tmp_path / "x.pt"))
    assert not (tmp_path / "x.pt").exists()


def test_a_trained_folder_names_its_step(tmp_path):
    """The [refiner] line printed step=None for every trained head: the step of an export is in train_state.json
    beside it (the shipped xPress head: at step 1,894), read for both folder layouts; a folder without one has None."""
    import json
    import shutil
    from pathlib import Path
    from refiners.checkpoint import recorded_step
    from refiners.formats import load_refiner_checkpoint
    shipped = Path(__file__).resolve().parents[1] / "weights" / "smollm2-135m"
    want = json.loads((shipped / "xpress" / "train_state.json").read_text())["global_step"]
    assert load_refiner_checkpoint(shipped / "xpress", "xpress").step == want == 1894
    assert load_refiner_checkpoint(shipped / "markov", "markov").step == \
        json.loads((shipped / "markov" / "train_state.json").read_text())["global_step"]
    bare = tmp_path / "bare"
    shutil.copytree(shipped / "markov", bare)
    (bare / "train_state.json").unlink()
    assert load_refiner_checkpoint(bare, "markov").step is None
    (bare / "train_state.json").write_text("{not json")
    assert recorded_step(bare) is None
