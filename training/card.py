"""Training records for a model card: each model's loss curve and a summary table, from speculators' metrics.

    python -m training.card --train runs/smollm2-gpu/train --out results/smollm2-135m/training

Reads <train>/<model>/metrics.jsonl (or .jsonl.gz) and manifest.json for every model folder; writes OUT/loss_curves.png
(train loss per step, a 25-step running mean over the raw points, and the validation loss after each epoch),
OUT/summary.json and OUT/<model>.metrics.jsonl.gz (the records, compressed) unless OUT is where they came from.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from core.errors import UsageError, cli_exit

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
    return {"model": name, "steps": len(c["train"]), "planned_steps": manifest.get("planned_steps"),
            "truncated": manifest.get("truncated", False), "first_loss": c["train"][0][1] if c["train"] else None,
            "last_loss_mean25": running_mean([y for _, y in c["train"]], WINDOW)[-1] if c["train"] else None,
            "val_loss_per_epoch": [round(v, 4) for _, v in c["val"]],
            "first_step_s": round(c["step_ms"][0] / 1000, 1) if c["step_ms"] else None,
            "median_step_ms": round(steady[len(steady) // 2], 1),
            "train_s_excluding_first_step": round(sum(c["step_ms"][1:]) / 1000, 1),
            "held_out": (manifest.get("evals") or [{}])[-1]}


def plot(named: dict, out: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(named), figsize=(4.2 * len(named), 3.4), squeeze=False)
    for ax, (name, c) in zip(axes[0], named.items()):
        xs, ys = [x for x, _ in c["train"]], [y for _, y in c["train"]]
        ax.plot(xs, ys, color="0.8", lw=0.6, label="train (per step)")
        ax.plot(xs, running_mean(ys, WINDOW), color="C0", lw=1.4, label=f"train ({WINDOW}-step mean)")
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


def build(train_dir: Path, out: Path) -> dict:
    models = sorted(d for d in train_dir.iterdir() if d.is_dir() and (d / "manifest.json").is_file())
    if not models:
        raise UsageError(f"card: no model folders with a manifest.json under {train_dir}")
    named, summary = {}, []
    out.mkdir(parents=True, exist_ok=True)
    for d in models:
        rows = read_rows(d)
        named[d.name] = curves(rows)
        summary.append(summarise(d.name, named[d.name], json.loads((d / "manifest.json").read_text())))
        if out.resolve() != train_dir.resolve():
            (out / f"{d.name}.metrics.jsonl.gz").write_bytes(
                gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode(), mtime=0))
            (out / f"{d.name}.manifest.json").write_text((d / "manifest.json").read_text())
    plot(named, out / "loss_curves.png", f"{train_dir.resolve().parent.name}: speculators training losses")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return {"models": summary}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.card", description=__doc__.split("\n\n")[0])
    p.add_argument("--train", required=True, help="the train stage's folder (one sub-folder per model)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    return cli_exit(lambda: build(Path(args.train), Path(args.out)))


if __name__ == "__main__":
    sys.exit(main())
