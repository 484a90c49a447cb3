"""Write random-weights xPress and Markov heads that fit a given target and drafter, as serving directories.

    python -m scripts.make_random_refiners --target TARGET --drafter DRAFTER_DIR --out DIR [--rank 64] [--force]

DIR/xpress/ and DIR/markov/ each hold config.json (the drafter's config plus the head's fields) and
model.safetensors (the head only, no co-trained drafter: the arms run with DRAFTER_DIR's weights), the layout
`--xpress-refiner-path` / `--markov-refiner-path` read (refiners/formats.py). Random heads propose badly (tau near
1) but exercise every arm of the paired protocol offline; with scripts/make_random_drafter.py writing DIR/drafter/,
DIR is a stand-in for the shipped weights: XPRESS_BENCH_WEIGHTS=DIR python benchmark_compile_all.py.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from core.errors import Parser, UsageError, cli_exit
from scripts.random_mark import mark


def write_heads(target: str, drafter: str, out: str | Path, rank: int = 64, seed: int = 0,
                force: bool = False) -> list[Path]:
    from drafters.dflash import read_dflash_config
    from core.checkpoints import write_safetensors_dir
    from harness.decode.loading import load_target_config
    from scripts.convert_refiner import serving_config, serving_tensors
    from refiners.formats import MARKOV, XPRESS, RefinerCheckpoint
    from refiners.markov import random_markov_head
    from refiners.xpress import random_xpress_head
    if rank < 1:
        raise UsageError(f"--rank {rank}: must be >= 1")
    if not (Path(drafter) / "config.json").is_file():
        raise UsageError(f"--drafter {drafter}: no config.json there; give a dFlash drafter directory (e.g. one "
                         "scripts.make_random_drafter wrote)")
    tcfg = load_target_config(target)
    dcfg = read_dflash_config(drafter)
    dcfg.check_target(tcfg, f"drafter {drafter}")
    base = dcfg.to_dict()
    dirs = {XPRESS: Path(out) / "xpress", MARKOV: Path(out) / "markov"}
    for d in dirs.values():
        if (d / "config.json").exists() and not force:
            raise UsageError(f"{d} already holds a checkpoint; pass --force to overwrite it, or choose a new --out")
    heads = {XPRESS: random_xpress_head(tcfg.vocab_size, dcfg.hidden_size, rank, dcfg.block_size, seed=seed),
             MARKOV: random_markov_head("vanilla", tcfg.vocab_size, dcfg.hidden_size, rank, seed=seed + 1)}
    for kind, head in heads.items():
        state = {k: v for k, v in head.state_dict().items() if k != "mix.tril"}
        mlp = state["mlp.gate_proj.weight"].shape[0] if kind == XPRESS else None
        ck = RefinerCheckpoint(kind=kind, draft_state=None, head_state=state, rank=rank, mlp_hidden=mlp,
                               block_size=dcfg.block_size)
        if force and dirs[kind].exists():
            shutil.rmtree(dirs[kind])
        write_safetensors_dir(dirs[kind], serving_config(base, ck, num_passes=4), serving_tensors(ck))
        mark(dirs[kind])
    return list(dirs.values())


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m scripts.make_random_refiners", description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="target: hub id, local directory or .gguf file")
    p.add_argument("--drafter", required=True, help="the dFlash drafter directory the heads pair with")
    p.add_argument("--out", required=True, help="folder for xpress/ and markov/")
    p.add_argument("--rank", type=int, default=64, help="head rank (xPress w1 width, Markov w1 width)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite heads already in --out")
    a = p.parse_args(argv)
    return cli_exit(lambda: print("\n".join(map(str, write_heads(a.target, a.drafter, a.out, a.rank, a.seed,
                                                                 a.force)))))


if __name__ == "__main__":
    sys.exit(main())
