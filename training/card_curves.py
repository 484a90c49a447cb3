"""Per-model training records for a model card (training/card.py, training/card_lineage.py): speculators' metrics
rows, their loss curves, a model's summary and the loss-curve plot."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from core.errors import UsageError

WINDOW = 25


def read_rows(d: Path) -> list[dict]:
    plain, packed = d / "metrics.jsonl", d / "metrics.jsonl.gz"
    if plain.is_file():
        text = plain.read_text()
    elif packed.is_file():
        text = gzip.decompress(packed.read_bytes()).decode()
    else:
        raise UsageError(f"card: {d} has no metrics.jsonl(.gz)")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def curves(rows: list[dict]) -> dict:
    """(step, loss) of every train row; (step, loss) of every validation row, at the last step trained before it."""
    train, val, step = [], [], 0
    for r in rows:
        if "train" in r:
            step = r["global_step"]
            train.append((step, r["train"]["loss"]))
        elif "val" in r and "loss_epoch" in r["val"]:
            val.append((step, r["val"]["loss_epoch"]))
    step_ms = [r["profile"]["step_ms"] for r in rows if "train" in r and "profile" in r]
    return {"train": train, "val": val, "step_ms": step_ms}


def running_mean(ys: list[float], n: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y - (ys[i - n] if i >= n else 0.0)
        out.append(acc / min(i + 1, n))
    return out


def summarise(name: str, c: dict, manifest: dict) -> dict:
    steady = sorted(c["step_ms"][1:]) or [0.0]
    # the step reached: the manifest's global_step (the metrics may log every Nth step only; a warm-started run's
    # steps continue the schedule it resumed, so box.json's steps/first_step say how many this run made)
    return {"model": name, "steps": manifest.get("global_step", len(c["train"])), "logged_steps": len(c["train"]),
            "planned_steps": manifest.get("planned_steps"),
            "truncated": manifest.get("truncated", False), "first_loss": c["train"][0][1] if c["train"] else None,
            "last_loss_mean25": running_mean([y for _, y in c["train"]], WINDOW)[-1] if c["train"] else None,
            "val_loss_per_epoch": [round(v, 4) for _, v in c["val"]],
            "first_step_s": round(c["step_ms"][0] / 1000, 1) if c["step_ms"] else None,
            "median_step_ms": round(steady[len(steady) // 2], 1),
            "train_s_excluding_first_step": round(sum(c["step_ms"][1:]) / 1000, 1)
            if len(c["step_ms"]) == manifest.get("global_step", len(c["step_ms"])) else None,  # every step logged
            "last_training_eval": (manifest.get("evals") or [{}])[-1]}


def read_models(train_dir: Path) -> list[tuple[Path, list[dict], dict, dict]]:
    """Each model folder under a train stage's folder (those with a manifest.json), sorted by name: (folder, its
    logged rows, their curves, its summary). Raises UsageError when there is none."""
    models = sorted(d for d in train_dir.iterdir() if d.is_dir() and (d / "manifest.json").is_file())
    if not models:
        raise UsageError(f"card: no model folders with a manifest.json under {train_dir}")
    out = []
    for d in models:
        rows = read_rows(d)
        c = curves(rows)
        out.append((d, rows, c, summarise(d.name, c, json.loads((d / "manifest.json").read_text()))))
    return out


def plot(named: dict, out: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(named), figsize=(4.2 * len(named), 3.4), squeeze=False)
    for ax, (name, c) in zip(axes[0], named.items()):
        xs, ys = [x for x, _ in c["train"]], [y for _, y in c["train"]]
        ax.plot(xs, ys, color="0.8", lw=0.6, label="train (per step)")
        ax.plot(xs, running_mean(ys, WINDOW), color="C0", lw=1.4, label=f"train (mean of {WINDOW} logged steps)")
        if c["val"]:
            ax.plot([x for x, _ in c["val"]], [v for _, v in c["val"]], "o-", color="C3",
                    label="validation (per epoch)")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
