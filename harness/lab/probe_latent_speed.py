"""How fast the fused xPress latent runs under each launch setting and mix path: python -m
harness.lab.probe_latent_speed [--quick] [--out FILE.json] (CUDA and Triton needed; --quick about a minute on an
H100, most of it compiling 48 settings; all three geometries about three).

On an H200 the latent launch took 14 us of a 22 us xPress pass at the shipped geometry (results/perf/
gpu_check_h200_quick/refiner_profile.md): one program does the whole block, and its mix picks one slot out of the
block (a reduction across the slots) and gathers M's column for it (one element a channel) B times in turn. This
times, in a CUDA graph of many launches, each combination of the mix path (core.kernels.xpress.latent's
mix_transposed), warps and the in_proj and MLP tiles (BK, BH) at the shipped geometry (block 16, rank 80, MLP 160,
bf16; the folded mixer the decode serves, and the raw one of training's form) and at rank 160, PDL as the decode
launches it, and prints each one's time per launch and its largest difference from the launcher's own setting (0:
the same bits). A setting that is faster and
within the dtype's rounding is a candidate for the launcher, after tests/test_xpress_latent.py passes compiled with
it; results/perf/NOTES.md says what was chosen.
"""
from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch

from core.errors import Parser
from core.kernels import xpress
from core.kernels.common import Launch, pow2_at_least
from harness.lab.bench_kernels import graph_ms
from harness.protocol.algorithms import random_xpress_head

# block, rank, MLP hidden, folded: the decode folds the mixer after the cast (--no-fold-mixer keeps it raw), so the
# shipped heads' serving launch is the first; the raw mixer is training's form
CASES = [(16, 80, 160, True), (16, 80, 160, False), (16, 160, 320, True)]
LAUNCHES, REPLAYS = 100, 20


def _launcher(head, cache, prev, folded: bool, mixt: bool, warps: int, bk: int, bh: int):
    """A launch of `latent` at one setting, and the settings it launches with (PDL as the decode's TritonOps launches
    it: Launch(pdl=None), on where the GPU supports it)."""
    weights = xpress.head_weights(head)
    launch, tiles = Launch(pdl=None).resolve(cache.device), {"MIXT": mixt, "num_warps": warps, "BK": bk, "BH": bh}
    opts = xpress.settings(head.block, head.rank, cache.dtype, cache.device, folded, launch, tiles=tiles)
    return (lambda: xpress.latent(cache, prev, *weights, folded=folded, launch=launch, tiles=tiles)), opts


def _time(go) -> float:
    """Microseconds a launch: the median replay of a CUDA graph of LAUNCHES launches (bench_kernels.graph_ms, over
    REPLAYS replays), over LAUNCHES."""
    return graph_ms([go] * LAUNCHES, reps=REPLAYS) * 1e3 / LAUNCHES


def settings(rank: int) -> list[tuple]:
    """(mix_transposed, num_warps, BK, BH) tried at this rank."""
    return list(itertools.product((False, True), (1, 2, 4, 8), sorted({16, 32, min(pow2_at_least(rank, 16), 64)}),
                                  (32, 64)))


def probe(block: int, rank: int, mlp: int, folded: bool, dev: torch.device, dtype=torch.bfloat16, timer=None,
          only: list[tuple] | None = None, vocab: int = 49152, hidden: int = 576) -> list[dict]:
    """Each setting's record at one geometry; `timer` (default: a CUDA graph's) and `only` (a subset of
    `settings`) let the tests run the same launches in Triton's CPU interpreter."""
    timer = timer or _time
    head = random_xpress_head(vocab, hidden, rank, block, seed=0, mlp_hidden=mlp, std=0.2, mix_std=0.3)
    head = (head.fold() if folded else head).to(dev, dtype).requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    cache = head.block_cache(torch.randn(block, hidden, generator=g).to(dev, dtype))
    prev = torch.randint(0, vocab, (block,), generator=g).to(dev)
    ref = xpress.latent(cache, prev, *xpress.head_weights(head), folded=folded).clone()
    rows = []
    for mixt, warps, bk, bh in only or settings(rank):
        rec = {"block": block, "rank": rank, "mlp": mlp, "folded": folded, "mix_transposed": mixt,
               "num_warps": warps, "BK": bk, "BH": bh}
        try:
            go, opts = _launcher(head, cache, prev, folded, mixt, warps, bk, bh)
            rec["launched"] = {k: opts[k] for k in ("MIXT", "num_warps", "BK", "BH", "RAW", "PDL")}
            z = go().clone()
            rec["max_diff"] = (z.float() - ref.float()).abs().max().item()
            rec["scale"] = ref.float().abs().max().item()
            rec["us"] = timer(go)
        except Exception as e:  # a setting that does not compile or launch here (shared memory, registers)
            rec["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    return rows


def main(argv=None) -> int:
    ap = Parser(prog="python -m harness.lab.probe_latent_speed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write every setting's record here (JSON)")
    ap.add_argument("--quick", action="store_true", help="the shipped heads' serving launch alone (rank 80, the "
                    "mixer folded: 48 settings to compile instead of 144)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or xpress.triton is None:
        print("error: harness.lab.probe_latent_speed needs a CUDA device and triton", file=sys.stderr)
        return 2
    rows = [r for case in (CASES[:1] if args.quick else CASES) for r in probe(*case, torch.device("cuda"))]
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "weights": "random (timing does not depend on values)",
                                        "launches_per_graph": LAUNCHES, "replays": REPLAYS,
                                        "us": "the median replay over the launches a graph", "rows": rows},
                                       indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
