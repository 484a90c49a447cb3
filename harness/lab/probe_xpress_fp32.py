"""Which launch settings give the fused xPress latent wrong fp32 values on a GPU: python -m
harness.lab.probe_xpress_fp32 (CUDA and Triton needed; about 90 s on an H100, most of it compiling).

The kernel refuses fp32 on a GPU (core.kernels.xpress.refused) since its first GPU run gave wrong latents at the
shipped geometry with the raw mixer. This launches its program directly, past that refusal, for each combination of
programmatic dependent launch, dot precision (ieee, tf32, the default), warps (4, 8) and the in_proj tile BK (16,
and the launcher's min(RP, 64)), at the shipped geometry (block 16, rank 80, MLP 160; raw and folded mixer) and a
small one, and prints each one's largest error against the head's torch modules (XPressHead.latent) beside the
outputs' scale. ieee is the launcher's setting for fp32; tf32 and the default are expected to differ by tf32's
rounding (about 1e-3 of the scale), not by the scale itself. Results: results/perf/NOTES.md ("... the fp32 latent narrowed").
"""
from __future__ import annotations

import itertools
import sys

import torch

from core.kernels import xpress
from core.kernels.common import pow2_at_least
from harness.protocol.algorithms import random_xpress_head

CASES = [(16, 80, 160, False), (16, 80, 160, True), (8, 16, 32, False)]  # block, rank, MLP hidden, folded


def probe(block: int, rank: int, mlp: int, folded: bool, dev: torch.device) -> None:
    head = random_xpress_head(300, 48, rank, block, seed=0, mlp_hidden=mlp, std=0.2, mix_std=0.3)
    head = (head.fold() if folded else head).to(dev, torch.float32).requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(block, 48, generator=g).to(dev)
    prev = torch.randint(0, 300, (block,), generator=g).to(dev)
    cache = head.block_cache(h)
    want = head.latent(cache, prev)
    w1, wt, mix, gw, uw, dw = xpress.head_weights(head)
    rp = pow2_at_least(rank, 16)
    for pdl, prec, warps, bk in itertools.product((False, True), ("ieee", "tf32", None), (4, 8),
                                                  sorted({16, min(rp, 64)})):
        what = f"block {block} rank {rank} folded {folded} pdl {pdl} prec {prec} warps {warps} bk {bk}"
        z = torch.empty((block - 1, rank), dtype=torch.float32, device=dev)
        try:
            xpress._latent_kernel[(1,)](cache, prev, w1, wt, mix, gw, uw, dw, z, block, rank, mlp, cache.stride(0),
                                        prev.stride(0), w1.stride(0), wt.stride(0), gw.stride(0), uw.stride(0),
                                        dw.stride(0), z.stride(0), 0, 0, 0, PREC=prec, RAW=not folded,
                                        BP=pow2_at_least(block, 16), RP=rp, BK=bk, BH=64, num_warps=warps, PDL=pdl,
                                        **({"launch_pdl": True} if pdl else {}))
            torch.cuda.synchronize()
            print(f"{what}: max err {(z - want).abs().max().item():.3g} (scale {want.abs().max().item():.3g})",
                  flush=True)
        except Exception as e:  # a setting that does not compile or launch here
            print(f"{what}: {type(e).__name__} {str(e)[:100]}", flush=True)


def main() -> int:
    if not torch.cuda.is_available() or xpress.triton is None:
        print("error: harness.lab.probe_xpress_fp32 needs a CUDA device and triton", file=sys.stderr)
        return 2
    for case in CASES:
        probe(*case, torch.device("cuda"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
