"""Reading checkpoint directories safely: config.json plus one or many *.safetensors shards.

Shapes and key sets are read from the safetensors headers alone, so a mismatch is reported before any model is
loaded; tensors are read only after every check has passed.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from core.errors import UsageError

# Tensors a drafter export may hold that no drafter loads (it borrows the target's embedding and head); read by
# the drafter and by the refiner checkpoints that carry a co-trained drafter.
DRAFTER_IGNORED_KEYS = ("embed_tokens.", "lm_head.", "rotary_emb.", "mask_embedding", "t2d", "d2t",
                        "confidence_head.")


def local_model_dir(spec: str, what: str) -> str:
    """A local directory as is; a hub id `user/repo` is fetched (config and safetensors only) into the HF cache."""
    if os.path.isdir(spec) or spec.startswith((".", "/", "~")) or spec.count("/") != 1 or " " in spec:
        return spec
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(spec, allow_patterns=["config.json", "*.safetensors", "*.safetensors.index.json"])
    except Exception as e:  # offline, unknown repo, auth: one line, never a traceback
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"{what} {spec}: not a local directory, and fetching it from the HF hub failed ({first})") \
            from None


def read_config(directory: str | Path, what: str) -> dict:
    d = Path(directory)
    if not d.is_dir():
        raise UsageError(f"{what} {directory}: not a directory (expected config.json + *.safetensors)")
    cfg = d / "config.json"
    if not cfg.is_file():
        raise UsageError(f"{what} {directory}: config.json is missing")
    return read_json(cfg, what)


def read_json(path: Path, what: str) -> dict:
    """A JSON object in a file the user named; a missing, unreadable or other file is a UsageError naming WHAT."""
    if not path.exists():
        raise UsageError(f"{what} {path}: no such file")
    if not path.is_file():
        raise UsageError(f"{what} {path}: not a file")
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{what} {path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise UsageError(f"{what} {path}: not a text file (a JSON object expected)") from None
    if not isinstance(obj, dict):
        raise UsageError(f"{what} {path}: a JSON object expected, found {type(obj).__name__}")
    return obj


def shard_files(directory: str | Path, what: str) -> list[Path]:
    d = Path(directory)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except json.JSONDecodeError as e:
            raise UsageError(f"{what} {index}: invalid JSON ({e.msg} at line {e.lineno}); the file is truncated or "
                             "corrupt: download it again or re-export the checkpoint") from None
        files = sorted({d / f for f in weight_map.values()})
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        raise UsageError(f"{what} {directory}: no *.safetensors file found")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise UsageError(f"{what} {directory}: shard listed in the index is missing: {missing[0]}")
    return files


@contextmanager
def readable(f: Path):
    """A safetensors file that cannot be parsed (a truncated download, an interrupted export, another format)
    becomes one line naming the file and what to do, instead of safetensors' traceback that names no file."""
    from safetensors import SafetensorError
    try:
        yield
    except SafetensorError as e:
        detail = str(e).removeprefix("Error while deserializing header: ")
        raise UsageError(f"{f}: not a readable safetensors file ({detail}); it is truncated or corrupt: download "
                         "it again or re-export it") from None


def tensor_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with readable(f), safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                shapes[key] = tuple(fh.get_slice(key).get_shape())
    return shapes


def read_tensors(files: list[Path], keys: set[str] | None = None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with readable(f):
            tensors = load_file(str(f))
        for k, t in tensors.items():
            if keys is None or k in keys:
                out[k] = t
    return out


def check_state(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], what: str,
                ignored: tuple[str, ...] = ()) -> None:
    """Exact key set and shapes, with a one-line message naming the first problems."""
    present = {k for k in found if not any(k.startswith(p) or k == p for p in ignored)}
    missing = sorted(set(expected) - present)
    extra = sorted(present - set(expected))
    if missing:
        raise UsageError(f"{what}: {len(missing)} missing key(s), e.g. {', '.join(missing[:3])}; "
                         "is this a checkpoint of the right architecture?")
    if extra:
        raise UsageError(f"{what}: {len(extra)} unexpected key(s), e.g. {', '.join(extra[:3])}; "
                         "is this a checkpoint of the right architecture?")
    for k, shape in expected.items():
        if tuple(found[k]) != tuple(shape):
            raise UsageError(f"{what}: {k} has shape {list(found[k])}, expected {list(shape)} from the config")


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None) -> None:
    """safetensors' save_file, with the file's mode set as the umask gives any other file: safetensors 0.x creates
    it 0600 (owner only), so shipped or exported weights were unreadable to the rest of a shared machine."""
    from safetensors.torch import save_file
    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_safetensors_dir(directory: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """config.json + model.safetensors, written to temporary names first so a failure leaves nothing behind."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tmp_w, tmp_c = d / ".model.safetensors.tmp", d / ".config.json.tmp"
    save_tensors({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp_w)
    tmp_c.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp_w, d / "model.safetensors")
    os.replace(tmp_c, d / "config.json")
