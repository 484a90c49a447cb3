"""--device spyre: the IBM Spyre card through torch-spyre, imported only when asked for.

torch-spyre registers the `spyre` device with PyTorch (PrivateUse1) and a torch.compile backend for it. It is not
on PyPI: it is built from https://github.com/torch-spyre/torch-spyre against the IBM Spyre software stack (the
vLLM plugin vllm-spyre-next depends on it); the PyPI package `ibm-spyre` 0.0.1 is an empty placeholder.

Spyre serves FP16 weights in compiled graphs of fixed shapes: the decode steps here have fixed row counts (1 for
an AR step, B for a verify block and a draft block), and `compile_for` compiles the target and drafter forwards
with dynamic=False, so each row count is one graph. The serving contract is checked before any of this
(harness.protocol.spyre_contract).
"""
from __future__ import annotations

import importlib

import torch

from core.errors import UsageError

PACKAGE = "torch_spyre"
MISSING = ("--device spyre needs torch-spyre (import torch_spyre), the PyTorch backend of IBM Spyre. It is not on "
           "PyPI: build it from https://github.com/torch-spyre/torch-spyre with the IBM Spyre software stack "
           "(vllm-spyre-next depends on it); the PyPI package 'ibm-spyre' 0.0.1 is an empty placeholder")


def import_torch_spyre(importer=importlib.import_module):
    try:
        return importer(PACKAGE)
    except ImportError as e:
        detail = "" if getattr(e, "name", None) == PACKAGE else f" (importing it failed: {e})"
        raise UsageError(MISSING + detail) from None


def spyre_backend(name: str, dtype: str | None, importer=importlib.import_module) -> tuple[torch.device, torch.dtype]:
    """The device and dtype for --device spyre[:N] (core.devices makes the Backend): FP16 only (the
    contract), torch-spyre imported here and nowhere else."""
    if dtype not in (None, "float16", "fp16"):
        raise UsageError(f"--device spyre serves FP16 weights only, not --dtype {dtype}; use --dtype float16")
    import_torch_spyre(importer)
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {name}: torch-spyre is installed but did not register the 'spyre' device "
                         "(check the IBM Spyre software stack)") from None
    return dev, torch.float16


def compile_for(target, drafters=(), backend: str | None = None) -> None:
    """Compiled execution with fixed shapes: the target's forward and each drafter's block (dynamic=False: one
    graph per row count). `backend`: torch.compile's (None: torch-spyre's default for the spyre device)."""
    kw = {"dynamic": False, **({"backend": backend} if backend else {})}
    target.forward = torch.compile(target.forward, **kw)
    for d in {id(d): d for d in drafters if d is not None}.values():
        d.model.block = torch.compile(d.model.block, **kw)
