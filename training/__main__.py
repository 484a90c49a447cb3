"""python -m training <stage> --config NAME [--workdir DIR] [--set key=value ...]

Stages: prompts, responses, hidden, train, export, all (every stage in order; finished stages are skipped, so the
same command resumes an interrupted pipeline). Bad input: one `error:` line, exit status 2, nothing overwritten.
"""
from __future__ import annotations

import argparse
import sys

from core.errors import Parser, cli_exit

STAGES = ("prompts", "responses", "hidden", "train", "export")


def build_parser() -> argparse.ArgumentParser:
    from pathlib import Path
    presets = ", ".join(sorted(f.stem for f in (Path(__file__).resolve().parent / "configs").glob("*.json")))
    p = Parser(prog="python -m training", description=__doc__.split("\n\n")[0],
               epilog="stages, in order: prompts (training prompts, split into train/selection/"
                      "held-out), responses (the target's answers), hidden (the tapped target "
                      "layers, or none when computed online), train, export (what the harness "
                      "loads); all: every stage in order, finished ones skipped. "
                      "training/README.md says what each writes.")
    p.add_argument("stage", choices=STAGES + ("all",))
    p.add_argument("--config", required=True,
                   help=f"a preset name (training/configs/NAME.json: {presets}) or a .json path")
    p.add_argument("--workdir", default=None, help="where every stage writes (default: runs/<config name>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set train.epochs=2 --set models.drafter.num_layers=2")
    p.add_argument("--eval-dir", default=None,
                   help="benchmark prompts (*.jsonl) that training prompts must not overlap (default: "
                        "prompts.eval_dir, data/eval)")
    p.add_argument("--models", default=None, help="train: only these models (comma-separated)")
    p.add_argument("--force", action="store_true", help="redo the stage even when its output is up to date")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def work():
        from harness.protocol.distributed import refuse_launcher
        refuse_launcher("python -m training")  # until speculators' FSDP mode is wired (docs: harness.protocol.distributed)
        from training.config import load_config
        from training.pipeline import Pipeline
        cfg = load_config(args.config, args.overrides, args.workdir)
        only = args.models.split(",") if args.models else None
        unknown = [n for n in only or () if n not in cfg["models"]]
        if unknown:
            from core.errors import UsageError
            raise UsageError(f"--models {','.join(unknown)}: not a model of this config ({', '.join(cfg['models'])})")
        pipe = Pipeline(cfg, eval_dir=args.eval_dir, force=args.force)
        stages = STAGES if args.stage == "all" else (args.stage,)
        pipe.preflight(stages)
        for s in stages:
            pipe.run(s, only=only)
            if pipe.stopped:
                print("training: stopped early with a checkpoint; the same command resumes it")
                break
    return cli_exit(work)


if __name__ == "__main__":
    sys.exit(main())
