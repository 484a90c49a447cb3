"""Response tokens/s of the batched generator against HF generate, on the same prompts:

    python -m harness.lab.bench_generate --target smollm2 | --random-weights smollm2-135m --device cuda
        --dtype bfloat16 --prompts 1024 --batch 1024 --max-new-tokens 256 [--sampled] [--out FILE.json]

Prompts are GSM8K training questions (training/data/gsm8k_train_questions.jsonl): through the target's chat
template with --target, UTF-8 bytes (harness.protocol.presets.ByteTokenizer) with --random-weights, whose every
number is labelled as random weights (such a target never stops early, so every row runs to --max-new-tokens).
The fast engine (harness.decode.batched_gen.BatchedGenerator, --batch rows, continuous batching) runs twice: cold
(its CUDA graphs are captured inside) and warm; HF generate runs in left-padded batches of --batch prompts over the
first --hf-prompts prompts (default all). Tokens are counted up to and including the stop. `kv_read_over_needed`:
host arithmetic, not a measurement: the cache slots the decode's attention reads (--attention sdpa: every row over
its step's bucket; triton: every row over its own prefix, an idle row's one slot) over those below each busy row's
own position (rows that finish between two checks count as busy to its end, in both); --profile adds a third,
untimed run's kernels. For greedy, the share
of rows equal to HF's (and the mean share of each row's tokens before the first difference), over HF's prompts.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from core.devices import resolve_backend
from core.errors import Parser, UsageError
from harness.decode.batched_gen import BatchedGenerator, hf_generate
from harness.decode.sampling import DEFAULT_SAMPLER, SAMPLERS

RANDOM = "random weights (timing only: answers are meaningless, and no row stops early)"
QUESTIONS = Path(__file__).resolve().parents[2] / "training" / "data" / "gsm8k_train_questions.jsonl"


def questions(n: int) -> list[str]:
    lines = [line for line in QUESTIONS.read_text().splitlines() if line.strip()]
    if n > len(lines):
        raise UsageError(f"--prompts {n}: {QUESTIONS.name} has {len(lines)} questions")
    return [json.loads(line)["question"] for line in lines[:n]]


def load_random(name: str, backend, texts: list[str]):
    from harness.protocol.presets import ByteTokenizer, build_random, preset
    m = build_random(name, backend, fuse=False)
    tok = ByteTokenizer(m.target.vocab_size)
    return m.target.model, [tok.encode(t) for t in texts], list(preset(name).stop_ids), 0, RANDOM


def load_real(spec: str, backend, texts: list[str]):
    from transformers import AutoModelForCausalLM
    from harness.decode.accounting import STANDARD, model_stop_ids
    from harness.decode.loading import load_path, load_target_config, load_tokenizer
    if spec == "smollm2":
        from harness.protocol.assets import fetch_smollm2_gguf
        spec = str(fetch_smollm2_gguf())
    load_target_config(spec)  # the family check, before weights
    tokenizer = load_tokenizer(spec)
    path, extra = load_path(spec, convert=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=backend.dtype, attn_implementation="sdpa", **extra)
    model = model.to(backend.device).eval()
    prompts = []
    for t in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=True,
                                            add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return model, prompts, list(model_stop_ids(model, tokenizer, STANDARD)), pad or 0, "real weights"


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device, fn):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def _rate(answers, seconds) -> dict:
    tokens = sum(len(a) for a in answers)
    return {"prompts": len(answers), "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1), "mean_answer": round(tokens / max(len(answers), 1), 1)}


def _prefix_share(a: list[int], b: list[int]) -> float:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / max(len(a), len(b), 1)


def profile_run(gen: BatchedGenerator, run, device) -> dict:
    """The fast engine once more under torch.profiler: harness.lab.profiled's record per decode step (the prefills
    and host checks are its `xb.prefill` and `xb.check` ranges, their time spread over the steps like the rest)."""
    from torch.profiler import ProfilerActivity, profile
    from harness.lab.profiled import summary
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    gen.stats = dict.fromkeys(gen.stats, 0)
    with profile(activities=acts) as prof:
        _, seconds = _timed(device, run)
    return {"per": "decode step", **summary(prof.key_averages(), max(gen.stats["steps"], 1), seconds,
                                            device.type == "cuda", top=20)}


def measure(a) -> dict:
    backend = resolve_backend(a.device, a.dtype)
    texts = questions(a.prompts)
    load = (lambda: load_random(a.random_weights, backend, texts)) if a.random_weights else \
        (lambda: load_real(a.target, backend, texts))
    model, prompts, stops, pad, label = load()
    kw = dict(sample=a.sampled, temperature=a.temperature, top_p=a.top_p, seed=a.seed)
    gen = BatchedGenerator(model, rows=a.batch, dtype=backend.dtype, device=backend.device,
                           check_every=a.check_every, bucket=a.bucket, attention=a.attention,
                           refill_min=a.refill_min, sampler=a.sampler)
    run = lambda: gen.generate(prompts, a.max_new_tokens, stops, **kw)  # noqa: E731
    _, cold = _timed(backend.device, run)
    cold_stats, gen.stats = gen.stats, dict.fromkeys(gen.stats, 0)
    fast, warm = _timed(backend.device, run)
    st = gen.stats
    kv = {"kv_read_over_needed": round(st["kv_slots_read"] / max(st["kv_slots_needed"], 1), 3),
          "kv_bytes_per_slot": gen.lm.k[0].element_size() * 2 * len(gen.lm.layers) * gen.lm.n_kv * gen.lm.head_dim}
    result = {"label": label, "target": a.random_weights or a.target, "device": str(backend.device),
              "gpu": torch.cuda.get_device_name(backend.device) if backend.device.type == "cuda" else None,
              "dtype": str(backend.dtype).replace("torch.", ""), "batch": a.batch, "attention": gen.lm.attention,
              "refill_min": a.refill_min,
              "max_new_tokens": a.max_new_tokens, "mode": "sampled" if a.sampled else "greedy",
              **({"temperature": a.temperature, "top_p": a.top_p, "sampler": gen.sampler} if a.sampled else {}),
              "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1),
              "timing": "fast: the second of two identical runs (the first builds its graphs and cache: "
                        "cold_seconds); hf: one run, not warmed up; ratio: fast tokens/s over hf tokens/s",
              "fast": {**_rate(fast, warm), "cold_seconds": round(cold, 3), **st, **kv},
              "fast_cold": cold_stats}
    if a.profile:  # a third run, after the timed ones, so the profiler's cost stays out of their rates
        result["profile"] = profile_run(gen, run, backend.device)
    n = 0 if a.skip_hf else min(a.hf_prompts or len(prompts), len(prompts))
    if n:
        def hf():
            out = []
            for s in range(0, n, a.batch):  # the first n prompts only (it ran whole batches past n)
                out += hf_generate(model, prompts[s:min(s + a.batch, n)], a.max_new_tokens, stops, pad, **kw)
            return out
        ref, seconds = _timed(backend.device, hf)
        hf_batch, rows = min(a.batch, n), min(a.batch, len(prompts))  # the rows each engine decoded at once
        result["hf"] = {**_rate(ref, seconds), "batch": hf_batch}
        ratio = round(result["fast"]["tokens_per_s"] / result["hf"]["tokens_per_s"], 2)
        if hf_batch == rows:
            result["ratio"] = ratio
        else:  # HF's time is per step more than per row (on the H200: 128 rows in 54 s, 1,024 in 59 s), so a
            # smaller HF batch makes the ratio a measure of the batch as much as of the engine
            result["ratio_at_unequal_batch"] = ratio
        notes = [f"HF generate ran on the first {n} prompts only" if n < len(prompts) else "",
                 "" if hf_batch == rows else f"in batches of {hf_batch} against the engine's {rows} rows: "
                 "ratio_at_unequal_batch is no speedup (--hf-prompts >= --batch gives an equal-batch ratio)"]
        if any(notes):
            result["note"] = ", ".join(x for x in notes if x)
        if not a.sampled:
            result["greedy_rows_equal"] = round(sum(x == y for x, y in zip(fast, ref)) / n, 4)
            result["greedy_prefix_share"] = round(sum(_prefix_share(x, y) for x, y in zip(fast, ref)) / n, 4)
    return result


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m harness.lab.bench_generate",
               description=__doc__.splitlines()[0].rstrip(":") + " (see the module's docstring)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--target", help="smollm2, a hub id, a model directory or a .gguf file")
    src.add_argument("--random-weights", help="a preset of harness.protocol.presets (e.g. smollm2-135m)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--prompts", type=int, default=1024, help="GSM8K training questions to answer (default 1024)")
    p.add_argument("--batch", type=int, default=1024, help="rows decoding together (HF: prompts per batch)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="answer budget per prompt (default 256)")
    p.add_argument("--sampled", action="store_true", help="sample (temperature, top-p) instead of greedy")
    p.add_argument("--temperature", type=float, default=0.8, help="with --sampled (default 0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="with --sampled (default 0.95)")
    p.add_argument("--sampler", choices=SAMPLERS, default=DEFAULT_SAMPLER,
                   help="with --sampled, the top-p cut: sort (every row sorted, the reference), threshold (the "
                        "Triton search of core.kernels.topp, no sort), auto (the engine's default: threshold on "
                        "CUDA with Triton, sort elsewhere); the output names the cut that ran")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled draws (default 0)")
    p.add_argument("--hf-prompts", type=int, default=0, help="HF generate on the first N prompts (0: all)")
    p.add_argument("--skip-hf", action="store_true", help="the fast engine alone (no HF run, no ratio)")
    p.add_argument("--check-every", type=int, default=8, help="decode steps between host checks")
    p.add_argument("--bucket", type=int, default=128, help="KV-length bucket of the captured steps")
    p.add_argument("--refill-min", type=int, default=1,
                   help="free rows gathered before a refill's prefill (1: refill at every check)")
    p.add_argument("--attention", choices=("sdpa", "triton", "auto"), default="sdpa",
                   help="the fast engine's decode attention: SDPA over the step's bucket, the Triton kernel over "
                        "each row's own prefix (harness/decode/batched.py), or auto (the training pipeline's "
                        "responses.attention default: Triton on CUDA where it runs); the output names the one run")
    p.add_argument("--profile", action="store_true",
                   help="a third fast run under torch.profiler: kernels and ranges per decode step (not timed)")
    p.add_argument("--out", help="JSON path (default: print only)")
    a = p.parse_args(argv)
    try:
        if min(a.prompts, a.batch, a.max_new_tokens) < 1 or a.hf_prompts < 0:
            raise UsageError("--prompts, --batch and --max-new-tokens must be >= 1, --hf-prompts >= 0")
        if not 1 <= a.refill_min <= a.batch:
            raise UsageError(f"--refill-min {a.refill_min}: use 1..--batch ({a.batch})")
        if a.random_weights:
            from harness.protocol.presets import preset
            preset(a.random_weights)
        if a.attention == "triton":  # the package and the device, before any model loads
            from harness.decode.batched import check_triton
            check_triton(resolve_backend(a.device, a.dtype).device)
        result = measure(a)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = json.dumps({**result, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2)
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        Path(a.out).write_text(text + "\n")
        print(f"[bench_generate] wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
