"""Runs a RunConfig: checks, loads, decodes every prompt with every arm in paired rounds, reports, writes results.

Order matters: every check that reads only configs and file headers runs before any weights are loaded. One code
path serves a single run (one measured round) and the paired protocol (--fair-interleave: rounds rotated left by
one, the first --fair-warmup-rounds excluded). Every finished (round, arm, prompt) is appended to
results/<run_id>/samples.jsonl at once, which is what --resume continues from.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time

from harness.protocol import distributed, rank_report, report
from harness.protocol.build import Arm, build_arms, build_random_arms, prepare
from harness.protocol.config import RunConfig
from harness.protocol.data import dataset_provenance, load_samples, render_prompt
from core.errors import UsageError
from harness.decode.loop import DecodeSettings, Generation, generate
from harness.protocol.results_io import append_rows, atomic_write, environment, read_rows
from harness.protocol.rounds import refuse_captures, rotation
from harness.decode.accounting import accounting_for, model_stop_ids
from harness.decode import capture_plan
from harness.decode.capture_plan import capture_every_shape
from harness.decode.hf_overrides import parse_overrides
from harness.decode.loading import load_target, load_tokenizer
from harness.protocol.trace import StepTracer, timed_then_traced

# Flags that may differ between an interrupted run and its --resume.
RESUME_FREE = ("resume", "run_id", "results_dir", "answer_file", "trace", "explain",
               "given", "quiet")  # given: which flags were typed


def stream_seed(seed: int, row: int, turn: int, round_: int = 1) -> int:
    """Independent, reproducible stream per (seed, prompt, turn, round); every arm of a round replays it."""
    digest = hashlib.sha256(f"{seed}:{row}:{turn}:{round_}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def run_folder(cfg: RunConfig) -> str:
    if cfg.resume:
        return cfg.resume
    taken = lambda f: os.path.exists(os.path.join(f, "samples.jsonl")) or os.path.exists(os.path.join(f, "config.json"))
    if cfg.run_id:
        folder = os.path.join(cfg.results_dir, cfg.run_id)
        if taken(folder):
            raise UsageError(f"{folder} already holds a run; pass --resume {folder} to continue it, or a new --run-id")
        return folder
    base = os.path.join(cfg.results_dir, f"{cfg.dataset}_T{cfg.temperature:g}_{time.strftime('%Y%m%d-%H%M%S')}")
    folder, n = base, 1
    while taken(folder):
        n += 1
        folder = f"{base}-{n}"
    return folder


def check_resume(cfg: RunConfig, folder: str) -> None:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise UsageError(f"--resume {folder}: config.json is missing; is this a run folder?")
    saved = json.loads(open(path).read())
    now = dataclasses.asdict(cfg)
    diff = sorted(k for k in now if k not in RESUME_FREE and saved.get(k) != now[k])
    if diff:
        raise UsageError(f"--resume {folder}: the run was started with other settings ({', '.join(diff[:4])}); "
                         "repeat the original command with --resume")


def settings_for(cfg: RunConfig, limit: int, stops: tuple[int, ...]) -> DecodeSettings:
    return DecodeSettings(cfg.max_new_tokens, limit, stops, cfg.temperature, cfg.top_k, cfg.top_p,
                          cfg.draft_temperature, cfg.draft_noise, cfg.compat_reference,
                          scripted_accept=cfg.scripted_accept, use_graph=cfg.use_graph,
                          record_gaps=cfg.record_logit_gaps)


def label(cfg: RunConfig) -> str | None:
    """The run's weights label (harness.protocol.report.weights_label), for config.json and the console."""
    return report.weights_label(dataclasses.asdict(cfg))


def presize(target, arms, longest: int, settings: DecodeSettings, block: int) -> None:
    """Size the caches once, before warmup, for the longest first turn: a later growth would drop the captured
    graphs and capture them again inside a timed generation."""
    need = min(settings.max_model_len, longest + settings.max_new_tokens + block + 1)
    need = -(-need // settings.graph_bucket) * settings.graph_bucket
    target.ensure_capacity(need)
    for arm in arms:
        if arm.drafter is not None:
            arm.drafter.ensure_capacity(need)
    if settings.use_graph:
        capture_plan.reserve_output(target, block)


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
            capture_every_shape(decode, prompt, settings, target.capacity, arm.block_size)


def sample_row(run_id, cfg, arm: Arm, qid, sample, turn, round_, warm, g: Generation) -> dict:
    return {"run_id": run_id, "dataset": cfg.dataset, "question_id": qid, "dataset_row": sample.row, "turn": turn,
            "round": round_, "warmup": warm, "arm": arm.name, "method": arm.spec.method, "K": arm.spec.K,
            "block_size": arm.block_size, "temperature": cfg.temperature, "prompt_tokens": g.prompt_len,
            "new_tokens": len(g.tokens), "decode_tokens": g.decode_tokens, "ttft_s": g.ttft_s,
            "drafter_prefill_s": g.drafter_prefill_s, "decode_s": g.decode_s, "accept_lengths": g.accept_lengths,
            "accepted": g.accepted, "spec_steps": g.spec_steps, "ar_steps": g.ar_steps,
            "tail_steps": g.tail_steps, "extra_steps": g.extra_steps, "graph_captures": g.graph_captures,
            "draft_temperature": cfg.draft_temperature, "timed": g.timed, "stop_reason": g.stop_reason,
            "tokens": g.tokens,
            **({"top2_gaps": g.top2_gaps} if g.top2_gaps is not None else {})}


def decode_sample(ctx, arm: Arm, qid: int, sample, round_: int, warm: bool) -> list[dict]:
    """Every turn of one prompt with one arm; each arm's later turns condition on its own earlier replies."""
    cfg, tokenizer = ctx["cfg"], ctx["tokenizer"]
    turns = sample.turns[:1] if cfg.first_turn_only else sample.turns
    messages, rows = [], []
    for turn, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        # a first turn is the same for every arm and round: rendered once, by first_turns
        prompt = list(ctx["first_turns"][qid]) if turn == 0 else render_prompt(tokenizer, messages)
        if ctx["tracer"]:
            ctx["tracer"].set_context(arm=arm.name, round=round_, question_id=qid, dataset_row=sample.row, turn=turn)
        rng = ctx["global_rng"] or ctx["backend"].generator(stream_seed(cfg.seed, sample.row, turn, round_))
        g = timed_then_traced(lambda gen, on_step: generate(  # the tracer never runs inside the timer
            ctx["target"], prompt, ctx["settings"], ctx["backend"], drafter=arm.drafter, refiner=arm.refiner,
            generator=gen, on_step=on_step), rng, ctx["tracer"])
        rows.append(sample_row(ctx["run_id"], cfg, arm, qid, sample, turn, round_, warm, g))
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
                             f"--max-model-len {limit}; raise --max-model-len or lower --max-samples")
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


def resume_command(folder: str) -> str:
    import shlex
    script = sys.argv[0] if sys.argv and sys.argv[0].endswith("benchmark_compile_all.py") else \
        "benchmark_compile_all.py"
    return f"python3 {shlex.quote(script)} --resume {shlex.quote(folder)}"


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
    prep = prepare(shard.rank_config(cfg))
    cfg = prep.config or cfg  # --device spyre: K and C as the Spyre contract resolved them
    out = out if shard.main else open(os.devnull, "w")  # rank 0 speaks for the run; errors reach every stderr
    cfg, folder = shard.pick_folder(cfg, run_folder, check_resume)  # on rank 0, for every rank
    backend = prep.backend
    samples = load_samples(cfg.dataset, cfg.data_dir, cfg.max_samples)
    ops = choose_ops(cfg, prep)
    mine = shard.mine(samples)
    if cfg.random_weights:
        from harness.protocol.presets import ByteTokenizer, build_random
        tokenizer = ByteTokenizer(prep.target_config.vocab_size)
        firsts = first_turns(samples, tokenizer, prep.max_model_len)
        models = build_random(cfg.random_weights, backend, block_size=prep.block_size, seed=cfg.seed, ops=ops)
        target, stops = models.target, ()  # random models: no stop ids, every prompt runs its full budget
        arms = build_random_arms(cfg, prep, models, watch)
    else:
        tokenizer = load_tokenizer(cfg.model_name_or_path)
        firsts = first_turns(samples, tokenizer, prep.max_model_len)
        taps = prep.draft_config.target_layer_ids if prep.draft_config else ()
        target, tokenizer = load_target(cfg.model_name_or_path, backend, taps=taps,
                                        attn_impl=cfg.attn_implementation, tokenizer=tokenizer,
                                        overrides=parse_overrides(cfg.hf_overrides), ops=ops)
        target.fuse_projections()  # one q/k/v and one gate/up matmul per layer (views of the same weights)
        stops = model_stop_ids(target.model, tokenizer, accounting_for(cfg.compat_reference))  # REFERENCE: eos only
        arms = build_arms(cfg, prep, target, watch)
    if cfg.fp32_logits:
        target.use_fp32_logits()
    if prep.spyre is not None:  # fixed-shape compiled graphs (core.spyre)
        from core.spyre import compile_for
        compile_for(target, [a.drafter for a in arms])
    settings = settings_for(cfg, prep.max_model_len, stops)
    presize(target, arms, max(map(len, firsts)), settings, prep.block_size)
    order = rotation([a.name for a in arms], prep.rounds)
    describe(cfg, prep, arms, settings, samples, stops, folder, out, target.kernels)
    shard.announce(out, mine)

    os.makedirs(folder, exist_ok=True)
    rows_path = shard.rows_path(folder)
    config = {**dataclasses.asdict(cfg), "resolved": {
        "block_size": prep.block_size, "max_model_len": prep.max_model_len, "stop_ids": list(stops),
        "rounds": prep.rounds, "warmup_rounds": prep.warmup_rounds, "arms": [a.name for a in arms],
        "rotation": order, "dataset": dataset_provenance(cfg.dataset, cfg.data_dir),
        "refiners": {k: {"source": c.source, "step": c.step, "rank": c.rank, "mixer": c.mixer,
                          "variant": c.variant}
                     for k, c in prep.refiners.items()},
        "label": label(cfg), "kernels": target.kernels,
        "trained_block_size": prep.draft_config.block_size if prep.draft_config else None}}
    shard.annotate(config)
    if not cfg.resume and shard.main:
        atomic_write(os.path.join(folder, "config.json"), json.dumps(config, indent=2, default=str))
    done = {(r["round"], r["arm"], r["question_id"]) for r in shard.done(rows_path, bool(cfg.resume))}
    total = prep.rounds * len(arms) * len(mine)
    if cfg.resume:
        print(f"[resume] {folder}: reusing {len(done)} of {total} (round, arm, prompt) decodes from samples.jsonl; "
              f"{total - len(done)} to run", file=out)
    try:
        return _measure(cfg, out, watch, prep, folder, rows_path, samples, firsts, tokenizer, target, arms,
                        settings, backend, order, done, total, shard, mine)
    except KeyboardInterrupt:
        print(f"[resume] interrupted; the finished decodes are saved in {rows_path}. Continue with:\n"
              f"  {resume_command(folder)}", file=sys.stderr)
        raise


def _measure(cfg, out, watch, prep, folder, rows_path, samples, firsts, tokenizer, target, arms, settings, backend,
             order, done, total, shard, mine) -> dict | None:
    by_name = {a.name: a for a in arms}
    warmup(arms, target, list(firsts[0]), settings, backend)
    if watch is not None:
        if cfg.compile_all:
            cold = [a.name for a in arms if getattr(a.refiner, "compile", False) and not a.refiner.fns]
            if cold:
                if not cfg.resume and os.listdir(folder) == ["config.json"]:
                    os.remove(os.path.join(folder, "config.json"))  # nothing measured: leave nothing behind
                    os.rmdir(folder)
                raise UsageError(f"--compile-all: the warmup generation ran no speculative step for "
                                 f"{', '.join(cold)}, so nothing was compiled before the timed rounds; give the "
                                 "first prompt more room (--max-new-tokens, --max-model-len) or use --compile-refiner")
            watch.freeze()  # a recompile from here on ends the run (see the except below)
        print(f"[compile] {watch.stats()}", file=out)
    ctx = {"cfg": cfg, "tokenizer": tokenizer, "target": target, "backend": backend, "settings": settings,
           "first_turns": firsts,
           "run_id": os.path.basename(os.path.normpath(folder)),
           "tracer": StepTracer(shard.per_rank(cfg.trace)) if cfg.trace else None,
           # Common random numbers: every arm replays the same stream for a (prompt, turn, round); the reference
           # instead draws everything from one stream seeded once (--compat-reference).
           "global_rng": backend.generator(cfg.seed) if cfg.compat_reference else None}
    bar = progress(total, len(done), cfg.quiet) if shard.main else None
    recompiled = ()
    if watch is not None and watch.guarded:
        from harness.decode.compiling import recompile_error_types
        recompiled = recompile_error_types()
    rank_report.before_rounds(shard, backend.device)
    try:
        for r, names in enumerate(order, start=1):
            warm = r <= prep.warmup_rounds
            if prep.rounds > 1:
                line = f">>> round {r}/{prep.rounds}: {' -> '.join(names)}{'   [warmup - EXCLUDED]' if warm else ''}"
                (bar.write if bar else print)(line, file=out)  # tqdm.write keeps the bar below the line
            for name in names:
                arm = by_name[name]
                arm.activate()
                for qid, sample in mine:
                    if (r, name, qid) in done:
                        continue
                    rows = shard.tag(decode_sample(ctx, arm, qid, sample, r, warm))
                    append_rows(rows_path, rows)
                    refuse_captures(rows, rows_path)
                    if bar:
                        show_progress(bar, r, prep.rounds, name, qid, len(samples), rows)
    except recompiled as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"--compile-all: a compiled stage recompiled after warmup ({first}); the rows measured "
                         f"so far stay in {rows_path}") from None
    finally:
        if bar:
            bar.close()
        if ctx["tracer"]:
            ctx["tracer"].close()

    rank_report.after_rounds(shard, backend.device, len(mine))
    rows = shard.merge(read_rows(rows_path), order)  # every rank's rows on rank 0; the other ranks are done
    if rows is None:
        return None
    labels = report.config_labels(dataclasses.asdict(cfg))
    summary = rank_report.annotate(report.summarize(rows, tau_from_warmup=cfg.compat_reference, labels=labels),
                                   rows, shard)
    if watch is not None:
        summary["compile"] = watch.stats()
    fallbacks = getattr(target.ops, "fallbacks", None)
    if fallbacks:  # TritonOps: decode-sized calls its kernels did not take (a slower step than the kernels')
        summary["kernel_fallbacks"] = {f"{op}: {why}": n for (op, why), n in sorted(fallbacks.items())}
    if summary["labels"]:
        print(f"[{'; '.join(summary['labels'])}]", file=out)
    print(report.format_console_table(summary, cfg.dataset, explain=cfg.explain) + rank_report.format_ranks(summary),
          file=out)
    if fallbacks:
        from core.ops.triton_impl import fallback_note
        print(f"[kernels] {fallback_note(target.ops)}", file=out)
    saved_config = json.loads(open(os.path.join(folder, "config.json")).read())
    report.write_results(folder, saved_config, rank_report.environment(environment(exclude=[folder]), shard), rows,
                         summary, out)
    print(f"[results] {folder}", file=out)
    from harness.decode.state import graph_stats
    if graph_stats(target):
        print(f"[graphs] whole-step CUDA graphs: {graph_stats(target)}", file=out)
    if cfg.answer_file:
        from harness.protocol.answers import write_answer_files
        for path, n in write_answer_files(cfg, rows, samples, tokenizer, arms):
            print(f"Saved answer file with {n} samples to {path}", file=out)
    return summary


def choose_ops(cfg, prep):
    """--kernels, decided once from the run's settings and the target's config, before any weights load (see
    core.ops.make_ops); the target, the drafter and the refiners are all built on the result."""
    from core.ops import make_ops
    b = prep.backend
    return make_ops(cfg.kernels, b.device, b.dtype, prep.target_config, compat=cfg.compat_reference,
                    attn_impl=cfg.attn_implementation)


def describe(cfg, prep, arms, settings, samples, stops, folder, out, target_kernels="torch") -> None:
    backend = prep.backend
    if label(cfg):
        print(f"[{label(cfg)}] preset={cfg.random_weights or '-'} scripted_accept={cfg.scripted_accept}", file=out)
    print(f"[run] target={cfg.model_name_or_path or cfg.random_weights} device={backend.device} dtype={backend.dtype} "
          f"kernels={target_kernels} block={prep.block_size} stop_ids={list(stops)} max_model_len={prep.max_model_len} "
          f"samples={len(samples)} arms={[a.name for a in arms]} rounds={prep.rounds} "
          f"(first {prep.warmup_rounds} excluded) folder={folder}", file=out)
    if prep.rotation_note:
        print(f"[rounds] {prep.rotation_note}", file=out)
    trained = prep.draft_config.block_size if prep.draft_config else None
    if trained and prep.block_size < trained:
        print(f"[note] block {prep.block_size} is smaller than the drafter's trained block {trained}: allowed (the "
              f"drafter fills only the first {prep.block_size - 1} of its {trained - 1} draft slots), but tau is "
              "not the drafter's published setting", file=out)
    for ck in prep.refiners.values():
        mixer = (f" mixer={ck.mixer} (fold={'no' if cfg.no_fold_mixer else 'after cast to ' + str(backend.dtype)})"
                 if ck.kind == "xpress" else "")
        print(f"[refiner] {ck.kind} from {ck.source}: rank={ck.rank} step={ck.step}{mixer} "
              f"co-trained drafter={'yes' if ck.draft_state else 'no'}", file=out)
    tp, dp = settings.target_params, settings.draft_params
    verification = ("greedy" if tp.greedy else "rejection sampling (q = the drafts' real distribution)"
                    if not dp.greedy else "exact match against a sampled target")
    print(f"[sampling] T={tp.temperature} Td={dp.temperature} top_k={tp.top_k or 'off'} "
          f"top_p={tp.top_p if tp.top_p < 1 else 'off'} draft noise={settings.draft_noise if not dp.greedy else '-'} "
          f"verification={verification} rng={'one global stream' if cfg.compat_reference else 'per (prompt, turn)'}",
          file=out)
