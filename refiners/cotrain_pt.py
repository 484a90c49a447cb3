"""The co-training checkpoint (`refiner_cotrain*.pt`) read into a RefinerCheckpoint (see refiners.formats).

A dict with `draft_state_dict`, `refiner_state_dict`, `args` (the training argparse Namespace, or a plain dict)
and `global_step`, read with `weights_only=True` and only `argparse.Namespace` allow-listed; anything else in the
pickle is refused by name unless the caller trusts the file (`--trust-pickle`).
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from core.errors import UsageError
from refiners.checkpoint import (DEFAULT_MLP_RATIO, DEFAULT_RANK, MARKOV_HEAD_KEYS, XPRESS, XPRESS_DROPPED_KEYS,
                                 XPRESS_EXPECTED_ARGS, RefinerCheckpoint, _check_kind, _detect_kind_from_keys,
                                 _first_line, head_dims)

_GLOBAL_IN_ERROR = re.compile(r"GLOBAL ([\w.]+)")
SAFE_PICKLE_GLOBALS = [argparse.Namespace]


def _disallowed_global(path: Path, error: BaseException) -> str | None:
    m = _GLOBAL_IN_ERROR.search(str(error))
    if m:
        return m.group(1)
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception:  # noqa: BLE001 - only a better message is at stake
        return None
    allowed = {f"{c.__module__}.{c.__qualname__}" for c in SAFE_PICKLE_GLOBALS}
    names = [n for n in names if n not in allowed]
    return names[0] if names else None


def _unpickler_reason(error: BaseException) -> str:
    """The informative line of torch's long weights-only error text."""
    text = str(error)
    tail = text.split("WeightsUnpickler error:", 1)[-1] if "WeightsUnpickler error:" in text else ""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    return lines[0] if lines else type(error).__name__


def _torch_load(path: Path, trust_pickle: bool) -> object:
    if trust_pickle:
        try:
            return torch.load(str(path), map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001
            raise UsageError(f"refiner checkpoint {path}: cannot be read as a torch checkpoint "
                             f"({_first_line(e)})") from None
    try:
        with torch.serialization.safe_globals(SAFE_PICKLE_GLOBALS):
            return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        import pickle
        if isinstance(e, pickle.UnpicklingError) and "weights only" in str(e).lower():
            name = _disallowed_global(path, e)
            if name:
                raise UsageError(f"refiner checkpoint {path}: the pickle contains the class {name}, which a "
                                 "weights-only load does not allow; if you trust this file, pass --trust-pickle") \
                    from None
            why = _unpickler_reason(e)
            raise UsageError(f"refiner checkpoint {path}: cannot be read as a torch checkpoint by the weights-only "
                             f"loader ({why}); if it is a pickle you trust, --trust-pickle reads it without the "
                             "restrictions") from None
        raise UsageError(f"refiner checkpoint {path}: cannot be read as a torch checkpoint "
                         f"({_first_line(e)})") from None


def _args_dict(args: object, where: str) -> dict:
    if isinstance(args, argparse.Namespace):
        return dict(vars(args))
    if isinstance(args, dict):
        return dict(args)
    if args is None:
        raise UsageError(f"{where}: 'args' is None; the head cannot be rebuilt without the training arguments")
    try:  # a trusted pickle may hold another namespace-like object
        return dict(vars(args))
    except TypeError:
        raise UsageError(f"{where}: 'args' is a {type(args).__name__}, expected an argparse Namespace or a dict") \
            from None


def _as_step(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _tensor_dict(obj, name: str, where: str) -> dict[str, torch.Tensor]:
    if not isinstance(obj, dict):
        raise UsageError(f"{where}: {name} is a {type(obj).__name__}, expected a dict of tensors")
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise UsageError(f"{where}: {name}[{bad[0]!r}] is not a tensor")
    return dict(obj)


def _check_rank(args: dict, rank: int, where: str) -> None:
    want = args.get("markov_rank", DEFAULT_RANK)
    if want != rank:
        said = f"args.markov_rank={want}" if "markov_rank" in args else f"args has no markov_rank (default {want})"
        raise UsageError(f"{where}: {said}, but w1.weight has width {rank}; the training arguments do not match "
                         "the tensors")


def load_cotrain_pt(path: str | Path, expect_kind: str | None = None, trust_pickle: bool = False) -> RefinerCheckpoint:
    p = Path(path)
    where = f"refiner checkpoint {p}"
    ckpt = _torch_load(p, trust_pickle)
    if not isinstance(ckpt, dict):
        raise UsageError(f"{where}: holds a {type(ckpt).__name__}, expected the co-training dict "
                         "(draft_state_dict, refiner_state_dict, args)")
    missing = [k for k in ("draft_state_dict", "refiner_state_dict", "args") if k not in ckpt]
    if missing:
        raise UsageError(f"{where}: key(s) {', '.join(missing)} missing; not a co-training checkpoint "
                         f"(it has {', '.join(sorted(map(str, ckpt))[:5]) or 'nothing'})")
    draft = _tensor_dict(ckpt["draft_state_dict"], "draft_state_dict", where)
    head = _tensor_dict(ckpt["refiner_state_dict"], "refiner_state_dict", where)
    args = _args_dict(ckpt["args"], where)
    kind = _detect_kind_from_keys(head)
    if kind == XPRESS:
        evidence = "its head has " + ", ".join(sorted(k for k in head if k not in MARKOV_HEAD_KEYS)[:2])
    else:
        evidence = "its head has only " + (", ".join(sorted(head)[:3]) or "no tensors")
    _check_kind(kind, expect_kind, where, evidence)
    if kind == XPRESS:
        for name, want in XPRESS_EXPECTED_ARGS.items():
            if name in args and args[name] != want:
                raise UsageError(f"{where}: training flag {name}={args[name]!r} (expected {want!r}): this xPress head "
                                 "variant is not supported")
        for k in XPRESS_DROPPED_KEYS:
            head.pop(k, None)
    else:
        variant = args.get("markov_head_type", "vanilla")
        if variant != "vanilla":
            raise UsageError(f"{where}: Markov head variant {variant!r} is not supported (only 'vanilla', w1/w2)")
    dims = head_dims(kind, head, str(p))
    _check_rank(args, dims["rank"], where)
    mlp = None
    if kind == XPRESS:
        mlp = dims["mlp_hidden"]
        ratio = args.get("mlp_ratio", DEFAULT_MLP_RATIO)
        try:
            want = int(round(float(ratio) * dims["rank"]))
        except (TypeError, ValueError):
            raise UsageError(f"{where}: args.mlp_ratio={ratio!r} is not a number") from None
        if want != mlp:
            said = f"args.mlp_ratio={ratio!r}" if "mlp_ratio" in args else f"args has no mlp_ratio (default {ratio})"
            raise UsageError(f"{where}: {said} gives an MLP hidden of {want}, but mlp.gate_proj.weight has {mlp} rows")
    return RefinerCheckpoint(kind=kind, draft_state=draft, head_state=head, rank=dims["rank"], mlp_hidden=mlp,
                             block_size=dims.get("block"), step=_as_step(ckpt.get("global_step", ckpt.get("step"))),
                             source=str(p), mixer="raw")
