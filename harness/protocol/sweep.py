"""--batch-sizes / --context-lengths: the paired protocol at every (batch size B, context length C) point (issue 29).

At each point every arm decodes the same requests, in the same rounds, with the arms rotated as in a single run
(harness.protocol.rounds: the measured rounds form a Latin square when their count is a multiple of the arms').
- Requests: the run's prompts (--max-samples N), first turns only, B at a time, in order; when N is not a multiple
  of B the list is cycled up to the next multiple, so every batch of every arm is full and the same at every arm.
- Context length C > 0: each request's user message is filler + a blank line + its own question, the filler being
  the other prompts' texts, whole, in dataset order after the request's own (cycled), added until the rendered
  prompt has at least C tokens (a C no prompt is below is refused); C = 0: the prompt itself. Lengths reached:
  `prompt_tokens`. Every prompt must leave room for --max-new-tokens and a block below --max-model-len.
- One batch is one batch_loop.generate_batch call (--use-graph: a graph per arm, B, KV bucket, captured before the
  clock; batch_capture_s, not in batch_prefill_s). The target's verify is one forward of B x block rows, and so is
  the dFlash draft (drafters.dflash_batch.DFlashGroup; a sliding-window drafter drafts per request); the refiners
  run batched where they can (refiners.batch). The labels say which ran. --device spyre decodes 3 requests as 4
  rows (its shapes: 1, 2, 4), the fourth a padding row, masked and left out (`padded_requests`). A finished request is masked and keeps its slot until the
  batch's longest request ends; no new prompt takes it (a static batch): every step of every arm runs at the B
  asked for, and each arm pays for its own longest request.
- Timing, per batch: decode_s = from the batch's first step until its last request finished (the prefills, one
  after another before the first step, are timed apart: prefill_s). Total tok/s = decode tokens / decode_s, pooled
  over the point's batches and measured rounds; per-request tok/s = the mean of each request's tokens / decode_s.
- Speedup over AR at the same point: harness.protocol.metrics.median_round_speedup over [rounds, batches]
  matrices (a batch is the paired unit, as a prompt is in a single run), with its paired bootstrap CI over batches
  and rounds. tau per point: accepted tokens per verify step over every request of the measured rounds (T > 0:
  every round is a sampling replicate, the warmup included, as in a single run).
- Crossover: per arm and context, the smallest swept B where its speedup's estimate is < 1 (per B, context).
- T = 0: `same_as_b1` compares each request's tokens with the same arm's B = 1 tokens (point, round): equal in fp32;
  in bf16 the default tiles may differ by batch; --batch-invariant at B x W <= 64 rows is row-invariant.
The folder's README.md (harness.protocol.sweep_readme) says what it ran and what each of its files holds.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np

from core.errors import UsageError
from harness.protocol import ci_text, metrics, replicates, runner, sweep_readme, sweep_steps
from harness.protocol.algorithms import DFlashDrafter, DFlashGroup, batch_refiner
from harness.protocol.build import prepare
from harness.protocol.console import describe, label
from harness.protocol.data import dataset_provenance, load_samples, render_prompt
from harness.protocol.plan import run_folder
from harness.protocol.results_io import LIVE_ROWS, append_rows, atomic_write, environment, read_rows, write_rows
from harness.protocol.rounds import rotation
from harness.protocol.sweep_plots import write_plots
from harness.protocol.sweep_points import (batch_sizes, context_lengths, is_sweep, padded_requests,  # noqa: F401
                                           repeats, request_ids, served_rows)

SWEEP = "sweep.json"


def context_prompts(tokenizer, samples, firsts, context: int) -> list[tuple[int, ...]]:
    """Each sample's first turn with at least `context` tokens (see the module docstring); context 0: as is."""
    if context == 0:
        return [tuple(f) for f in firsts]
    out, n, grew = [], len(samples), False
    for i, s in enumerate(samples):
        others = [samples[(i + j) % n].turns[0] for j in range(1, n)] or [s.turns[0]]
        filler, j = [], 0
        while True:
            prompt = render_prompt(tokenizer, [{"role": "user", "content": "\n\n".join(filler + [s.turns[0]])}])
            if len(prompt) >= context:
                break
            filler.append(others[j % len(others)])
            j, grew = j + 1, True
        out.append(tuple(prompt))
    if not grew:  # the point would decode the prompts as they are, as context 0 does, and plot it as a trend
        raise UsageError(f"--context-lengths {context}: every prompt already has at least {context} tokens (the "
                         f"shortest {min(map(len, firsts))}), so nothing would fill them; drop it or go above that")
    return out


@dataclasses.dataclass
class _Point:
    batch: int
    context: int
    prompts: list[tuple[int, ...]]  # per sample
    ids: list[int]                  # the requests: sample indices


def _drafters(arm, b: int, pool: dict, backend, how: set) -> list | None:
    """b drafters over the arm's drafter weights: a DFlashGroup's members (one draft forward for the batch), or,
    for a drafter the group refuses (sliding-window layers), one drafter per request; `how` collects which ran."""
    if arm.drafter is None:
        return None
    base, key = arm.drafter, (id(arm.drafter), b)
    if key not in pool:
        try:  # capacities: each generation's _Decode sizes its drafters, as for a single request
            pool[key] = DFlashGroup(base, b).members
            how.add("drafts batched")
        except UsageError:
            copies = [base] + [DFlashDrafter(base.model, base.embed, base.lm_head, backend, block_size=base.block_size)
                               for _ in range(b - 1)]
            for d in copies[1:]:
                d.ops = base.ops  # the arm's proposing ops (sized for the drafter's heads in its constructor)
            pool[key] = copies
            how.add("drafts per request")
    return pool[key]


def _batched(refiner, pool: dict):
    """The arm's refiner batched (algorithms.batch_refiner, built once); each Generation says if it ran batched."""
    if refiner is None:
        return None
    key = ("refine", id(refiner))
    pool[key] = pool[key] if key in pool else batch_refiner(refiner)
    return pool[key]


def run(cfg, out=None) -> dict:
    """The whole sweep (the module docstring); returns sweep.json's content."""
    out, batches, contexts, folder = out or sys.stdout, batch_sizes(cfg), context_lengths(cfg), run_folder(cfg)
    plan = prepare(cfg, device=cfg.device, folder=folder)
    need = max(contexts) + cfg.max_new_tokens + plan.block_size + 1
    if need > plan.max_model_len:
        raise UsageError(f"--context-lengths {max(contexts)}: with --max-new-tokens {cfg.max_new_tokens} and block "
                         f"{plan.block_size} a request needs {need} positions, over the context limit "
                         f"{plan.max_model_len}; lower the context or --max-new-tokens")
    samples, points = load_samples(cfg.dataset, cfg.data_dir, cfg.max_samples), []

    def build_points(tokenizer, firsts):  # every point's prompts, checked before the target's weights load
        for c in contexts:
            prompts = context_prompts(tokenizer, samples, firsts, c)
            longest = max(map(len, prompts))
            if longest + cfg.max_new_tokens + plan.block_size + 1 > plan.max_model_len:
                raise UsageError(f"--context-lengths {c}: the longest prompt built for it has {longest} tokens, "
                                 f"which with --max-new-tokens {cfg.max_new_tokens} does not fit the context limit "
                                 f"{plan.max_model_len}; lower the context")
            points.extend(_Point(b, c, prompts, request_ids(len(samples), b)) for b in batches)
    models = runner.load_models(plan, samples, runner.choose_ops(plan), None, rendered=build_points)
    settings = runner.settings_for(cfg, plan.max_model_len, models.stops)
    runner.presize(models.target, models.arms, max(len(p) for pt in points for p in pt.prompts), settings,
                   plan.block_size)
    if plan.spyre is not None:  # fixed-shape compiled graphs (core.spyre), as a single run compiles them
        from core.spyre import compile_for
        compile_for(models.target, [a.drafter for a in models.arms])
    order = rotation(plan.arm_names, plan.rounds)
    describe(plan, models, settings, samples, out)
    print(f"[sweep] batch sizes {batches} x context lengths {contexts}: {len(points)} points, each with "
          f"{plan.rounds} rounds (first {plan.warmup_rounds} excluded) of {len(plan.arm_names)} arms; "
          f"{'CUDA graphs per (arm, B, KV bucket)' if cfg.use_graph else 'eager'}, first turns only", file=out)
    os.makedirs(folder, exist_ok=True)
    config = {**dataclasses.asdict(cfg), "resolved": {
        **plan.resolved(), "stop_ids": list(models.stops), "rotation": order, "sweep": {
            "batch_sizes": batches, "context_lengths": contexts, "graphs": cfg.use_graph, "first_turn_only": True},
        "dataset": dataset_provenance(cfg.dataset, cfg.data_dir), "label": label(cfg),
        "kernels": models.target.kernels}}
    atomic_write(os.path.join(folder, "config.json"), json.dumps(config, indent=2, default=str))
    rows_path = os.path.join(folder, LIVE_ROWS)  # plain while it runs; gzip'd once every point is done
    by_name, pool, how = {a.name: a for a in models.arms}, {}, set()
    try:
        for pt in points:
            for r, names in enumerate(order, start=1):
                for slot, name in enumerate(names, start=1):
                    arm = by_name[name]
                    arm.activate()
                    append_rows(rows_path, _decode_point(plan, models, settings, arm, pt, r, slot, samples, pool,
                                                         how))
            print(f"[sweep] B={pt.batch} context={pt.context}: done", file=out)
    except KeyboardInterrupt:
        print(f"[sweep] interrupted: a sweep cannot be resumed; delete {folder} and run the command again",
              file=sys.stderr)
        raise
    ar, rows = next((a.name for a in models.arms if a.spec.method == "ar"), None), read_rows(rows_path)
    write_rows(folder, rows)  # samples.jsonl.gz (results_io.ROWS); the plain rows go
    summary = summarize(rows, plan.arm_names, plan.warmup_rounds, batches, contexts, reference=ar,
                        labels=[x for x in [sweep_readme.run_line(cfg, plan, len(samples)), label(cfg),
                                            f"{plan.backend.device.type} {str(plan.backend.dtype)[6:]}",
                                            f"kernels {models.target.kernels}", *sorted(how),
                                            *sweep_readme.caveats(plan, settings), *replicates.capped_label(rows)] if x])
    atomic_write(os.path.join(folder, SWEEP), json.dumps(summary, indent=1) + "\n")
    atomic_write(os.path.join(folder, "sweep.md"), format_table(summary))
    sweep_steps.write(folder, rows, plan.arm_names, ar, summary["labels"])
    plots, unplotted = write_plots(folder, summary)  # before the README: the plots written, and why not others
    atomic_write(os.path.join(folder, "README.md"),
                 sweep_readme.readme(summary, [os.path.basename(p) for p in plots], unplotted))
    atomic_write(os.path.join(folder, "env.json"),
                 json.dumps(environment(exclude=[folder]), indent=1, default=str) + "\n")
    for line in [*plots, *unplotted]:  # the plots written, then why any other is not
        print(f"[plot] {line}", file=out)
    print(format_table(summary), f"[results] {folder}", sep="\n", file=out)
    return summary


def _decode_point(plan, models, settings, arm, pt: _Point, round_: int, slot: int, samples, pool,
                  how: set) -> list[dict]:
    """Every batch of one (point, round, arm): one generate_batch each, one row per request."""
    from harness.decode.batch_loop import generate_batch
    cfg, backend = plan.config, plan.backend
    rows = []
    rows_run = served_rows(plan, pt.batch)
    if rows_run != pt.batch:
        how.add(f"{pt.batch} requests padded to {rows_run} (Spyre)")
    if cfg.refill:  # one queue of the point's prompts over B rows (batch_loop: continuous batching)
        how.add("continuous batching: a finished request's row takes the next prompt (refills' prefills outside "
                "decode time, in batch_prefill_s)")
    copies, span = repeats(pt.ids, how), len(pt.ids) if cfg.refill else pt.batch
    for g, k0 in enumerate(range(0, len(pt.ids), span)):  # one queue (refill), or one static batch at a time
        ids = pt.ids[k0:k0 + span]  # each request on its own stream, at T = 0 too (sampled drafts), as in a run
        seeds = [runner.stream_seed(cfg.seed, samples[i].row, 0, round_, c) for i, c in zip(ids, copies[k0:])]
        prompts, limits, seeds_run = padded_requests([list(pt.prompts[i]) for i in ids], seeds, rows_run,
                                                     settings.max_new_tokens)
        r, start = _batched(arm.refiner, pool), backend.now()  # built before the clock
        gens = generate_batch(models.target, prompts, settings, backend,
                              drafters=_drafters(arm, rows_run, pool, backend, how), refiner=arm.refiner,
                              generators=[backend.generator(s) for s in seeds_run], refine_batch=r,
                              max_new_tokens=limits, rows=rows_run if cfg.refill else None)
        wall = backend.now() - start
        gens = gens[:len(ids)]  # the padding rows are not requests
        decode_s = max(x.batch_end_s for x in gens)  # the batch's first step to its last end (refills inside)
        how.add("CUDA graphs per (arm, B, KV bucket)" if any(x.graph_steps for x in gens) else "eager")
        how.update(x.graph_note for x in gens if x.graph_note)
        if arm.refiner is not None:  # what the batch loop did with the batched refiner (refined_batched)
            how.add(("refinements batched" + (f" on {r.inner.ops.name} ops (B>1)" if r.twin else ""))
                    if gens[0].refined_batched else "refinements per request")
        for j, (i, gen) in enumerate(zip(ids, gens)):
            row = runner.sample_row(plan.run_id, cfg, arm, i, samples[i], 0, round_, round_ <= plan.warmup_rounds, gen)
            # batch_row: the request's place in its batch (refills: in the queue); served_row: the row it decoded on
            row.update(batch_size=pt.batch, batch_rows=rows_run, context_len=pt.context, batch_index=g, batch_row=j,
                       served_row=gen.served_row, slot=slot,
                       stream_seed=seeds[j], request_copy=copies[k0 + j], batch_decode_s=decode_s,
                       batch_prefill_s=wall - decode_s - gens[0].setup_capture_s, batch_capture_s=gens[0].setup_capture_s,
                       batch_setup_captures=gens[0].setup_captures, graph_steps=gen.graph_steps,
                       **({"refill": True, "batch_steps": gen.batch_steps} if cfg.refill else {}))
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------- the summary

def _matrix(rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """[rounds, batches] decode tokens and decode seconds of one (point, arm)'s measured rows."""
    rounds = sorted({r["round"] for r in rows})
    groups = sorted({r["batch_index"] for r in rows})
    tok, sec = np.zeros((len(rounds), len(groups))), np.zeros((len(rounds), len(groups)))
    for r in rows:
        i, j = rounds.index(r["round"]), groups.index(r["batch_index"])
        tok[i, j] += r["decode_tokens"]
        sec[i, j] = r["batch_decode_s"]
    return tok, sec


def summarize(rows: list[dict], arms: list[str], warmup: int, batches: list[int], contexts: list[int],
              labels=(), n_boot: int = 2000, reference: str | None = "AR") -> dict:
    """`reference`: the AR arm's name (None or absent from `arms`: no speedups)."""
    ar = reference if reference in arms else None
    points = []
    for c in contexts:
        for b in batches:
            here = [r for r in rows if r["batch_size"] == b and r["context_len"] == c]
            measured = [r for r in here if not r["warmup"]]
            per_arm = {}
            ref = _matrix([r for r in measured if r["arm"] == ar]) if ar is not None else None
            for a in arms:
                mine = [r for r in measured if r["arm"] == a]
                tok, sec = _matrix(mine)
                rates = [r["decode_tokens"] / r["decode_s"] for r in mine if r["decode_s"] > 0]
                lengths = [r["accept_lengths"] for r in here if r["arm"] == a and (r["temperature"] >= 1e-5 or
                                                                                   not r["warmup"])]
                entry = {"decode_tokens": int(tok.sum()), "decode_s": round(float(sec.sum()), 6),
                         "total_tok_s": round(float(tok.sum() / sec.sum()), 3) if sec.sum() > 0 else None,
                         "per_request_tok_s": round(float(np.mean(rates)), 3) if rates else None,
                         "tau": round(metrics.tau_per_step(lengths), 4) if any(lengths) else None,
                         "prefill_s": round(sum({(r["round"], r["batch_index"]): r["batch_prefill_s"]
                                                 for r in mine}.values()), 6)}
                if ar is not None and a != ar:
                    rt, rs = ref
                    if rt.shape == tok.shape and tok.size:
                        sp = metrics.median_round_speedup(tok, sec, rt, rs)
                        lo, hi = metrics.median_round_speedup_ci(tok, sec, rt, rs, n_boot=n_boot)
                        entry["speedup"] = round(sp, 4)
                        entry["speedup_ci"] = [round(lo, 4), round(hi, 4)] if np.isfinite([lo, hi]).all() else None
                        entry["speedup_ci_units"] = int(tok.size)  # rounds x batches resampled
                entry["same_as_b1"] = _same_as_b1(rows, a, b, c)
                per_arm[a] = entry
            points.append({"batch_size": b, "context_len": c, "requests": len({(r["batch_index"], r["batch_row"])
                                                                               for r in here}),
                           "prompt_tokens": _spread([r["prompt_tokens"] for r in here if r["arm"] == arms[0]
                                                     and r["round"] == 1]),
                           "arms": per_arm})
    return {"schema": 1, "labels": list(labels), "batch_sizes": batches, "context_lengths": contexts,
            "arms": arms, "reference": ar, "warmup_rounds": warmup, "points": points,
            "crossover": crossover(points, arms, ar, batches, contexts),
            "conventions": {"speedup": metrics.median_round_speedup.convention,
                            "unit": "a batch of B requests is the paired unit (one generate_batch call)",
                            "total_tok_s": "decode tokens / decode seconds, pooled over the point's batches and "
                                           "measured rounds (prefills excluded, timed apart)",
                            "per_request_tok_s": "the mean over the point's requests of each one's decode tokens / "
                                                 "its own decode seconds (a mean of ratios: it can exceed the total)",
                            "crossover": "the smallest swept value at which the speedup's point estimate is < 1"}}


def _spread(values: list[int]) -> dict | None:
    return {"min": min(values), "mean": round(float(np.mean(values)), 1), "max": max(values)} if values else None


def _same_as_b1(rows: list[dict], arm: str, b: int, c: int) -> dict | None:
    """T=0: this point's requests whose tokens equal the same arm's B=1 tokens (same context, round, prompt)."""
    if b == 1:
        return None
    ones = {(r["round"], r["question_id"]): r["tokens"] for r in rows
            if r["arm"] == arm and r["batch_size"] == 1 and r["context_len"] == c and r["temperature"] < 1e-5}
    pairs = [(r["tokens"], ones[(r["round"], r["question_id"])]) for r in rows
             if r["arm"] == arm and r["batch_size"] == b and r["context_len"] == c
             and (r["round"], r["question_id"]) in ones]
    if not pairs:
        return None
    return {"equal": sum(a == o for a, o in pairs), "of": len(pairs)}


def crossover(points: list[dict], arms: list[str], ar: str | None, batches, contexts) -> dict:
    """Per arm: at each context the first swept B where it stops beating AR, and at each B the first context."""
    if ar is None:
        return {}
    sp = {(p["batch_size"], p["context_len"], a): p["arms"][a].get("speedup") for p in points for a in arms}

    def first(values, key):
        for v in values:
            s = sp.get(key(v))
            if s is not None and s < 1:
                return v
        return None
    return {a: {"batch_at_context": {str(c): first(batches, lambda b: (b, c, a)) for c in contexts},
                "context_at_batch": {str(b): first(contexts, lambda c: (b, c, a)) for b in batches}}
            for a in arms if a != ar}


def format_table(summary: dict) -> str:
    lines = [f"**SWEEP** batch sizes {summary['batch_sizes']} x context lengths {summary['context_lengths']}"
             + (f" [{'; '.join(summary['labels'])}]" if summary["labels"] else ""), "",
             "| B | context | method | total tok/s | per-request tok/s | tau | Sp. vs AR [95% CI] | same as B=1 |",
             "|---|---|---|---|---|---|---|---|"]
    for p in summary["points"]:
        for a, e in p["arms"].items():
            sp = (f"{e['speedup']:.3f}" + ci_text.ci_bracket(e["speedup_ci"], e.get("speedup_ci_units"))
                  if "speedup" in e else "1.000 (ref)" if a == summary["reference"] else "-")
            same = f"{e['same_as_b1']['equal']}/{e['same_as_b1']['of']}" if e.get("same_as_b1") else "-"
            fmt = lambda v, d: "-" if v is None else f"{v:.{d}f}"
            lines.append(f"| {p['batch_size']} | {p['context_len']} | {a} | {fmt(e['total_tok_s'], 1)} | "
                         f"{fmt(e['per_request_tok_s'], 1)} | {fmt(e['tau'], 2)} | {sp} | {same} |")
    lines.append("")
    lines += sweep_readme.crossover_lines(summary)
    c = summary["conventions"]
    lines += ["", f"Speedup: {c['speedup']}; {c['unit']}. Total tok/s: {c['total_tok_s']}. Per-request tok/s: "
              f"{c.get('per_request_tok_s', '-')}. Crossover: {c['crossover']}.", ""]
    return "\n".join(lines)
