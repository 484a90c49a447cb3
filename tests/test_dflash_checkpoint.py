"""The z-lab checkpoint layout: round trip, and a clear refusal of every incompatible checkpoint."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafters.dflash import (DFlashConfig, DFlashDrafter, check_dflash_checkpoint, default_layer_ids, load_dflash,
                             read_dflash_config, save_dflash)
from core.errors import UsageError
from tiny import CPU32, tiny_drafter, tiny_target

ZLAB_KEYS_LAYER0 = {f"layers.0.{k}.weight" for k in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
    "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
    "post_attention_layernorm")}


def test_default_layer_ids_match_the_published_rule():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(28, 1) == [14]


def test_a_shallow_targets_taps_are_distinct_or_refused():
    """4 target layers: the rule's span (1..N-3) holds one layer, so 2 or 3 taps repeated it ([1, 1]: every
    random drafter for it was refused); they spread over every layer instead. 5 taps of 4 layers: refused."""
    import pytest
    from core.errors import UsageError
    assert default_layer_ids(4, 2) == [0, 3] and default_layer_ids(4, 3) == [0, 2, 3]
    assert default_layer_ids(4, 4) == [0, 1, 2, 3] and default_layer_ids(6, 3) == [1, 2, 3]
    assert default_layer_ids(3, 2) == [0, 2] and default_layer_ids(2, 2) == [0, 1]  # the rule went below 1 here
    assert default_layer_ids(3, 3) == [0, 1, 2] and default_layer_ids(1, 1) == [0]
    for n, d in ((4, 5), (1, 2), (2, 3)):
        with pytest.raises(UsageError, match=f"use at most {n} drafter layers"):
            default_layer_ids(n, d)


@pytest.fixture()
def saved(tmp_path):
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block=4)
    save_dflash(d.model, tmp_path / "drafter")
    return t, d, tmp_path / "drafter"


def test_round_trip_gives_identical_drafts(saved):
    t, d, path = saved
    keys = set(load_file(str(path / "model.safetensors")))
    assert ZLAB_KEYS_LAYER0 <= keys and {"fc.weight", "hidden_norm.weight", "norm.weight"} <= keys
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in keys)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["block_size"] == 4 and cfg["dflash_config"]["mask_token_id"] == d.mask_token_id
    loaded = load_dflash(path, read_dflash_config(path), CPU32)
    d2 = DFlashDrafter(loaded, t.embed, t.lm_head, CPU32)
    _, feats = t.prefill(torch.tensor([9, 10, 11, 12, 13]), want_features=True)
    outs = []
    for drafter in (d, d2):
        drafter.ensure_capacity(32)
        drafter.begin(feats)
        outs.append(drafter.propose(torch.tensor(20), torch.tensor(5), 9))
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    assert torch.equal(outs[0].logits, outs[1].logits)


def test_sharded_checkpoint_loads(saved):
    t, d, path = saved
    state = load_file(str(path / "model.safetensors"))
    keys = sorted(state)
    half = len(keys) // 2
    (path / "model.safetensors").unlink()
    save_file({k: state[k] for k in keys[:half]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in keys[half:]}, str(path / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {k: ("model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors")
                            for i, k in enumerate(keys)}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_dflash(path, read_dflash_config(path), CPU32)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, state[k])


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def edit_weights(path, fn):
    state = load_file(str(path / "model.safetensors"))
    fn(state)
    save_file(state, str(path / "model.safetensors"))


def check(path, t):
    cfg = read_dflash_config(path)
    cfg.check_target(t.config)
    check_dflash_checkpoint(path, cfg)


@pytest.mark.parametrize("case, message", [
    ("missing_key", "missing key"),
    ("extra_key", "unexpected key"),
    ("shape", "has shape"),
    ("layer_ids", "beyond the target"),
    ("hidden", "hidden size"),
    ("mask", "mask_token_id is missing"),
    ("block", "block_size must be an integer >= 2"),
])
def test_incompatible_checkpoints_are_refused(saved, case, message):
    t, d, path = saved
    if case == "missing_key":
        edit_weights(path, lambda s: s.pop("layers.1.mlp.up_proj.weight"))
    elif case == "extra_key":
        edit_weights(path, lambda s: s.__setitem__("layers.9.mlp.up_proj.weight", torch.zeros(2)))
    elif case == "shape":
        edit_weights(path, lambda s: s.__setitem__("fc.weight", torch.zeros(64, 64)))
    elif case == "layer_ids":
        edit_config(path, dflash_config={"mask_token_id": 127, "target_layer_ids": [1, 6]})
    elif case == "hidden":
        edit_config(path, hidden_size=128)
    elif case == "mask":
        edit_config(path, dflash_config={"target_layer_ids": [1, 3]})
    elif case == "block":
        edit_config(path, block_size=1)
    with pytest.raises(UsageError, match=message) as e:
        check(path, t)
    assert "\n" not in str(e.value)


def test_config_parses_transformers5_rope_style():
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "block_size": 16, "num_target_layers": 36,
            "dflash_config": {"mask_token_id": 5}}
    a = DFlashConfig.from_dict({**base, "rope_theta": 1e6})
    b = DFlashConfig.from_dict({**base, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
    assert a.rope_theta == b.rope_theta == 1e6
    assert a.target_layer_ids == (1, 33)
    with pytest.raises(UsageError, match="rope_type"):
        DFlashConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4}})


def test_rotary_frequencies_stay_fp32_in_a_bf16_drafter(saved):
    t, d, path = saved
    from core.devices import Backend
    bf16 = Backend(torch.device("cpu"), torch.bfloat16)
    model = load_dflash(path, read_dflash_config(path), bf16)
    assert model.fc.weight.dtype == torch.bfloat16 and model.inv_freq.dtype == torch.float32
    assert model.to(torch.float16).inv_freq.dtype == torch.float32


def test_drafter_hub_ids_resolve_or_fail_in_one_line(tmp_path, monkeypatch):
    import huggingface_hub
    from core.checkpoints import local_model_dir
    assert local_model_dir(str(tmp_path), "--draft-name-or-path") == str(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, allow_patterns: f"/cache/{repo}")
    assert local_model_dir("z-lab/Qwen3-8B-DFlash-b16", "--draft-name-or-path") == "/cache/z-lab/Qwen3-8B-DFlash-b16"

    def offline(repo, allow_patterns):
        raise OSError("We couldn't connect to the hub.\nmore lines")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(UsageError, match="fetching it from the HF hub failed .We couldn't connect") as e:
        local_model_dir("z-lab/Qwen3-8B-DFlash-b16", "--draft-name-or-path")
    assert "\n" not in str(e.value)
