"""The step breakdown of a sweep: why an arm pays or stops paying at a (B, context) point.

A batch of B requests runs until its longest request ends (finished rows are masked), so its step count is the
largest of its rows' steps (speculative + plain; tail and extra steps are among those), and every step costs the
same for every row. A refilled batch (--refill: rows marked `refill`) is one queue of requests over B rows; its
step count is the batch's own (`batch_steps`), and its slots are its B rows at every step. Per (point, arm), over
the measured rounds:
- `steps`: the batches' steps, summed; `ms_per_step`: the batches' decode seconds / steps;
- `tokens_per_step`: decode tokens of the whole batch per step (B x tau at best; less when the batch's rows end
  at different steps, since a masked row emits nothing);
- `step_cost`: ms_per_step / AR's at the same point (the arm's break-even: it beats AR when its tokens_per_step
  exceed step_cost x AR's); `token_gain`: tokens_per_step / AR's. The speedup of pooled tok/s is token_gain /
  step_cost (the sweep's own speedup is the median of per-round ratios, so the two agree closely, not exactly).
- `slot_use`: the share of the batches' row-steps that held an unfinished request (each request's steps over the
  batch's steps, pooled); the rest ran masked rows. Requests only: Spyre's padding row (3 requests run as 4
  rows) is not a slot here, as it is in no other number of the sweep. `refill_gain`: token_gain if every slot
  had always held a request at the rate its rows kept (tokens_per_step / slot_use, over AR's the same): an upper
  bound on what refilling freed slots with new prompts could buy, leaving out the refills' prefills and any change
  of step cost.
  refill_gain / step_cost bounds such a batch's speedup.
- `prefill_share`: the batches' prefill seconds (`batch_prefill_s`: a batch's wall time outside its decode clock
  and its graph captures, that is its prompts' prefills before the first step, a refilled batch's refills, each
  stalling every row, and the batch's own setup) over their decode + prefill seconds; `with_prefill`: decode
  tokens over decode + prefill seconds, against AR's the same: the speedup with the prefills counted, which every
  other number of the sweep leaves out.

The sweep writes steps.md beside sweep.md (harness.protocol.sweep); for a folder written before that:

    python -m harness.protocol.sweep_steps results/sweeps/NAME [...]    # (re)writes each folder's steps.md
"""
from __future__ import annotations

import json
import os
import sys

from core.errors import Parser
from harness.protocol.results_io import atomic_write, read_folder_rows, rows_file


def _steps(row: dict) -> int:
    """A row's verify steps: every step is speculative or plain (its tail and extra steps are among them)."""
    return row["spec_steps"] + row["ar_steps"]


def step_stats(rows: list[dict]) -> dict:
    """One (point, arm)'s measured rows -> steps, ms_per_step, tokens_per_step (None where nothing was timed)."""
    batches: dict = {}
    for r in rows:
        b = batches.setdefault((r["round"], r["batch_index"]), {"steps": 0, "secs": 0.0, "tokens": 0, "row_steps": 0,
                                                               "slots": 0, "prefill": r.get("batch_prefill_s")})
        # a refilled batch's own step count and its rows; a static batch's longest row and its requests
        b["steps"] = r["batch_steps"] if r.get("refill") else max(b["steps"], _steps(r))
        b["slots"] = r["batch_rows"] if r.get("refill") else b["slots"] + 1
        b["secs"], b["tokens"], b["row_steps"] = r["batch_decode_s"], b["tokens"] + r["decode_tokens"], \
            b["row_steps"] + _steps(r)
    total = {k: sum(b[k] for b in batches.values()) for k in ("steps", "secs", "tokens", "row_steps")}
    steps = total["steps"]
    if not steps:
        return {"steps": 0, "ms_per_step": None, "tokens_per_step": None, "slot_use": None}
    slots = sum(b["steps"] * b["slots"] for b in batches.values())
    out = {"steps": steps, "ms_per_step": round(1e3 * total["secs"] / steps, 4),
           "tokens_per_step": round(total["tokens"] / steps, 3), "slot_use": round(total["row_steps"] / slots, 4)}
    if all(b["prefill"] is not None for b in batches.values()):  # rows of sweeps before batch_prefill_s: none
        prefill = sum(b["prefill"] for b in batches.values())
        out.update(prefill_share=round(prefill / (prefill + total["secs"]), 4),
                   tok_s_with_prefill=total["tokens"] / (prefill + total["secs"]))
    return out


def breakdown(rows: list[dict], arms: list[str], reference: str | None) -> list[dict]:
    """Per measured (B, context) point and arm: step_stats, and step_cost / token_gain against `reference`."""
    measured = [r for r in rows if not r["warmup"]]
    points = sorted({(r["context_len"], r["batch_size"]) for r in measured})
    out = []
    for c, b in points:
        here = [r for r in measured if r["context_len"] == c and r["batch_size"] == b]
        stats = {a: step_stats([r for r in here if r["arm"] == a]) for a in arms}
        ref = stats.get(reference) if reference else None
        for a in arms:
            s = stats[a]
            if ref and ref["ms_per_step"] and s["ms_per_step"] and a != reference:
                s["step_cost"] = round(s["ms_per_step"] / ref["ms_per_step"], 3)
                s["token_gain"] = round(s["tokens_per_step"] / ref["tokens_per_step"], 3)
                s["refill_gain"] = round(s["tokens_per_step"] / s["slot_use"]
                                         / (ref["tokens_per_step"] / ref["slot_use"]), 3)
                s["gain_per_cost"] = round(s["token_gain"] / s["step_cost"], 3)
                s["refill_per_cost"] = round(s["refill_gain"] / s["step_cost"], 3)
                if "tok_s_with_prefill" in s and "tok_s_with_prefill" in ref:
                    s["with_prefill"] = round(s["tok_s_with_prefill"] / ref["tok_s_with_prefill"], 3)
            out.append({"batch_size": b, "context_len": c, "arm": a,
                        **{k: v for k, v in s.items() if k != "tok_s_with_prefill"}})
    return out


def format_steps(entries: list[dict], labels=()) -> str:
    head = f"**STEPS** [{'; '.join(labels)}]\n\n" if labels else "**STEPS**\n\n"
    lines = ["| B | context | method | steps | ms/step | tokens/step (batch) | step cost vs AR | token gain vs AR |"
             " gain / cost | slot use | refill gain | refill gain / cost | prefill share | with prefills vs AR |",
             "|" + "---|" * 14]
    dash = lambda v: "-" if v is None else v  # noqa: E731
    for e in entries:
        ratio, bound = (f"{e[k]:.3f}" if k in e else "-" for k in ("gain_per_cost", "refill_per_cost"))
        lines.append(f"| {e['batch_size']} | {e['context_len']} | {e['arm']} | {e['steps']} | "
                     f"{dash(e['ms_per_step'])} | {dash(e['tokens_per_step'])} | {dash(e.get('step_cost'))} | "
                     f"{dash(e.get('token_gain'))} | {ratio} | {dash(e.get('slot_use'))} | "
                     f"{dash(e.get('refill_gain'))} | {bound} | {dash(e.get('prefill_share'))} | "
                     f"{dash(e.get('with_prefill'))} |")
    return head + "\n".join(lines) + "\n\n" + __doc__.split("\n\n")[1].strip() + "\n"


def write(folder: str, rows: list[dict], arms: list[str], reference: str | None, labels=()) -> str:
    path = os.path.join(folder, "steps.md")
    atomic_write(path, format_steps(breakdown(rows, arms, reference), labels))
    return path


def main(argv=None) -> int:
    ap = Parser(prog="python -m harness.protocol.sweep_steps",
                description="(Re)write a sweep folder's steps.md from its samples.jsonl.gz.")
    ap.add_argument("folders", nargs="+", help="sweep folders (each with sweep.json and samples.jsonl.gz, or an "
                                               "older folder's plain samples.jsonl)")
    args = ap.parse_args(argv)
    for folder in args.folders:
        if not (os.path.isfile(os.path.join(folder, "sweep.json")) and rows_file(folder) is not None):
            print(f"error: {folder} is not a sweep folder (it needs sweep.json and samples.jsonl.gz, or a plain "
                  "samples.jsonl); pass the folder a sweep wrote", file=sys.stderr)
            return 2
    for folder in args.folders:
        with open(os.path.join(folder, "sweep.json")) as f:
            summary = json.load(f)
        print(write(folder, read_folder_rows(folder), summary["arms"],
                    summary.get("reference"), summary.get("labels", ())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
