"""A torch.profiler record in one format for the training step (training/profiling.py, profile.json) and the
batched generator (harness.lab.bench_generate --profile): per step, the device's busy time, the labelled ranges
(`xb.*` record_function ranges), the host ops by the device time they caused and the kernels by their own."""
from __future__ import annotations

import torch


def _own_device_us(e) -> float:
    return float(getattr(e, "self_device_time_total", 0.0) or 0.0)


def _device_us(e) -> float:
    return float(getattr(e, "device_time_total", 0.0) or 0.0)


def _on_device(e) -> bool:
    """A kernel (or other device activity) row of key_averages, not a host op."""
    kind = getattr(e, "device_type", None)
    return kind is not None and kind != torch.autograd.DeviceType.CPU


def summary(events, steps: int, wall_s: float, on_device: bool, top: int = 30) -> dict:
    """The profile.json record from `prof.key_averages()`. On CUDA the rows are of two kinds: host ops (aten::mm,
    whose own device time is that of the kernels they launched) and the kernels themselves; each kernel's time is
    in both, so the device's busy time sums the kernels alone, `top` lists the host ops by the device time they
    caused and `top_kernels` the kernels."""
    per = 1e-6 / steps
    ops = [e for e in events if not _on_device(e) and not e.key.startswith("xb.")]
    kernels = [e for e in events if _on_device(e) and not e.key.startswith("xb.")]
    own = _own_device_us if on_device else (lambda e: float(e.self_cpu_time_total))
    ops = sorted((e for e in ops if own(e) > 0), key=own, reverse=True)
    kernels.sort(key=_own_device_us, reverse=True)
    return {"steps": steps, "wall_s_per_step": round(wall_s / steps, 6),
            "device_busy_s_per_step": round(sum(_own_device_us(e) for e in kernels) * per, 6),
            "sort": "own device time" if on_device else "own host time", "ranges": _ranges(events, per),
            "top": [{"op": e.key, "count": e.count, "own_s_per_step": round(own(e) * per, 6),
                     "host_s_per_step": round(e.self_cpu_time_total * per, 6)} for e in ops[:top]],
            "top_kernels": [{"kernel": e.key, "count": e.count, "s_per_step": round(_own_device_us(e) * per, 6)}
                            for e in kernels[:top]]}


def _ranges(events, per: float) -> dict:
    """Each xb.* range from its two rows: the host's (its wall time there, and the device time of the kernels
    launched inside it: device_s) and, on CUDA, the device's annotation of it (device_span_s: from its first
    kernel's start to its last one's end, the gaps between them included; more than device_s where the device
    waited for the host's launches). The first version kept whichever row came last and counted the device's
    annotation as a kernel: its span was added to the busy time beside the kernels it spans (results/perf/NOTES.md,
    eighth session)."""
    out: dict = {}
    for e in events:
        if not e.key.startswith("xb."):
            continue
        r = out.setdefault(e.key, {"host_s": None, "device_s": None, "device_span_s": None, "count": 0})
        if _on_device(e):
            r["device_span_s"] = round(_device_us(e) * per, 6)
        else:
            r.update(host_s=round(e.cpu_time_total * per, 6), device_s=round(_device_us(e) * per, 6), count=e.count)
    return out
