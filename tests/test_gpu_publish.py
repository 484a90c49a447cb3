"""CUDA, bf16, the Triton kernels (skipped without a GPU): every divergence of drafter-only from AR at T=0 sits on
a near-tie of the target's logits, so "lossless up to ties" is shown, not assumed, with bf16 logits and with
--fp32-logits. (The flag does not remove most divergences: on the real model and the shipped drafter it took 14 of 32
gsm8k rows equal to AR's to 18 of 32, removing some and adding others, results/smollm2-135m/README.md; the hidden
states still round in bf16.)

The target is SmolLM2-135M-Instruct when its GGUF is cached (harness.protocol.assets), else random weights at its
shapes. BOUND: two computations of one logit z in bf16 (the AR step, one row, norm folded into the matmul; the
verify, 16 rows) each round the logits to bf16 (relative 2^-8) after inputs that already differ by a few bf16
roundings, so a greedy choice can flip only where the top-2 gap is within a few ulps of |z|: we take
TIE_ULPS = 8 ulps of bf16 at the top logit's magnitude.
"""
import pytest
import torch

from drafters.dflash import DFlashDrafter, config_for_target, random_dflash
from core.devices import Backend
from harness.decode.loop import DecodeSettings, generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TIE_ULPS = 8
PROMPTS, NEW = 12, 256


def bf16_ulp(z: float) -> float:
    return 2.0 ** (torch.tensor(abs(z) or 1.0).log2().floor().item() - 7)


@pytest.fixture(scope="module")
def pair():
    from core.ops import make_ops
    b = Backend(torch.device("cuda"), torch.bfloat16)
    try:
        from harness.protocol.assets import fetch_smollm2_gguf
        from harness.decode.loading import load_target
        target, _ = load_target(str(fetch_smollm2_gguf()), b)
    except Exception:  # no cached asset (the GPU host has no network): random weights at the same shapes
        from harness.protocol.presets import build_random
        target = build_random("smollm2-135m", b, block_size=16, capacity=1024).target
    ops = make_ops("triton", b.device, b.dtype, target.config)
    target.use_ops(ops)
    cfg = config_for_target(target.config, n_layers=2, block_size=16, mask_token_id=target.vocab_size - 1)
    target.set_taps(cfg.target_layer_ids)
    drafter = DFlashDrafter(random_dflash(cfg, seed=3).to("cuda", torch.bfloat16), target.embed, target.lm_head, b,
                            ops=ops)
    return target, drafter, b


def divergences(target, drafter, b, fp32: bool):
    g = torch.Generator().manual_seed(0)
    s = DecodeSettings(NEW, 4096, (), record_gaps=True)
    found = []
    if fp32:
        target.use_fp32_logits()
    try:
        for i in range(PROMPTS):
            prompt = torch.randint(10, 2000, (int(torch.randint(8, 64, (1,), generator=g)),), generator=g).tolist()
            ar = generate(target, prompt, s, b)
            sp = generate(target, prompt, s, b, drafter=drafter)
            d = next((k for k, (x, y) in enumerate(zip(ar.tokens, sp.tokens)) if x != y), None)
            if d is not None:
                with torch.no_grad():  # the top logit's magnitude at the divergence (HF's forward of AR's prefix)
                    z = target.model(torch.tensor([prompt + ar.tokens[:d]], device="cuda")).logits[0, -1].float()
                found.append((i, d, ar.top2_gaps[d], sp.top2_gaps[d], float(z.max())))
    finally:
        target._lm_fp32 = None
    return found


def _all_near_ties(found):
    for i, d, gap_ar, gap_sp, z in found:
        bound = TIE_ULPS * bf16_ulp(z)
        assert min(gap_ar, gap_sp) <= bound, (i, d, gap_ar, gap_sp, z, bound)


def test_every_divergence_is_a_bf16_near_tie(pair):
    target, drafter, b = pair
    found = divergences(target, drafter, b, fp32=False)
    _all_near_ties(found)
    print(f"\n[ties] bf16 logits: {len(found)} of {PROMPTS} prompts diverge; (prompt, position, gap AR, gap spec, "
          f"top logit): {found}")


def test_fp32_logits_divergences_are_near_ties_too(pair):
    """fp32 logits change which near-ties flip (on the real model they removed some divergences and added others),
    but the hidden states still round in bf16: every divergence left is a near-tie as well."""
    target, drafter, b = pair
    fp32 = divergences(target, drafter, b, fp32=True)  # the bf16 ones: the test above prints them
    _all_near_ties(fp32)
    print(f"\n[ties] fp32 logits: divergent prompts {sorted(i for i, *_ in fp32)} of {PROMPTS}")
