"""The harness's dFlash drafter computes what speculators 0.9.0 trains (issue 26: the tables measure the drafter
that `python -m training` fits).

speculators' own DFlashDraftModel, random with trained-looking scales, saved with its own save_pretrained (the
files the pipeline's train stage writes and the export stage reshards), is read through the harness's loader. On a
tiny target, for every anchor of one sequence, the block logits of speculators' training forward (the anchored
blocks over the whole sequence, context = the target's taps before the anchor, the anchor token in slot 0) equal
the harness drafter's proposal at that anchor (context written once, the block attending over it), in fp32.

Power (each checked by editing the harness when the test was written): block positions shifted by one and the
context's rows left unnormalised fail the comparison; the taps one layer off (speculators ids are layer inputs, the
harness's layer outputs) fail it or the load.

On the real SmolLM2 pair (weights/smollm2-135m, fp32, 4 gsm8k prompts x 96 greedy tokens; results/perf/NOTES.md)
the two computations gave the same accepted run at every one of 320 anchors, and replaying the decode's anchor
choice over those runs gave the decode's own accepted counts step for step."""
import pytest
import torch

from tiny import CPU32, save_tiny_checkpoint
from tolerance import assert_close

spec = pytest.importorskip("speculators.models.dflash.core", reason="speculators (training extras)")

BLOCK, PROMPT, LENGTH = 4, 6, 30
SPEC_IDS = [1, 3, 5]  # speculators' ids: the input of that decoder layer


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from speculators.train.cli import create_transformer_layer_config
    from drafters.dflash import DFlashDrafter, load_dflash, read_dflash_config
    from harness.decode.loading import load_target
    root = tmp_path_factory.mktemp("dflash_spec")
    save_tiny_checkpoint(root / "target")
    tl = create_transformer_layer_config(str(root / "target"), 2, "qwen3", None, 4096, [0, 1])
    torch.manual_seed(5)
    model = spec.DFlashDraftModel.from_training_args(
        tl, verifier_name_or_path=str(root / "target"), target_layer_ids=SPEC_IDS, block_size=BLOCK,
        draft_vocab_size=tl.vocab_size, mask_token_id=tl.vocab_size - 1, sample_from_anchor=False,
        draft_attn_impl="eager").eval()
    with torch.no_grad():  # trained-looking scales: attention and MLP move the logits, not only the residual
        for name, p in model.named_parameters():
            if p.requires_grad and "norm" not in name and p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.save_pretrained(root / "drafter")
    cfg = read_dflash_config(root / "drafter")
    assert list(cfg.target_layer_ids) == [i - 1 for i in SPEC_IDS]
    target, _ = load_target(str(root / "target"), CPU32, taps=cfg.target_layer_ids)
    drafter = DFlashDrafter(load_dflash(root / "drafter", cfg, CPU32), target.embed, target.lm_head, CPU32)
    return model, target, drafter


def speculators_block_logits(model, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """[anchors, BLOCK, V]: the training forward's logits for every anchor (positions prompt .. len - BLOCK - 1),
    read at the drafter's lm_head; the taps come from the training pipeline's own capture (training.hidden)."""
    from transformers import AutoModelForCausalLM
    from training.hidden import Capture
    hf = AutoModelForCausalLM.from_pretrained(model.config.speculators_config.verifier.name_or_path,
                                              dtype=torch.float32).eval()
    cap = Capture(hf, SPEC_IDS)
    with torch.no_grad():
        hf(input_ids=ids[None])
    full = cap.stacked()[0]  # [T, taps + 1, H]
    cap.close()
    from speculators_forward import every_anchor_logits
    return every_anchor_logits(model, full[:, :-1].reshape(1, ids.shape[0], -1), ids[None], full[None, :, -1], prompt,
                               BLOCK)


def test_every_anchor_block_equals_speculators_training_forward(pair):
    model, target, drafter = pair
    ids = torch.randint(8, 100, (LENGTH,), generator=torch.Generator().manual_seed(3))
    want = speculators_block_logits(model, ids, PROMPT)
    target.ensure_capacity(LENGTH)
    drafter.ensure_capacity(LENGTH)
    target.reset()
    _, feats = target.forward(ids, torch.arange(LENGTH), LENGTH, want_features=True)
    drafter.begin(feats)
    moved = 0
    for j, p in enumerate(range(PROMPT, LENGTH - BLOCK)):
        got = drafter.propose(ids[p], torch.tensor(p), p + BLOCK).logits  # slots 1..BLOCK-1: the drafts
        assert_close(got, want[j, 1:], steps=8)
        moved += int((got.argmax(-1) != want[j - 1, 1:].argmax(-1)).any()) if j else 0
        # the block wrote its own K/V over slots p..p+BLOCK-1; put the context back for the next anchor
        drafter.model.write_context(feats[p:p + BLOCK], torch.arange(p, p + BLOCK), drafter.kv, drafter.ops)
    assert moved >= (LENGTH - BLOCK - PROMPT) // 2  # the drafts depend on the anchor: not a constant model
