"""Write a random-weights dFlash drafter (z-lab layout) that fits a given target, for examples and timing.

    python -m scripts.make_random_drafter --target TARGET --out DIR [--layers 2] [--block-size 16] [--force]

A random drafter proposes badly (tau near 1) but exercises the whole speculative path at the target's shapes.
"""
from __future__ import annotations

import os
import sys

from drafters.dflash import config_for_target, random_dflash, save_dflash
from core.errors import Parser, UsageError
from harness.decode.loading import load_target_config
from scripts.random_mark import mark


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m scripts.make_random_drafter", description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="target: hub id, local directory or .gguf file")
    p.add_argument("--out", required=True, help="new directory for config.json + model.safetensors")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mask-token-id", type=int, help="default: the last row of the target's embedding")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite a checkpoint already in --out")
    a = p.parse_args(argv)
    try:
        if os.path.exists(a.out) and not os.path.isdir(a.out):
            raise UsageError(f"--out {a.out} is a file; give a directory for config.json + model.safetensors")
        if os.path.exists(os.path.join(a.out, "config.json")) and not a.force:
            raise UsageError(f"--out {a.out} already holds a checkpoint; pass --force to overwrite it, or choose a "
                             "new directory")
        if a.layers < 1 or a.block_size < 2:
            raise UsageError("--layers must be >= 1 and --block-size >= 2")
        tcfg = load_target_config(a.target)
        mask = tcfg.vocab_size - 1 if a.mask_token_id is None else a.mask_token_id
        cfg = config_for_target(tcfg, a.layers, a.block_size, mask)
        cfg.check_target(tcfg)
        save_dflash(random_dflash(cfg, seed=a.seed), a.out)
        mark(a.out)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
