"""Convert refiner checkpoints between the co-training `.pt` and the serving directory.

    python -m scripts.convert_refiner pt-to-serving --ckpt refiner_cotrain.pt --base-config DRAFTER_DIR --out OUT_DIR
    python -m scripts.convert_refiner serving-to-pt --src SERVING_DIR --out refiner_cotrain.pt

pt-to-serving writes config.json (the base dFlash config plus the head fields the vLLM integration reads) and
model.safetensors (the co-trained drafter tensors under their own names, the head under `xpress_head.` with the raw
mixer, or `markov_head.markov_w1/w2.weight`). serving-to-pt writes the dict the reference harness reads
(draft_state_dict, refiner_state_dict, args, global_step). The output must not exist; it is written under a
temporary name and renamed at the end, so a failure leaves nothing behind. Errors: one line, exit status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from core.errors import Parser, UsageError, cli_exit
from refiners.formats import (ARCHITECTURES, MARKOV_PREFIX, MARKOV_SERVING_NAMES, XPRESS, XPRESS_PREFIX,
                              RefinerCheckpoint, load_refiner_checkpoint, validate_against)


def _default_mode(mode: int) -> int:
    """mkdtemp/mkstemp create private (0700/0600) entries; give the output the usual umask-based permissions."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def _check_new_output(out: Path) -> None:
    if out.exists() or out.is_symlink():
        raise UsageError(f"--out {out}: already exists; refusing to overwrite it")
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: the parent directory {out.parent} does not exist")


def read_base_config(path: str | Path) -> dict:
    """--base-config: a drafter directory holding config.json, or a config.json file."""
    p = Path(path).expanduser()
    cfg_file = p / "config.json" if p.is_dir() else p
    if not cfg_file.is_file():
        raise UsageError(f"--base-config {path}: no such config.json (give a drafter directory or its config.json)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"--base-config {cfg_file}: invalid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"--base-config {cfg_file}: expected a JSON object")
    return cfg


def serving_config(base: dict, ckpt: RefinerCheckpoint, num_passes: int) -> dict:
    """The base dFlash config with any earlier head fields removed and this head's fields added."""
    cfg = {k: v for k, v in base.items()
           if not k.startswith(("xpress_", "markov_")) and k not in ("sample_from_anchor",)}
    cfg["architectures"] = [ARCHITECTURES[ckpt.kind]]
    if ckpt.kind == XPRESS:
        cfg.update(xpress_rank=ckpt.rank, xpress_mlp_hidden=ckpt.mlp_hidden, xpress_block_size=ckpt.block_size,
                   xpress_num_passes=num_passes)
    else:
        cfg["markov_rank"] = ckpt.rank
    cfg["sample_from_anchor"] = False
    return cfg


def serving_tensors(ckpt: RefinerCheckpoint) -> dict[str, torch.Tensor]:
    out = dict(ckpt.draft_state or {})
    if ckpt.kind == XPRESS:
        head = {XPRESS_PREFIX + k: v for k, v in ckpt.head_state.items()}
    else:
        head = {MARKOV_PREFIX + MARKOV_SERVING_NAMES[k]: v for k, v in ckpt.head_state.items()}
    clash = sorted(set(out) & set(head))
    if clash:
        raise UsageError(f"drafter tensor {clash[0]} collides with a head tensor name")
    out.update(head)
    # safetensors refuses tensors that share storage (tied weights); give those their own copy.
    seen: set[int] = set()
    for k, v in out.items():
        ptr = v.untyped_storage().data_ptr()
        if ptr in seen and v.numel():
            out[k] = v.clone()
        seen.add(ptr)
    return out


def pt_to_serving(ckpt_path: str, base_config: str, out: str, num_passes: int = 6, trust_pickle: bool = False) -> Path:
    from drafters.dflash import DFlashConfig
    from core.checkpoints import write_safetensors_dir
    dest = Path(out).expanduser()
    _check_new_output(dest)
    if num_passes < 0:
        raise UsageError(f"--num-passes {num_passes}: must be >= 0")
    base = read_base_config(base_config)
    dcfg = DFlashConfig.from_dict(base, f"--base-config {base_config}")
    ckpt = load_refiner_checkpoint(ckpt_path, None, trust_pickle=trust_pickle)
    if ckpt.mixer != "raw":  # a .pt always holds the raw mixer; kept as a guard
        raise UsageError(f"{ckpt_path}: the mixer is already folded; the serving layout stores it raw")
    validate_against(ckpt, dcfg.vocab_size, dcfg.hidden_size, None, dcfg.expected_shapes())
    if ckpt.kind == XPRESS and ckpt.block_size != dcfg.block_size:
        raise UsageError(f"{ckpt_path}: the mixer was trained for block {ckpt.block_size}, but the base drafter config "
                         f"has block_size {dcfg.block_size}; the serving config would be inconsistent")
    cfg = serving_config(base, ckpt, num_passes)
    tensors = serving_tensors(ckpt)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        write_safetensors_dir(tmp, cfg, tensors)
        os.chmod(tmp, _default_mode(0o777))
        _check_new_output(dest)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def cotrain_dict(ckpt: RefinerCheckpoint) -> dict:
    """The co-training `.pt` content; args is an argparse Namespace so the reference harness can getattr it."""
    if ckpt.mixer != "raw":
        raise UsageError(f"{ckpt.source}: the xPress mixer is stored folded (mix_L = L*tril + I); a co-training "
                         "checkpoint needs the raw L, which cannot be recovered exactly")
    if not ckpt.draft_state:
        raise UsageError(f"{ckpt.source}: holds no drafter tensors (a head trained on a frozen drafter, as the "
                         "shipped heads are); a co-training checkpoint needs the co-trained drafter, so there is "
                         "nothing to convert: the harness loads this folder as it is (--xpress-refiner-path / "
                         "--markov-refiner-path)")
    args = argparse.Namespace(markov_rank=ckpt.rank)
    if ckpt.kind == XPRESS:
        ratio = ckpt.mlp_hidden / ckpt.rank
        args.mlp_ratio = int(ratio) if ratio == int(ratio) else ratio
    else:
        args.markov_head_type = ckpt.variant
    return {"draft_state_dict": dict(ckpt.draft_state), "refiner_state_dict": dict(ckpt.head_state), "args": args,
            "global_step": ckpt.step}


def serving_to_pt(src: str, out: str) -> Path:
    dest = Path(out).expanduser()
    _check_new_output(dest)
    p = Path(src).expanduser()
    if not p.is_dir():
        raise UsageError(f"--src {src}: not a directory (expected a serving layout: config.json + *.safetensors)")
    content = cotrain_dict(load_refiner_checkpoint(p, None))
    fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(content, fh)
        os.chmod(tmp, _default_mode(0o666))
        _check_new_output(dest)
        os.rename(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m scripts.convert_refiner",
                    description="Convert refiner checkpoints (co-training .pt <-> serving dir).")
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("pt-to-serving", help="co-training .pt -> config.json + model.safetensors")
    a.add_argument("--ckpt", required=True, help="co-training checkpoint (refiner_cotrain*.pt)")
    a.add_argument("--base-config", required=True, help="the base dFlash drafter directory or its config.json")
    a.add_argument("--out", required=True, help="new output directory")
    a.add_argument("--num-passes", type=int, default=6, help="xpress_num_passes written to the config (default 6)")
    a.add_argument("--trust-pickle", action="store_true",
                   help="load the .pt with weights_only=False (runs arbitrary code from the file; trusted files only)")
    b = sub.add_parser("serving-to-pt", help="serving directory -> co-training .pt")
    b.add_argument("--src", required=True, help="serving directory (config.json + *.safetensors)")
    b.add_argument("--out", required=True, help="new output .pt file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def work():
        if args.command == "pt-to-serving":
            dest = pt_to_serving(args.ckpt, args.base_config, args.out, args.num_passes, args.trust_pickle)
        else:
            dest = serving_to_pt(args.src, args.out)
        print(dest)
    return cli_exit(work)


if __name__ == "__main__":
    sys.exit(main())
