"""Runs a RunConfig: plans, loads, decodes every prompt with every arm in paired rounds, reports, writes results.

Order matters: every check that reads only configs and file headers runs before any weights are loaded, and
makes the run's one frozen plan (harness.protocol.plan.RunPlan) that everything after it reads. One code
path serves a single run (one measured round) and the paired protocol (--fair-interleave: rounds rotated left by
one, the first --fair-warmup-rounds excluded). Every finished (round, arm, prompt) is appended to
results/<run_id>/samples.jsonl at once (--resume continues from it); a finished run gzips them: samples.jsonl.gz.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass

from harness.protocol import distributed, divergence, rank_report, replays, report
from harness.protocol.build import Arm, build_arms, build_random_arms, prepare
from harness.protocol.config import RunConfig
from harness.protocol.console import describe, label
from harness.protocol.plan import (RESUMES, RunPlan, check_resume, check_room, check_unfinished, record_resume,
                                   resume_count, run_folder)
from harness.protocol.data import dataset_provenance, load_samples, render_prompt
from core.errors import UsageError
from harness.decode.loop import DecodeSettings, Generation, generate
from harness.protocol.results_io import append_rows, atomic_write, environment, read_rows, reopen_rows
from harness.protocol.rounds import refuse_captures, rotation, stream_seed  # noqa: F401  (the runner's name)
from harness.decode.accounting import accounting_for, model_stop_ids
from harness.decode import capture_plan
from harness.decode.hf_overrides import parse_overrides
from harness.decode.loading import load_target, load_tokenizer
from harness.protocol.trace import StepTracer, timed_then_traced

def settings_for(cfg: RunConfig, limit: int, stops: tuple[int, ...]) -> DecodeSettings:
    return DecodeSettings(cfg.max_new_tokens, limit, stops, cfg.temperature, cfg.top_k, cfg.top_p,
                          cfg.draft_temperature, cfg.draft_noise, cfg.compat_reference,
                          scripted_accept=cfg.scripted_accept, use_graph=cfg.use_graph,
                          record_gaps=cfg.record_logit_gaps)


def presize(target, arms, longest: int, settings: DecodeSettings, block: int) -> None:
    """Size the caches once, before warmup, for the longest context any turn can reach (`longest`: the largest
    prompt_bound): a later growth would drop the captured graphs and capture them again inside a timed
    generation."""
    need = min(settings.max_model_len, longest + settings.max_new_tokens + block + 1)
    need = -(-need // settings.graph_bucket) * settings.graph_bucket
    target.ensure_capacity(need)
    for arm in arms:
        if arm.drafter is not None:
            arm.drafter.ensure_capacity(need)
    if settings.use_graph:
        capture_plan.reserve_output(target, block)


def prompt_bound(samples, firsts, tokenizer, max_new_tokens: int, first_turn_only: bool) -> int:
    """The longest prompt any turn of the run can have: a first turn is known; a later turn's prompt holds the
    conversation so far, whose replies are unknown before decoding but at most max_new_tokens each, so it is
    bounded by the user turns rendered with empty replies plus max_new_tokens per earlier reply."""
    longest = max(map(len, firsts))
    for sample in samples:
        turns = sample.turns[:1] if first_turn_only else sample.turns
        if len(turns) > 1:
            messages = [m for i, text in enumerate(turns) for m in
                        ([{"role": "assistant", "content": ""}] if i else []) + [{"role": "user", "content": text}]]
            longest = max(longest, len(render_prompt(tokenizer, messages)) + (len(turns) - 1) * max_new_tokens)
    return longest


def warmup(arms: list[Arm], target, prompt: list[int], settings: DecodeSettings, backend) -> None:
    """Untimed generations (of the first prompt's first turn) before any measurement: lazy initialisation,
    compilation and graph capture."""
    short = dataclasses.replace(settings, max_new_tokens=min(32, settings.max_new_tokens))
    for arm in arms:
        arm.activate()
        decode = lambda tokens, s: generate(target, tokens, s, backend, drafter=arm.drafter, refiner=arm.refiner,
                                            generator=backend.generator(0))
        decode(prompt, short)
        if settings.use_graph:  # every step graph before the first measured round (harness.decode.capture_plan)
            capture_plan.capture_every_shape(decode, prompt, settings, target.capacity, arm.block_size)


@dataclass
class Models:
    """What the run loaded on its plan: the target and its tokenizer, the arms, the stop ids, and every sample's
    first turn rendered once."""
    target: object
    tokenizer: object
    arms: list[Arm]
    stops: tuple[int, ...]
    firsts: list[tuple[int, ...]]


@dataclass
class Work:
    """What this process decodes: its (question id, sample) pairs, where its rows go, and the decodes done."""
    samples: list
    mine: list[tuple[int, object]]
    rows_path: str
    done: set[tuple[int, str, int]]  # (round, arm, question id) already in rows_path (--resume)
    total: int                       # rounds x arms x this process's prompts


@dataclass
class Decoding:
    """What one (arm, prompt) decode reads besides the arm."""
    plan: RunPlan
    models: Models
    settings: DecodeSettings
    tracer: StepTracer | None = None
    global_rng: object | None = None  # --compat-reference: one stream for the whole run


def sample_row(run_id, cfg, arm: Arm, qid, sample, turn, round_, warm, g: Generation) -> dict:
    return {"run_id": run_id, "dataset": cfg.dataset, "question_id": qid, "dataset_row": sample.row, "turn": turn,
            "round": round_, "warmup": warm, "arm": arm.name, "method": arm.spec.method, "K": arm.spec.K,
            "block_size": arm.block_size, "temperature": cfg.temperature, "prompt_tokens": g.prompt_len,
            "new_tokens": len(g.tokens), "decode_tokens": g.decode_tokens, "ttft_s": g.ttft_s,
            "drafter_prefill_s": g.drafter_prefill_s, "decode_s": g.decode_s, "accept_lengths": g.accept_lengths,
            "accepted": g.accepted, "spec_steps": g.spec_steps, "ar_steps": g.ar_steps,
            "tail_steps": g.tail_steps, "extra_steps": g.extra_steps, "graph_captures": g.graph_captures,
            "draft_temperature": cfg.draft_temperature_used, "timed": g.timed, "stop_reason": g.stop_reason,
            "tokens": g.tokens,
            **({"top2_gaps": g.top2_gaps} if g.top2_gaps is not None else {})}


def decode_sample(d: Decoding, arm: Arm, qid: int, sample, round_: int, warm: bool) -> list[dict]:
    """Every turn of one prompt with one arm; each arm's later turns condition on its own earlier replies."""
    cfg, tokenizer, backend = d.plan.config, d.models.tokenizer, d.plan.backend
    turns = sample.turns[:1] if cfg.first_turn_only else sample.turns
    messages, rows = [], []
    for turn, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        # a first turn is the same for every arm and round: rendered once, by first_turns
        prompt = list(d.models.firsts[qid]) if turn == 0 else render_prompt(tokenizer, messages)
        if d.tracer:
            d.tracer.set_context(arm=arm.name, round=round_, question_id=qid, dataset_row=sample.row, turn=turn)
        rng = d.global_rng or backend.generator(stream_seed(cfg.seed, sample.row, turn, round_))
        g = timed_then_traced(lambda gen, on_step: generate(  # the tracer never runs inside the timer
            d.models.target, prompt, d.settings, backend, drafter=arm.drafter, refiner=arm.refiner,
            generator=gen, on_step=on_step), rng, d.tracer)
        rows.append(sample_row(d.plan.run_id, cfg, arm, qid, sample, turn, round_, warm, g))
        messages.append({"role": "assistant", "content": tokenizer.decode(g.tokens, skip_special_tokens=True)})
    return rows


def first_turns(samples, tokenizer, limit: int) -> list[tuple[int, ...]]:
    """Every sample's first turn, rendered once (the same for every arm and round). First turns must leave room
    for at least one new token; later turns depend on replies (checked then)."""
    firsts = []
    for qid, s in enumerate(samples):
        firsts.append(tuple(render_prompt(tokenizer, [{"role": "user", "content": s.turns[0]}])))
        if len(firsts[-1]) >= limit:
            raise UsageError(f"prompt {qid} (dataset row {s.row}) has {len(firsts[-1])} tokens, not below "
                             f"--max-model-len {limit}; raise --max-model-len above {len(firsts[-1])}")
    return firsts


def on_terminal() -> bool:
    """Progress goes to a person watching: both streams must be terminals (a log file gets none)."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def progress(total: int, done: int, quiet: bool = False):
    """One bar over every (round, arm, prompt) decode, with the ETA; None with --quiet or off a terminal."""
    if quiet or not on_terminal():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=done, unit="decode", desc="decode", file=sys.stderr, dynamic_ncols=True,
                smoothing=0.1)


def show_progress(bar, r: int, rounds: int, arm: str, qid: int, n: int, rows: list[dict]) -> None:
    """Called between decodes, never inside a timed generation: the finished prompt's decode tok/s."""
    secs = sum(x["decode_s"] for x in rows)
    rate = f"{sum(x['decode_tokens'] for x in rows) / secs:.1f} tok/s" if secs > 0 else "- tok/s"
    bar.set_postfix_str(f"round {r}/{rounds} {arm} prompt {qid + 1}/{n} {rate}", refresh=False)
    bar.update()


def resume_command(folder: str, world: int = 0) -> str:
    """The command that continues the run in `folder` (world: a torchrun run's process count, 0 for none)."""
    import shlex
    script = sys.argv[0] if sys.argv and sys.argv[0].endswith("benchmark_compile_all.py") else \
        "benchmark_compile_all.py"
    launch = f"torchrun --nproc-per-node {world}" if world else "python3"
    return f"{launch} {shlex.quote(script)} --resume {shlex.quote(folder)}"


def run(cfg: RunConfig, out=None) -> dict:
    """One paired run (see the module docstring). --compile-refiner / --compile-all change global torch._dynamo
    settings for the run's duration (harness.decode.compiling.CompileWatch); they are put back however the run ends."""
    shard = distributed.from_env()  # torchrun / accelerate launch: this process is one rank (checked first)
    watch = None
    if cfg.compile_all or cfg.compile_refiner:
        from harness.decode.compiling import CompileWatch
        watch = CompileWatch(cfg.compile_backend)
    try:
        return _run(cfg, out or sys.stdout, watch, shard)
    finally:
        if watch is not None:
            watch.release()
        shard.close()


def _run(cfg: RunConfig, out, watch, shard) -> dict | None:
    device = shard.rank_device(cfg.device)
    resume, folder = shard.pick_folder(cfg, run_folder, check_resume)  # on rank 0, for every rank
    plan = prepare(cfg, device=device, folder=folder, resume=resume)  # the one plan every later step reads
    out = out if shard.main else open(os.devnull, "w")  # rank 0 speaks for the run; errors reach every stderr
    samples = load_samples(cfg.dataset, cfg.data_dir, cfg.max_samples)
    provenance = dataset_provenance(cfg.dataset, cfg.data_dir)  # once: --resume's check and config.json
    mine, rows_path = shard.mine(samples), shard.rows_path(folder)
    done = {(r["round"], r["arm"], r["question_id"]) for r in shard.done(rows_path, bool(plan.resume))}
    check_unfinished(plan, folder, done, samples, mine, shard.launched, provenance)  # before any model loads
    models = load_models(plan, samples, choose_ops(plan), watch,  # first turns with no room to speculate: refused
                         rendered=lambda _, firsts: check_room(plan, samples, firsts))
    target = models.target
    if cfg.fp32_logits:
        target.use_fp32_logits()
    if plan.spyre is not None:  # fixed-shape compiled graphs (core.spyre)
        from core.spyre import compile_for
        compile_for(target, [a.drafter for a in models.arms])
    settings = settings_for(cfg, plan.max_model_len, models.stops)
    presize(target, models.arms, prompt_bound(samples, models.firsts, models.tokenizer, cfg.max_new_tokens,
                                              cfg.first_turn_only), settings, plan.block_size)
    order = rotation(plan.arm_names, plan.rounds)
    describe(plan, models, settings, samples, out)
    shard.announce(out, mine)

    os.makedirs(folder, exist_ok=True)
    config = {**dataclasses.asdict(cfg), "resolved": {
        **plan.resolved(), "stop_ids": list(models.stops), "rotation": order, "dataset": provenance, "label":
        label(cfg), "kernels": target.kernels, "prompt_rows": [s.row for s in samples]}}  # question id i: that row
    shard.annotate(config)
    if not plan.resume and shard.main:
        atomic_write(os.path.join(folder, "config.json"), json.dumps(config, indent=2, default=str))
    work = Work(samples, mine, rows_path, done, plan.rounds * len(models.arms) * len(mine))
    if plan.resume:
        record_resume(shard.per_rank(os.path.join(folder, RESUMES)), len(done), work.total)
        reopen_rows(rows_path)  # rows gzip'd by a run stopped before its summary: plain again, to append to
        print(f"[resume] {folder}: reusing {len(done)} of {work.total} (round, arm, prompt) decodes from "
              f"its rows; {work.total - len(done)} to run (recorded in {RESUMES})", file=out)
    try:
        return _measure(plan, models, settings, work, order, shard, watch, out)
    except KeyboardInterrupt:
        print(f"[resume] interrupted; the finished decodes are saved in {rows_path}. Continue with:\n"
              f"  {resume_command(folder, shard.world if shard.launched else 0)}", file=sys.stderr)
        raise


def load_models(plan: RunPlan, samples, ops, watch, rendered=None) -> Models:
    """The tokenizer, the target and the arms on `ops`; every first turn is rendered (and checked against the
    context limit) before the target's weights load, and then `rendered(tokenizer, firsts)` runs (a sweep's checks)."""
    cfg = plan.config
    if cfg.random_weights:
        from harness.protocol.presets import ByteTokenizer, build_random
        tokenizer = ByteTokenizer(plan.target_config.vocab_size)
        firsts = first_turns(samples, tokenizer, plan.max_model_len)
        if rendered is not None:
            rendered(tokenizer, firsts)
        models = build_random(cfg.random_weights, plan.backend, block_size=plan.block_size, seed=cfg.seed, ops=ops)
        # random models: no stop ids, every prompt runs its full budget
        return Models(models.target, tokenizer, build_random_arms(plan, models, watch), (), firsts)
    tokenizer = load_tokenizer(cfg.model_name_or_path)
    firsts = first_turns(samples, tokenizer, plan.max_model_len)
    if rendered is not None:
        rendered(tokenizer, firsts)
    taps = plan.draft_config.target_layer_ids if plan.draft_config else ()
    target, tokenizer = load_target(cfg.model_name_or_path, plan.backend, taps=taps,
                                    attn_impl=cfg.attn_implementation, tokenizer=tokenizer,
                                    overrides=parse_overrides(cfg.hf_overrides), ops=ops)
    target.fuse_projections()  # one q/k/v and one gate/up matmul per layer (views of the same weights)
    stops = model_stop_ids(target.model, tokenizer, accounting_for(cfg.compat_reference))  # REFERENCE: eos only
    return Models(target, tokenizer, build_arms(plan, target, watch), stops, firsts)


def _compile_gate(plan: RunPlan, arms: list[Arm], watch) -> None:
    """--compile-all: the warmup must have compiled every refiner; from here on a recompile ends the run."""
    if plan.config.compile_all:
        cold = [a.name for a in arms if getattr(a.refiner, "compile", False) and not a.refiner.fns]
        if cold:
            folder = plan.folder
            if not plan.resume and os.listdir(folder) == ["config.json"]:
                os.remove(os.path.join(folder, "config.json"))  # nothing measured: leave nothing behind
                os.rmdir(folder)
            raise UsageError(f"--compile-all: the warmup generation ran no speculative step for "
                             f"{', '.join(cold)}, so nothing was compiled before the timed rounds; give the "
                             "first prompt more room (--max-new-tokens, --max-model-len) or use --compile-refiner")
        watch.freeze()  # a recompile from here on ends the run (see _measure's except)


def _measure(plan: RunPlan, models: Models, settings: DecodeSettings, work: Work, order: list[list[str]], shard,
             watch, out) -> dict | None:
    cfg, backend, arms = plan.config, plan.backend, models.arms
    by_name = {a.name: a for a in arms}
    warmup(arms, models.target, list(models.firsts[0]), settings, backend)
    if watch is not None:
        _compile_gate(plan, arms, watch)
        print(f"[compile] {watch.stats()}", file=out)
    # Common random numbers: every arm replays the same stream for a (prompt, turn, round); the reference instead
    # draws everything from one stream seeded once (--compat-reference).
    d = Decoding(plan, models, settings, StepTracer(shard.per_rank(cfg.trace), bool(plan.resume)) if cfg.trace else None,
                 backend.generator(cfg.seed) if cfg.compat_reference else None)
    bar = progress(work.total, len(work.done), cfg.quiet) if shard.main else None
    recompiled = ()
    if watch is not None and watch.guarded:
        from harness.decode.compiling import recompile_error_types
        recompiled = recompile_error_types()
    rank_report.before_rounds(shard, backend.device)
    try:
        for r, names in enumerate(order, start=1):
            warm = r <= plan.warmup_rounds
            if plan.rounds > 1:
                line = f">>> round {r}/{plan.rounds}: {' -> '.join(names)}{'   [warmup - EXCLUDED]' if warm else ''}"
                (bar.write if bar else print)(line, file=out)  # tqdm.write keeps the bar below the line
            for slot, name in enumerate(names, start=1):
                arm = by_name[name]
                arm.activate()
                for qid, sample in work.mine:
                    if (r, name, qid) in work.done:
                        continue
                    rows = shard.tag(decode_sample(d, arm, qid, sample, r, warm))
                    for x in rows:  # the arm's slot in the round and the replicate's seed (harness.protocol.rounds)
                        x.update(slot=slot, stream_seed=None if cfg.compat_reference else
                                 stream_seed(cfg.seed, sample.row, x["turn"], r))
                    append_rows(work.rows_path, rows)
                    refuse_captures(rows, work.rows_path)
                    if bar:
                        show_progress(bar, r, plan.rounds, name, qid, len(work.samples), rows)
    except recompiled as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"--compile-all: a compiled stage recompiled after warmup ({first}); the rows measured "
                         f"so far stay in {work.rows_path}") from None
    finally:
        if bar:
            bar.close()
        if d.tracer:
            d.tracer.close()
    ar = next((a.name for a in arms if a.spec.method == "ar"), None)  # T=0: untimed, after every measured round
    done = replays.after_rounds(plan, models, settings, work.rows_path, ar, by_name, lambda r: stream_seed(
        cfg.seed, r["dataset_row"], r["turn"], r["round"]), out)
    if done.get("replays") or done.get("reference_decodes"):
        print(f"[divergence] after the rounds, untimed: {done['replays']} replay(s) up to a first divergence, "
              f"{done['reference_decodes']} {replays.reference_dtype(cfg)} scoring(s) of AR's text "
              f"(teacher-forced: a {replays.reference_dtype(cfg)} greedy decode to its first divergence)", file=out)
    return _report(plan, models, work, order, shard, watch, out)


def _report(plan: RunPlan, models: Models, work: Work, order, shard, watch, out) -> dict | None:
    """After the rounds: every rank's rows on rank 0, the summary, the console table and the results folder."""
    cfg, target, folder = plan.config, models.target, plan.folder
    rank_report.after_rounds(shard, plan.backend.device, len(work.mine))
    rows = shard.merge(read_rows(work.rows_path), order)  # every rank's rows on rank 0; the other ranks are done
    if rows is None:
        return None
    labels = report.config_labels({**dataclasses.asdict(cfg), "resumes": resume_count(folder)})
    saved_config = json.loads(open(os.path.join(folder, "config.json")).read())
    summary = rank_report.annotate(report.summarize(rows, tau_from_warmup=cfg.compat_reference, labels=labels,
                                                    run=report.facts.run_facts(saved_config)), rows, shard)
    if watch is not None:
        summary["compile"] = watch.stats()
    fallbacks = getattr(target.ops, "fallbacks", None)
    if fallbacks:  # TritonOps: decode-sized calls its kernels did not take (a slower step than the kernels')
        summary["kernel_fallbacks"] = {f"{op}: {why}": n for (op, why), n in sorted(fallbacks.items())}
    if summary["labels"]:
        print(f"[{'; '.join(summary['labels'])}]", file=out)
    print(report.format_console_table(summary, cfg.dataset, explain=cfg.explain) + rank_report.format_ranks(summary),
          file=out)
    for line in divergence.bug_reports(summary):  # a divergence that is no near-tie: a bug report, not a footnote
        print(line, file=out)
    if fallbacks:
        from core.ops.triton_impl import fallback_note
        print(f"[kernels] {fallback_note(target.ops)}", file=out)
    if cfg.answer_file:  # before the results folder, whose summary.json (written last) marks the run finished
        from harness.protocol.answers import write_answer_files
        for path, n in write_answer_files(cfg, rows, work.samples, models.tokenizer, models.arms):
            print(f"Saved answer file with {n} samples to {path}", file=out)
    report.write_results(folder, saved_config, rank_report.environment(environment(exclude=[folder]), shard), rows,
                         summary, out)
    print(f"[results] {folder}", file=out)
    from harness.decode.state import graph_stats
    if graph_stats(target):
        print(f"[graphs] whole-step CUDA graphs: {graph_stats(target)}", file=out)
    return summary


def choose_ops(plan: RunPlan):
    """--kernels, decided once from the plan and the target's config, before any weights load (see
    core.ops.make_ops); the target, the drafter and the refiners are all built on the result."""
    from core.ops import make_ops
    cfg, b = plan.config, plan.backend
    launch = None
    if cfg.batch_invariant:  # validate() let it through with --kernels triton only
        from core.kernels import Launch
        launch = Launch(pdl=None, batch_invariant=True)
    return make_ops(cfg.kernels, b.device, b.dtype, plan.target_config, compat=cfg.compat_reference,
                    attn_impl=cfg.attn_implementation, launch=launch)
