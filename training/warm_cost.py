"""What a warm restart costs, measured on the toy target (training/toy.py) on the CPU: one drafter schedule run four
ways, per seed, and each one's held-out tau (the pipeline's own acceptance stage: train/drafter/acceptance.json):

* full: the whole schedule in one run;
* resumed: stopped half-way with a checkpoint (train.stop_after_step) and resumed from it: the optimizer state and
  the fp32 weights kept (what a session that keeps its machine does);
* warm: cut half-way (train.cut_at_step), exported in bf16, and continued by a new run from that export
  (train.warm_start): a fresh AdamW, bf16-rounded weights (what a session on a new machine does);
* half: the cut model itself, for scale.

Besides tau: the mean training loss over the first `--window` steps after the half-way point, warm and resumed
against full (the fresh optimizer's first, bias-corrected updates are sign-like steps of the full learning rate).

    python -m training.warm_cost --seeds 0,1,2 --out results/perf/warm_restart_toy.json

The toy is a repetitive synthetic language on a 1-layer drafter: a check of the mechanism, not SmolLM2's number.
"""
from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from core.errors import Parser, UsageError, cli_exit


def _cli(*args) -> None:
    from training.__main__ import main
    if main([str(a) for a in args]) != 0:
        raise RuntimeError(f"python -m training {' '.join(map(str, args))} failed")


def _tau(work: Path) -> float:
    return json.loads((work / "train" / "drafter" / "acceptance.json").read_text())["heldout"]["tau_drafter"]


def _losses(work: Path) -> dict[int, float]:
    rows = (work / "train" / "drafter" / "metrics.jsonl").read_text().splitlines()
    out = {}
    for r in map(json.loads, rows):
        if "train" in r:
            loss = r["train"].get("loss") if isinstance(r["train"], dict) else None
            if loss is not None:
                out[r["global_step"]] = float(loss)
    return out


def one_seed(root: Path, seed: int, epochs: int, window: int) -> dict:
    from training.toy import build
    build(root, seed=seed)
    sets = [f"seed={seed}", f"target={root / 'target'}", f"prompts.eval_dir={root / 'eval'}",
            "prompts.jsonl=" + json.dumps([str(root / "prompts.jsonl")]), f"train.epochs={epochs}"]
    toy = json.loads((Path(__file__).parent / "configs" / "toy.json").read_text())
    toy["models"] = {"drafter": toy["models"]["drafter"]}  # the drafter's schedule alone (no heads to export)
    (root / "toy-drafter.json").write_text(json.dumps(toy))
    base = ["--config", root / "toy-drafter.json", *[a for s in sets for a in ("--set", s)]]
    _cli("all", "--workdir", root / "full", *base)
    m = json.loads((root / "full" / "train" / "drafter" / "manifest.json").read_text())
    n = int(m["planned_steps"])
    half = n // 2
    _cli("all", "--workdir", root / "cut", *base, "--set", f"train.cut_at_step={half}")
    for stage in ("prompts", "responses", "hidden"):
        shutil.copytree(root / "cut" / stage, root / "warm" / stage)
    _cli("all", "--workdir", root / "warm", *base, "--set", f"train.warm_start={root / 'cut' / 'export'}")
    from training.__main__ import main
    main(["all", "--workdir", str(root / "resumed"), *map(str, base), "--set", f"train.stop_after_step={half}"])
    _cli("all", "--workdir", root / "resumed", *base)
    full, warm, resumed = (_losses(root / w) for w in ("full", "warm", "resumed"))
    steps = [g for g in range(half, min(n, half + window)) if g in full and g in warm and g in resumed]

    def mean(d):
        return statistics.fmean(d[g] for g in steps) if steps else None
    return {"seed": seed, "steps": n, "cut_at": half,
            "tau": {w: _tau(root / w) for w in ("full", "resumed", "warm")} | {"half": _tau(root / "cut")},
            "loss_after_cut": {"steps": [steps[0], steps[-1]] if steps else None, "full": mean(full),
                               "resumed": mean(resumed), "warm": mean(warm)}}


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m training.warm_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2", help="comma-separated toy seeds (each builds and trains its own toy)")
    p.add_argument("--epochs", type=int, default=4, help="the drafter's epochs (the toy preset's 4)")
    p.add_argument("--window", type=int, default=10, help="steps after the cut whose training loss is averaged")
    p.add_argument("--out", default=None, help="write the JSON here (default: print it)")
    args = p.parse_args(argv)

    def work():
        try:
            seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        except ValueError:
            raise UsageError(f"--seeds {args.seeds!r}: give comma-separated integers, e.g. 0,1,2") from None
        if not seeds or args.epochs < 1 or args.window < 1:
            raise UsageError("--seeds needs at least one seed, --epochs and --window at least 1")
        rows = []
        for seed in seeds:
            with tempfile.TemporaryDirectory() as tmp:
                rows.append(one_seed(Path(tmp), seed, args.epochs, args.window))
        diffs = {w: [r["tau"][w] - r["tau"]["full"] for r in rows] for w in ("resumed", "warm", "half")}
        out = {"what": "held-out tau of the toy drafter (training/toy.py, CPU fp32): the whole schedule, resumed from "
                       "a checkpoint half-way, warm-restarted from a bf16 export half-way, and the half-way model",
               "seeds": rows, "mean_tau_minus_full": {w: statistics.fmean(v) for w, v in diffs.items()}}
        text = json.dumps(out, indent=1) + "\n"
        if args.out:
            Path(args.out).write_text(text)
        print(text)
    return cli_exit(work)


if __name__ == "__main__":
    sys.exit(main())
