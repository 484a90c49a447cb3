"""Every stage of python -m training on a tiny random target, and the exported files in the harness: they load as
they are, and greedy decoding with each (drafter-only, xPress, every Markov variant) equals plain AR."""
import json

import pytest
import torch

from training_fixtures import harness_from_export, run_cli, tiny_models, write_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipe")
    models = tiny_models()
    for v in ("gated", "rnn"):
        models[f"markov_{v}"] = {**models["markov"], "markov_head_type": v}
    cfg = write_config(root, models)
    assert run_cli("all", "--config", cfg, "--workdir", root / "work") == 0
    return root


def test_every_stage_writes_its_output(run_dir):
    w = run_dir / "work"
    prompts = json.loads((w / "prompts" / "manifest.json").read_text())
    assert prompts["train"] > 0 and prompts["heldout"] == 2 and prompts["magpie_generated"] == 2
    resp = json.loads((w / "responses" / "manifest.json").read_text())
    assert resp["complete"] and resp["sequences"] == 2 * prompts["train"]  # greedy + one sampled each
    hidden = json.loads((w / "hidden" / "manifest.json").read_text())
    assert hidden["layer_ids"] == [1, 3, 5] and len(list((w / "hidden" / "hidden_states").glob("hs_*"))) == \
        hidden["sequences"]
    from safetensors.torch import load_file
    hs = load_file(str(w / "hidden" / "hidden_states" / "hs_0.safetensors"))
    assert hs["hidden_states"].shape[1:] == (4, 64) and hs["hidden_states"].shape[0] == hs["token_ids"].shape[0]
    for name in ("drafter", "xpress", "markov", "markov_gated", "markov_rnn"):
        assert json.loads((w / "train" / name / "manifest.json").read_text())["complete"]
        assert (w / "export" / name / "config.json").is_file()
    files = list((w / "export" / "drafter").glob("*.safetensors"))
    assert len(files) > 1 and all(f.stat().st_size < 0.051 * 2 ** 20 for f in files)  # sharded under the limit
    assert (w / "export" / "pt" / "xpress_refiner_cotrain.pt").is_file()


def test_hidden_states_are_the_targets_own(run_dir):
    """hs rows = the output of layer id-1 and the last layer before the final norm, recomputed independently."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(run_dir / "target", dtype=torch.float32).eval()
    hs = load_file(str(run_dir / "work" / "hidden" / "hidden_states" / "hs_0.safetensors"))
    with torch.no_grad():
        out = model(hs["token_ids"][None], output_hidden_states=True).hidden_states
    want = torch.stack([out[1][0], out[3][0], out[5][0]], 1)
    assert torch.allclose(hs["hidden_states"][:, :3], want, atol=1e-5)
    # HF's last entry is normed; the stored one is not, and normalising it gives HF's
    assert torch.allclose(model.model.norm(hs["hidden_states"][:, 3]), out[-1][0], atol=1e-5)


def test_exports_load_in_the_harness_and_greedy_equals_ar(run_dir):
    from harness.decode.loop import DecodeSettings, generate
    from refiners.formats import load_refiner_checkpoint, validate_against
    from refiners.markov import MarkovRefiner, markov_head_from_state
    from refiners.xpress import XPressRefiner, xpress_head_from_state
    e = run_dir / "work" / "export"
    backend, target, drafter = harness_from_export(run_dir / "target", e)
    s = DecodeSettings(max_new_tokens=20, max_model_len=256, stop_ids=(3, 5))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(8, 100, (int(n),), generator=g).tolist() for n in (5, 9, 14)]
    refs = [generate(target, p, s, backend).tokens for p in prompts]
    refiners = {"drafter-only": None}
    xp = load_refiner_checkpoint(e / "xpress", "xpress")
    validate_against(xp, 128, 64, 4, drafter.model.config.expected_shapes())
    assert xp.draft_state is None  # frozen backbone: only the head ships
    refiners["xpress"] = XPressRefiner(xpress_head_from_state(xp.head_state), 3)
    for name in ("markov", "markov_gated", "markov_rnn"):
        ck = load_refiner_checkpoint(e / name, "markov")
        validate_against(ck, 128, 64, None, drafter.model.config.expected_shapes())
        assert ck.variant == ("vanilla" if name == "markov" else name.split("_")[1])
        refiners[name] = MarkovRefiner(markov_head_from_state(ck.head_state, ck.variant))
    for name, ref in refiners.items():
        for p, want in zip(prompts, refs):
            assert generate(target, p, s, backend, drafter=drafter, refiner=ref).tokens == want, name


def test_cotrain_pt_reads_back(run_dir):
    from refiners.formats import load_refiner_checkpoint
    ck = load_refiner_checkpoint(run_dir / "work" / "export" / "pt" / "xpress_refiner_cotrain.pt", "xpress")
    assert ck.kind == "xpress" and ck.draft_state and ck.rank == 8 and ck.block_size == 4


def test_rerun_is_a_no_op(run_dir, capsys):
    cfg = run_dir / "cfg.json"
    assert run_cli("all", "--config", cfg, "--workdir", run_dir / "work") == 0
    out = capsys.readouterr().out
    assert out.count("up to date") >= 8
