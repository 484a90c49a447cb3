"""The ops seam: one interface for the decode math (`Ops`), in torch (`TorchOps`) and on the Triton kernels
(`TritonOps`). `make_ops` chooses once, from the run's setting and the target's config, before weights load."""
from __future__ import annotations

import importlib
import os

import torch

from core.ops.base import Ops, Span, eps_of, fuse_rows
from core.ops.torch_impl import TorchOps
from core.errors import UsageError

KINDS = ("auto", "triton", "torch")

__all__ = ["KINDS", "Ops", "Span", "TorchOps", "eps_of", "fuse_rows", "make_ops", "triton_installed", "triton_ops"]


def triton_installed() -> bool:
    """Whether `import triton` works, asked without importing the kernels (the CPU torch wheel brings no Triton,
    and nothing of core.kernels may be imported where it cannot run)."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def interpreted() -> bool:
    """TRITON_INTERPRET=1: the kernels run on CPU tensors (the tests' way), given Triton is installed."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and triton_installed()


def triton_ops(device, launch=None, debug: bool | None = None) -> Ops:
    """TritonOps on `device` (launch: a kernels.Launch, default PDL where supported; debug: the counter check,
    default from XPRESS_BENCH_DEBUG=1)."""
    from core import kernels
    from core.ops.triton_impl import TritonOps
    if debug is None:
        debug = os.environ.get("XPRESS_BENCH_DEBUG", "0") not in ("", "0")
    return TritonOps(device, launch or kernels.Launch(pdl=None), debug=debug)


def make_ops(kind: str, device: torch.device, dtype: torch.dtype, config=None, compat: bool = False,
             attn_impl: str = "sdpa", launch=None) -> Ops:
    """--kernels: triton (refused, with the reason, where this target or machine cannot), torch, or auto (triton
    for CUDA bf16/fp16 targets that fit, else torch; compat (--compat-reference) and eager attention keep HF's
    ops, as the reference ran them). `config` is the target's HF config (read before any weights)."""
    if kind not in KINDS:
        raise UsageError(f"--kernels {kind!r}: use one of {', '.join(KINDS)}")
    if kind == "torch":
        return TorchOps()
    device = torch.device(device)
    why = None
    if device.type != "cuda" and not interpreted():
        why = "they need a CUDA device"
    elif not triton_installed():
        why = "triton is not installed"
    elif attn_impl != "sdpa":
        why = f"--attn-implementation {attn_impl} (the kernels have one attention)"
    elif config is not None:  # only now the kernels are imported: Triton is there and the device can run them
        from core.ops.triton_impl import unsupported_reason
        why = unsupported_reason(config)
    if kind == "triton":
        if why is not None:
            raise UsageError(f"--kernels triton: not available for this target: {why}; use --kernels torch")
        return triton_ops(device, _launch_for(launch, config, dtype))
    if why is None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and not compat:
        return triton_ops(device, _launch_for(launch, config, dtype))
    return TorchOps()


def _launch_for(launch, config, dtype: torch.dtype):
    """The launch settings (default PDL where supported) with one_row_pdl, unless the caller set it, chosen by the
    target's config: on for a launch-bound target (core.ops.triton_impl.launch_bound)."""
    from dataclasses import replace

    from core import kernels
    from core.ops.triton_impl import launch_bound
    launch = launch or kernels.Launch(pdl=None)
    if launch.one_row_pdl is None and config is not None:
        launch = replace(launch, one_row_pdl=launch_bound(config, dtype))
    return launch
