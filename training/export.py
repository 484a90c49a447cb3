"""Stage 5, export: the trained checkpoints in the speculators layout the harness loads as they are, in bf16,
sharded into files under `export.max_shard_mib` (with model.safetensors.index.json when there is more than one),
and each refiner also as the co-training .pt the reference harness reads (scripts.convert_refiner.cotrain_dict).

Each model folder also holds train_state.json (the global step it was trained to, the planned steps, whether the
time box cut it short): what `train.warm_start` continues from (training/warm.py). The export's time per model is
added to that model's train/<model>/box.json.

A head trained on a frozen drafter (`freeze_backbone`) ships its head tensors only: its backbone is bit-identical
to the drafter it was initialised from, which ships once; the harness then runs every arm on that drafter.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from core.errors import UsageError
from training.config import RANK_KEY, init_export
from training.cotrain import HEAD_PREFIXES  # a head model's own tensors: what a frozen-backbone head ships
from training.store import staged, write_json
from training.train import final_dir, model_dir

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def out_dir(cfg: dict) -> Path:
    return Path(cfg["workdir"]) / "export"


def shipped_tensors(cfg: dict, name: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file
    src = final_dir(cfg, name)
    if src is None:
        raise UsageError(f"export: model {name!r} has not finished training (run the train stage)")
    spec = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    if cfg["models"][name]["freeze_backbone"]:
        tensors = {k: v for k, v in tensors.items() if k.startswith(HEAD_PREFIXES)}
    dtype = DTYPES[cfg["export"]["dtype"]]
    return spec, {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}


def largest_tensors(cfg: dict, name: str, tcfg) -> list[tuple[str, int, str | None]]:
    """The tensors of model NAME whose size its config sets, as (what, elements, the rank key that sets it or None),
    from the config and the target's (no model built): a head's vocabulary-wide ones (xPress's token embedding and
    readout, the Markov head's w1 and w2: vocab x rank) and, when its drafter trains (a drafter, or a head co-trained
    with its drafter), the draft layers' MLP weights and the fc over the tapped layers. The embedding and lm_head are
    the target's, not exported."""
    m = cfg["models"][name]
    vocab, hidden = tcfg.vocab_size, tcfg.hidden_size
    out = []
    key = RANK_KEY.get(m["type"])
    if key:
        head = "the xPress head's token embedding and readout" if key == "xpress_rank" else "the Markov head's w1 and w2"
        out.append((f"{head} (vocab {vocab} x {key} {m[key]})", vocab * m[key], key))
    if m["type"] == "dflash" or not m["freeze_backbone"]:
        inter = m["intermediate_size"] or tcfg.intermediate_size
        taps = len(cfg["hidden"]["layer_ids"])
        out += [(f"a draft layer's MLP weight ({inter} x {hidden})", inter * hidden, None),
                (f"the fc over {taps} tapped layers ({hidden} x {taps * hidden})", hidden * taps * hidden, None)]
    return out


def check_fit(cfg: dict, name: str, tcfg) -> None:
    """Export writes whole tensors, each file under export.max_shard_mib: a tensor above it failed only at the
    export stage, after the data stages and the whole time box (a rank-256 xPress head over SmolLM2's 49,152-token
    vocabulary is 24 MiB a tensor in bf16). Refused before any stage writes, with the largest rank that fits."""
    ec = cfg["export"]
    limit, size = ec["max_shard_mib"] * 2**20, DTYPES[ec["dtype"]].itemsize
    for what, n, key in largest_tensors(cfg, name, tcfg):
        if n * size > limit:
            hint = f"lower {key} to at most {int(limit // (tcfg.vocab_size * size))}, or " if key else ""
            raise UsageError(f"config models.{name}: {what} is {n * size / 2**20:.1f} MiB in {ec['dtype']}, over "
                             f"export.max_shard_mib {ec['max_shard_mib']:g}, and export writes whole tensors; "
                             f"{hint}raise export.max_shard_mib (the shipped weights keep every file under 16 MiB)")


def shards(tensors: dict, limit_bytes: int) -> list[list[str]]:
    groups, size = [[]], 0
    for k in sorted(tensors):
        n = tensors[k].numel() * tensors[k].element_size()
        if n > limit_bytes:
            raise UsageError(f"export: tensor {k} alone is {n / 2**20:.1f} MiB, over export.max_shard_mib "
                             f"({limit_bytes / 2**20:g}); raise it, e.g. --set export.max_shard_mib="
                             f"{math.ceil(n / 2**20)} (the stages before export are kept)")
        if size + n > limit_bytes and groups[-1]:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += n
    return groups


def write_dir(d: Path, config: dict, tensors: dict, limit_bytes: int) -> None:
    from core.checkpoints import save_tensors
    groups = shards(tensors, limit_bytes)
    d.mkdir(parents=True, exist_ok=True)
    write_json(d / "config.json", config)
    if len(groups) == 1:
        save_tensors(tensors, d / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, keys in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_tensors({k: tensors[k] for k in keys}, d / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_json(d / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def cotrain_pt(d: Path, drafter_dir: Path | None, out: Path) -> None:
    """The reference harness's co-training checkpoint of one exported refiner directory."""
    from core.checkpoints import read_tensors, shard_files
    from scripts.convert_refiner import cotrain_dict
    from refiners.formats import load_refiner_checkpoint
    ck = load_refiner_checkpoint(d, None)
    if ck.draft_state is None and drafter_dir is not None:
        ck.draft_state = read_tensors(shard_files(drafter_dir, "drafter"))
    content = cotrain_dict(ck)  # a gated/rnn Markov head: its variant and gate/cell tensors included
    torch.save(content, out)


def train_state(cfg: dict, name: str) -> dict:
    m = json.loads((model_dir(cfg, name) / "manifest.json").read_text())
    return {"global_step": m["global_step"], "planned_steps": m["planned_steps"], "truncated": m["truncated"],
            "key": m["key"], "data_start": m.get("data_start", 0), "schedule_start": m.get("schedule_start", 0)}


def run(cfg: dict, num_target_layers: int) -> Path:
    from training.box import FILE, add_export
    from training.warm import STATE
    ec = cfg["export"]
    limit = int(ec["max_shard_mib"] * 2**20)
    seconds = dict.fromkeys(cfg["models"], 0.0)
    planned = {}
    for n in cfg["models"]:
        t = time.perf_counter()
        planned[n] = shipped_tensors(cfg, n)
        seconds[n] += time.perf_counter() - t
    total = sum(t.numel() * t.element_size() for _, ts in planned.values() for t in ts.values())
    if ec["max_total_mb"] and total > ec["max_total_mb"] * 1e6:
        sizes = ", ".join(f"{n} {sum(t.numel() * t.element_size() for t in ts.values()) / 1e6:.1f} MB"
                          for n, (_, ts) in planned.items())
        raise UsageError(f"export: {total / 1e6:.1f} MB in all ({sizes}) exceeds export.max_total_mb="
                         f"{ec['max_total_mb']}; shrink the models (num_layers, ranks) or raise the budget")
    out = out_dir(cfg)
    with staged(out) as tmp:
        files = {}
        for n, (spec, tensors) in planned.items():
            t = time.perf_counter()
            spec = {**spec, "num_target_layers": num_target_layers, "dtype": ec["dtype"]}
            write_dir(tmp / n, spec, tensors, limit)
            write_json(tmp / n / STATE, train_state(cfg, n))
            files[n] = {f.name: f.stat().st_size for f in sorted((tmp / n).iterdir())}
            seconds[n] += time.perf_counter() - t
        (tmp / "pt").mkdir()
        for n, m in cfg["models"].items():
            if m["type"] != "dflash":
                t = time.perf_counter()
                src = (init_export(cfg, n) or tmp / m["init_from"]) if m["freeze_backbone"] else None
                cotrain_pt(tmp / n, src, tmp / "pt" / f"{n}_refiner_cotrain.pt")
                seconds[n] += time.perf_counter() - t
        write_json(tmp / "manifest.json", {"models": {n: cfg["models"][n] for n in cfg["models"]}, "files": files,
                                           "total_bytes": total, "dtype": ec["dtype"]})
    print(f"export: {total / 1e6:.1f} MB in {sum(len(f) for f in files.values())} files -> {out}")
    for n in cfg["models"]:
        add_export(model_dir(cfg, n) / FILE, seconds[n], n)
    return out
