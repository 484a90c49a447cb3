"""Per rank of a distributed run (harness.protocol.distributed): the GPU it ran on, its clocks and driver before and
after the timed rounds, its loop time, and the AR throughput check that flags a slow or throttled GPU.

The check: each rank's AR throughput is POOLED tok/s over its own prompts (turn 0 of the measured rounds, the
summary's scope), the AR step is its inverse; a rank more than FLAG_FRACTION from the median of the ranks is
flagged. Ranks decode different prompts, so prompt lengths contribute a little to the spread; with two ranks the
median is their midpoint and a rank is flagged when the two differ by more than twice FLAG_FRACTION.
"""
from __future__ import annotations

import os
import socket
import time

import numpy as np

from harness.protocol import metrics

FLAG_FRACTION = 0.05
SMI_FIELDS = ("uuid", "name", "driver_version", "pstate", "clocks.sm", "clocks.mem", "clocks.max.sm",
              "clocks.max.mem", "power.draw", "power.limit", "temperature.gpu")
UNITS = {"clocks.sm": "MHz", "clocks.mem": "MHz", "clocks.max.sm": "MHz", "clocks.max.mem": "MHz",
         "power.draw": "W", "power.limit": "W", "temperature.gpu": "C"}


def parse_smi(text: str | None, uuid: str) -> dict | None:
    """The nvidia-smi CSV row (fields SMI_FIELDS, noheader, nounits) of the GPU whose UUID is `uuid` (torch
    prints it without nvidia-smi's "GPU-" prefix). Numbers become floats; "[N/A]" and the like become None."""
    for line in (text or "").splitlines():
        values = [v.strip() for v in line.split(",")]
        if len(values) != len(SMI_FIELDS) or values[0].removeprefix("GPU-") != uuid.removeprefix("GPU-"):
            continue
        row = {}
        for key, value in zip(SMI_FIELDS, values):
            if key in UNITS:
                try:
                    row[f"{key} [{UNITS[key]}]"] = float(value)
                except ValueError:
                    row[f"{key} [{UNITS[key]}]"] = None
            else:
                row[key] = value
        return row
    return None


def gpu_state(device) -> dict | None:
    """Name, UUID, memory and SMs from torch; driver, clocks, power and temperature from nvidia-smi (matched by
    UUID, so CUDA_VISIBLE_DEVICES cannot mix GPUs up). None off CUDA."""
    if device.type != "cuda":
        return None
    import torch
    from harness.protocol.results_io import _cmd
    index = device.index if device.index is not None else torch.cuda.current_device()
    p = torch.cuda.get_device_properties(index)
    uuid = str(getattr(p, "uuid", ""))
    smi = _cmd(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"])
    return {"index": index, "name": p.name, "uuid": uuid, "memory_bytes": p.total_memory,
            "sm_count": p.multi_processor_count, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "smi": parse_smi(smi, uuid) if uuid else None}


def before_rounds(shard, device) -> None:
    """Called after warmup, right before the first timed generation (nothing here runs inside a timer)."""
    if shard.launched:
        shard.info.update(rank=shard.rank, local_rank=shard.local_rank, hostname=socket.gethostname(),
                          device=str(device), gpu_before=gpu_state(device))
        shard.info["_t0"] = time.perf_counter()


def after_rounds(shard, device, prompts: int) -> None:
    if shard.launched:
        shard.info["loop_s"] = time.perf_counter() - shard.info.pop("_t0")
        shard.info["prompts"] = prompts
        shard.info["gpu_after"] = gpu_state(device)


def environment(env: dict, shard) -> dict:
    """env.json of a distributed run: rank 0's environment plus every rank's entry (after Shard.merge)."""
    return {**env, **shard.info} if shard.launched else env


def annotate(summary: dict, rows: list[dict], shard) -> dict:
    if shard.launched:
        summary["ranks"] = rank_summary(rows, shard.info["ranks"])
    return summary


def rank_summary(rows: list[dict], ranks: list[dict]) -> dict:
    """summary["ranks"]: per rank its prompts, AR POOLED tok/s and step ms, deviation from the median, flag."""
    ar = next((r["arm"] for r in rows if r["method"] == "ar" and r["arm"] == "AR"), None) or \
        next((r["arm"] for r in rows if r["method"] == "ar"), None)
    out = []
    for info in ranks:
        mine = [r for r in rows if r.get("rank") == info.get("rank") and r["arm"] == ar and not r["warmup"]
                and r["turn"] == 0]
        tok_s = metrics.pooled_tok_per_s([r["decode_tokens"] for r in mine], [r["decode_s"] for r in mine]) \
            if mine else float("nan")
        gpu = info.get("gpu_before") or {}
        out.append({"rank": info.get("rank"), "hostname": info.get("hostname"), "device": info.get("device"),
                    "gpu": gpu.get("name"), "prompts": info.get("prompts"), "loop_s": info.get("loop_s"),
                    "ar_tok_s": tok_s, "ar_step_ms": 1000.0 / tok_s if tok_s > 0 else float("nan")})
    finite = [r["ar_tok_s"] for r in out if np.isfinite(r["ar_tok_s"])]
    median = float(np.median(finite)) if finite else float("nan")
    for r in out:
        r["deviation"] = r["ar_tok_s"] / median - 1 if finite and np.isfinite(r["ar_tok_s"]) else float("nan")
        r["flagged"] = bool(np.isfinite(r["deviation"]) and abs(r["deviation"]) > FLAG_FRACTION)
    return {"ar_arm": ar, "median_ar_tok_s": median, "threshold": FLAG_FRACTION,
            "flagged": [r["rank"] for r in out if r["flagged"]], "ranks": out,
            "convention": f"per rank: AR POOLED tok/s over its own prompts (turn 0, measured rounds) and the AR "
                          f"step (its inverse); flagged when more than {FLAG_FRACTION:.0%} from the median of the "
                          "ranks (a slow or throttled GPU; the ranks' prompts differ, which adds a little spread)"}


def _num(x, fmt: str) -> str:
    return "-" if x is None or not np.isfinite(x) else format(x, fmt)


def format_ranks(summary: dict, markdown: bool = False) -> str:
    """The rank section under a distributed run's table ("" for a single-process run)."""
    s = summary.get("ranks")
    if not s:
        return ""
    head = ["rank", "host", "device", "GPU", "prompts", "AR tok/s", "AR step ms", "vs median", "loop s", "flag"]
    body = [[str(r["rank"]), str(r["hostname"]), str(r["device"]), str(r["gpu"] or "-"), str(r["prompts"]),
             _num(r["ar_tok_s"], ".1f"), _num(r["ar_step_ms"], ".3f"), _num(100 * r["deviation"], "+.1f") + "%",
             _num(r["loop_s"], ".1f"), ("SLOW" if r["deviation"] < 0 else "FAST") if r["flagged"] else "ok"] for r in s["ranks"]]
    verdict = (f"rank(s) {s['flagged']} more than {s['threshold']:.0%} from the median AR throughput "
               f"({_num(s['median_ar_tok_s'], '.1f')} tok/s): check their clocks in env.json"
               if s["flagged"] else f"no rank more than {s['threshold']:.0%} from the median AR throughput")
    if s["ar_arm"] is None:
        verdict = "no AR arm in this run: no per-rank throughput check"
    if markdown:
        lines = ["", f"**Ranks ({len(s['ranks'])} processes)**", "", "| " + " | ".join(head) + " |",
                 "|" + "---|" * len(head), *["| " + " | ".join(b) + " |" for b in body], "",
                 f"- {verdict}", f"- {s['convention']}"]
    else:
        widths = [max(len(x[i]) for x in [head] + body) + 2 for i in range(len(head))]
        lines = ["", f"RANKS ({len(s['ranks'])} processes)",
                 *["".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in [head] + body], verdict,
                 s["convention"]]
    return "\n".join(lines) + "\n"
