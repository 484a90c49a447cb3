"""Device backends: naming, dtype rules, synchronisation and wall-clock timing.

The loop never calls torch.cuda directly; everything device-specific goes through here so that CPU, CUDA and
(later) Spyre share one code path.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from core.errors import UsageError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class Backend:
    device: torch.device
    dtype: torch.dtype

    @property
    def kind(self) -> str:
        return self.device.type

    def sync(self) -> None:
        """Wait for queued device work, so that a host timestamp means what it says."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "spyre":  # torch-spyre's device (core.spyre)
            torch.accelerator.synchronize(self.device)

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g


def resolve_backend(device: str | None, dtype: str | None) -> Backend:
    """Turn the --device/--dtype strings into a Backend, failing early with a usable message."""
    name = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name.split(":")[0] == "spyre":
        from core.spyre import spyre_backend
        return Backend(*spyre_backend(name, dtype))
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {name!r} is not a device name; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name} asked for CUDA but torch sees no GPU; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: only {torch.cuda.device_count()} GPU(s) are visible")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name}: backend {dev.type!r} is not supported (cpu, cuda, spyre)")
    if dtype is None:
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    else:
        if dtype not in DTYPES:
            raise UsageError(f"--dtype {dtype!r} is not known; use one of float32, bfloat16, float16")
        dt = DTYPES[dtype]
    if dev.type == "cpu" and dt == torch.float16:
        raise UsageError("--dtype float16 is not supported on CPU; use float32 or bfloat16")
    return Backend(dev, dt)
