"""Builds a run from a RunConfig: checks, loads, decodes every prompt with each arm, reports, writes answers.

Order matters: every check that reads only configs and file headers runs before any weights are loaded.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import time

from harness import metrics
from harness.build import Arm, build_arms, prepare
from harness.config import RunConfig
from harness.data import load_samples, render_prompt
from harness.loop import DecodeSettings, Generation, generate
from harness.target import load_target, stop_token_ids
from harness.trace import StepTracer


def stream_seed(seed: int, row: int, turn: int) -> int:
    """Independent, reproducible stream per (seed, prompt, turn); every arm gets the same one."""
    digest = hashlib.sha256(f"{seed}:{row}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def warmup(arms: list[Arm], target, samples, tokenizer, settings: DecodeSettings, backend) -> None:
    """Untimed generations before any measurement: lazy initialisation, compilation and graph capture."""
    prompt = render_prompt(tokenizer, [{"role": "user", "content": samples[0].turns[0]}])
    short = dataclasses.replace(settings, max_new_tokens=min(32, settings.max_new_tokens))
    for arm in arms:
        generate(target, prompt, short, backend, drafter=arm.drafter, refiner=arm.refiner,
                 generator=backend.generator(0))


def run(cfg: RunConfig, out=None) -> dict:
    out = out or sys.stdout
    prep = prepare(cfg)
    backend = prep.backend
    samples = load_samples(cfg.dataset, cfg.data_dir, cfg.max_samples)
    taps = prep.draft_config.target_layer_ids if prep.draft_config else ()
    target, tokenizer = load_target(cfg.model_name_or_path, backend, taps=taps, attn_impl=cfg.attn_implementation)
    stops = tuple(stop_token_ids(target.model, tokenizer))
    arms = build_arms(cfg, prep, target)
    settings = DecodeSettings(cfg.max_new_tokens, prep.max_model_len, stops, cfg.temperature, cfg.top_k, cfg.top_p,
                              cfg.draft_temperature, cfg.draft_noise, cfg.compat_reference)
    print(f"[run] target={cfg.model_name_or_path} device={backend.device} dtype={backend.dtype} "
          f"block={prep.block_size} stop_ids={list(stops)} max_model_len={prep.max_model_len} "
          f"samples={len(samples)} arms={[a.name for a in arms]}", file=out)
    tp, dp = settings.target_params, settings.draft_params
    verification = ("greedy" if tp.greedy else "rejection sampling (q = the drafts' real distribution)"
                    if not dp.greedy else "exact match against a sampled target")
    print(f"[sampling] T={tp.temperature} Td={dp.temperature} top_k={tp.top_k or 'off'} "
          f"top_p={tp.top_p if tp.top_p < 1 else 'off'} draft noise={settings.draft_noise if not dp.greedy else '-'} "
          f"verification={verification} rng={'one global stream' if cfg.compat_reference else 'per (prompt, turn)'}",
          file=out)
    if prep.refiner is not None:
        ck = prep.refiner
        print(f"[refiner] {ck.kind} from {ck.source}: rank={ck.rank} step={ck.step} mixer={ck.mixer} "
              f"(fold={'no' if cfg.no_fold_mixer else 'after cast to ' + str(backend.dtype)}) "
              f"co-trained drafter={'yes' if ck.draft_state else 'no'}", file=out)
    warmup(arms, target, samples, tokenizer, settings, backend)
    tracer = StepTracer(cfg.trace) if cfg.trace else None
    # Common random numbers: every arm replays the same stream for a (prompt, turn); the reference instead
    # draws everything from one stream seeded once (--compat-reference).
    global_rng = backend.generator(cfg.seed) if cfg.compat_reference else None
    try:
        for qid, s in enumerate(samples):
            for arm in arms:
                arm.results.append([])
            messages: list[dict] = []
            for turn_idx, turn in enumerate(s.turns):
                messages.append({"role": "user", "content": turn})
                prompt = render_prompt(tokenizer, messages)
                reply = None
                for arm in arms:
                    if tracer:
                        tracer.set_context(arm=arm.name, question_id=qid, dataset_row=s.row, turn=turn_idx)
                    gen_rng = global_rng or backend.generator(stream_seed(cfg.seed, s.row, turn_idx))
                    g = generate(target, prompt, settings, backend, drafter=arm.drafter, refiner=arm.refiner,
                                 generator=gen_rng, on_step=tracer)
                    arm.results[-1].append(g)
                    reply = g.tokens  # the last arm (speculative when run) conditions the next turn, as the reference
                messages.append({"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)})
    finally:
        if tracer:
            tracer.close()

    summary = {arm.name: summarize(arm) for arm in arms}
    report(summary, prep.block_size, out)
    for arm in arms:
        if getattr(arm.refiner, "graph_count", 0):
            print(f"[graphs] {arm.name}: {arm.refiner.graph_count} CUDA graph(s) captured during warmup", file=out)
    if cfg.answer_file:
        write_answers(cfg.answer_file, samples, arms, tokenizer, cfg.dataset, timing=not cfg.no_answer_timing)
        print(f"Saved answer file with {len(samples)} samples to {cfg.answer_file}", file=out)
    return summary


def summarize(arm: Arm) -> dict:
    """Turn 1 of every sample, as the reference measures (later turns only condition the history)."""
    first = [turns[0] for turns in arm.results if turns]
    lengths = [g.accept_lengths for g in first]
    tokens = [g.decode_tokens for g in first]
    seconds = [g.decode_s for g in first]
    return {
        "arm": arm.name, "block_size": arm.block_size, "samples": len(first),
        "tau_per_step": metrics.tau_per_step(lengths), "tau_per_sample": metrics.tau_per_sample(lengths),
        "histogram": metrics.acceptance_histogram(lengths, arm.block_size),
        "per_position": metrics.per_position_acceptance(lengths, arm.block_size) if arm.block_size > 1 else [],
        "pooled_tok_s": metrics.pooled_tok_per_s(tokens, seconds),
        "per_sample_tok_s": metrics.per_sample_tok_per_s(tokens, seconds),
        "ttft_s": sum(g.ttft_s for g in first) / max(1, len(first)),
        "drafter_prefill_s": sum(g.drafter_prefill_s for g in first) / max(1, len(first)),
        "new_tokens": sum(len(g.tokens) for g in first),
        "stop_reasons": {r: sum(g.stop_reason == r for g in first) for r in sorted({g.stop_reason for g in first})},
    }


def report(summary: dict, block: int, out) -> None:
    print("\nconventions: tau = tokens a verify step adds to the output (accepted drafts + 1), clipped at EOS and "
          "the budget; tau/step pooled over all steps, tau/sample = mean of per-sample means; decode tok/s counts "
          "tokens after the prefill's first token over decode time (drafter prefill and TTFT reported apart); "
          "POOLED = sum tokens / sum time (pairs with tau/step), per-sample = 1/mean(s/token) "
          "(pairs with tau/sample); turn 1 only.", file=out)
    print(f"{'arm':<14}{'tau/step':>10}{'tau/sample':>12}{'POOLED tok/s':>14}{'per-sample tok/s':>18}"
          f"{'TTFT ms':>10}{'drafter-prefill ms':>20}", file=out)
    for name, s in summary.items():
        print(f"{name:<14}{s['tau_per_step']:>10.3f}{s['tau_per_sample']:>12.3f}{s['pooled_tok_s']:>14.1f}"
              f"{s['per_sample_tok_s']:>18.1f}{1000 * s['ttft_s']:>10.1f}{1000 * s['drafter_prefill_s']:>20.1f}",
              file=out)
    for name, s in summary.items():
        if s["block_size"] > 1:
            print(f"{name} acceptance histogram (b=0..{block}): "
                  f"{['%.1f%%' % (100 * x) for x in s['histogram']]}", file=out)
            print(f"{name} per-position accept rate (draft k accepted): "
                  f"{['%.4f' % x for x in s['per_position']]}", file=out)
        print(f"{name} stop reasons: {s['stop_reasons']}", file=out)


TIMING_FIELDS = ("wall_time", "prefill_times", "drafter_prefill_times", "decode_times")


def _choice(index: int, arm: Arm | None, turns: list[Generation], tokenizer, timing: bool = True) -> dict:
    choice = {"index": index, "block_size": arm.block_size if arm else None, "method": arm.name if arm else None,
            "turns": [tokenizer.decode(g.tokens, skip_special_tokens=True) for g in turns],
            "new_tokens": [len(g.tokens) for g in turns],
            "wall_time": [g.ttft_s + g.drafter_prefill_s + g.decode_s for g in turns],
            "prefill_times": [g.ttft_s for g in turns],
            "drafter_prefill_times": [g.drafter_prefill_s for g in turns],
            "decode_times": [g.decode_s for g in turns],
            "acceptance_lengths": [g.accept_lengths for g in turns],
            "stop_reason": [g.stop_reason for g in turns]}
    if not timing:
        for key in TIMING_FIELDS:
            del choice[key]
    return choice


def write_answers(path: str, samples, arms: list[Arm], tokenizer, dataset: str, timing: bool = True) -> None:
    """The reference's per-sample schema (choices[0] = AR, choices[1] = speculative) plus provenance fields.

    Written to a temporary file and renamed, so an interrupted run leaves no half-written answer file.
    """
    by_block = {1: None, 2: None}
    for arm in arms:
        by_block[1 if arm.block_size == 1 else 2] = arm
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".answers.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for i, s in enumerate(samples):
                choices = []
                for index, key in enumerate((1, 2)):
                    arm = by_block[key]
                    choices.append(_choice(index, arm, arm.results[i] if arm else [], tokenizer, timing))
                row = {"question_id": i, "dataset": dataset, "dataset_row": s.row, "choices": choices}
                if timing:
                    row["tstamp"] = time.time()
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
