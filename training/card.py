"""Training records for a model card: each model's loss curve and a summary table, from speculators' metrics,
and card.json, every number the card gives, from which the card's Markdown is generated (training/card_md.py).

    python -m training.card --train runs/smollm2-gpu/train --out results/smollm2-135m/training \
        [--ship weights/smollm2-135m] [--markdown weights/smollm2-135m/README.md]
    python -m training.card --from-json results/smollm2-135m/training/card.json --markdown CARD.md
    python -m training.card --lineage NAME=DIR [--lineage NAME=DIR ...] [--tried NAME=DIR ...] --out OUT [--ship S]
        [--markdown MD]
        (one card over runs made in turn: training/card_lineage.py)

Reads <train>/<model>/metrics.jsonl (or .jsonl.gz) and manifest.json for every model folder; writes OUT/loss_curves.png
(train loss per step, a running mean over the last 25 logged points (the metrics may log every Nth step), and the validation loss after each epoch),
OUT/summary.json and OUT/<model>.metrics.jsonl.gz (the records, compressed) unless OUT is where they came from.
OUT/card.json (training/card_data.py) takes the rest from the run's workdir (the folder above --train): the prompt,
response and hidden-state manifests, stages.json, each model's box.json and acceptance.json, and --ship's manifest.
"""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from core.errors import Parser, UsageError, cli_exit

from training.card_curves import WINDOW, curves, plot, read_models, read_rows, running_mean, summarise  # noqa: F401


def build(train_dir: Path, out: Path, ship_dir: Path | None = None, markdown: Path | None = None,
          title: str | None = None) -> dict:
    from training.card_data import card_record, shipped_record, write_card
    shipped_record(ship_dir)  # a bad --ship is refused before any record is written
    summary = records(train_dir, out)
    rec = card_record(train_dir.parent, summary, ship_dir, title)
    write_card(rec, out / "card.json", markdown)
    return {"models": summary, "card": rec}


def records(train_dir: Path, out: Path) -> list[dict]:
    named, summary = {}, []
    models = read_models(train_dir)  # read and checked before anything is written
    out.mkdir(parents=True, exist_ok=True)
    for d, rows, c, summ in models:
        named[d.name] = c
        summary.append(summ)
        if out.resolve() != train_dir.resolve():
            (out / f"{d.name}.metrics.jsonl.gz").write_bytes(
                gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode(), mtime=0))
            (out / f"{d.name}.manifest.json").write_text((d / "manifest.json").read_text())
    plot(named, out / "loss_curves.png", f"{train_dir.resolve().parent.name}: speculators training losses")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv=None) -> int:
    p = Parser(prog="python -m training.card", description=__doc__.split("\n\n")[0])
    p.add_argument("--train", help="the train stage's folder (one sub-folder per model)")
    p.add_argument("--out", help="where the records and card.json go")
    p.add_argument("--ship", default=None, help="the shipped folder (training.ship's --out) or its manifest file: "
                                                "what was shipped")
    p.add_argument("--markdown", default=None, help="write the card's Markdown here, generated from card.json")
    p.add_argument("--title", default=None, help="the card's title (default: the workdir's name)")
    p.add_argument("--from-json", default=None, help="only render this card.json to --markdown")
    p.add_argument("--lineage", action="append", default=None, metavar="NAME=DIR",
                   help="a run of a lineage, in the order they ran (repeat): its workdir or its flat records "
                        "folder; one card over all of them (training/card_lineage.py)")
    p.add_argument("--tried", action="append", default=None, metavar="NAME=DIR",
                   help="with --lineage: a run made on the shipped weights whose models were not shipped (repeat); "
                        "listed after the lineage, outside its count and totals")
    args = p.parse_args(argv)

    def work():
        from training.card_data import render_file
        if args.from_json:
            if not args.markdown:
                raise UsageError("card: --from-json needs --markdown (where the card goes)")
            return render_file(Path(args.from_json), Path(args.markdown))
        if args.tried and (args.from_json or not args.lineage):
            raise UsageError("card: --tried needs --lineage (the runs that made the shipped weights), not --from-json")
        if args.lineage:
            if args.train or not args.out:
                raise UsageError("card: --lineage takes --out (and no --train: each run names its folder)")
            from training.card_lineage import build as build_lineage
            return build_lineage(args.lineage, Path(args.out), Path(args.ship) if args.ship else None,
                                 Path(args.markdown) if args.markdown else None, args.title, args.tried)
        if not (args.train and args.out):
            raise UsageError("card: give --train and --out (or --from-json with --markdown)")
        return build(Path(args.train), Path(args.out), Path(args.ship) if args.ship else None,
                     Path(args.markdown) if args.markdown else None, args.title)
    return cli_exit(work)


if __name__ == "__main__":
    sys.exit(main())
