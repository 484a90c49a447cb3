"""The run configuration: argparse <-> a frozen dataclass, with every check that needs no model.

Flag names follow the reference harness where it has them (REFERENCE.md section 1.1).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass

from harness.errors import UsageError


@dataclass(frozen=True)
class RunConfig:
    model_name_or_path: str
    draft_name_or_path: str | None
    dataset: str
    data_dir: str | None = None
    block_size: int | None = None
    max_samples: int | None = None
    max_new_tokens: int = 16384
    max_model_len: int | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    draft_temperature: float | None = None
    draft_noise: str = "gumbel"
    compat_reference: bool = False
    drafter_only: bool = False
    ar_only: bool = False
    skip_ar: bool = False
    answer_file: str | None = None
    no_answer_timing: bool = False
    attn_implementation: str = "sdpa"
    device: str | None = None
    dtype: str | None = None
    seed: int = 0
    xpress_refiner_path: str | None = None
    markov_refiner_path: str | None = None
    xpress_refine_passes: int = 3
    xpress_topc: int = 0
    xpress_prev_anchor: bool = False
    no_fold_mixer: bool = False
    trust_pickle: bool = False
    trace: str | None = None
    use_graph: bool = False
    compile_refiner: bool = False
    fair_interleave: int | None = None      # None: one round; 0: warmup + one round per arm; N: N rounds
    fair_k_list: str | None = None
    fair_warmup_rounds: int = 1
    results_dir: str = "results"
    run_id: str | None = None
    resume: str | None = None
    first_turn_only: bool = False
    random_weights: str | None = None
    scripted_accept: int | None = None
    compile_all: bool = False
    explain: bool = False                   # print the conventions block after the table (always in the folder's README)
    fp32_logits: bool = False               # verify/lm_head logits in float32 (ties of bf16 logits; costs a wider matmul)
    record_logit_gaps: bool = False         # top-2 logit gap of every token in the rows (a top-2 per step, timed)
    kernels: str = "auto"
    compile_backend: str = "inductor"
    refine_numerics: str = "standard"         # standard | spyre (refiners.spyre_numerics)
    max_num_batched_tokens: int | None = None  # Spyre token budget per step (default 64)
    hf_overrides: str | None = None           # JSON merged into the target config (harness.decode.hf_overrides)
    given: tuple[str, ...] = ()               # the flags set on the command line (explicit beats checkpoint)

    @property
    def fair(self) -> bool:
        return self.fair_interleave is not None

    @property
    def k_list(self) -> list[int]:
        if self.fair_k_list is None:
            return [self.xpress_refine_passes]
        return [int(k) for k in self.fair_k_list.split(",") if k.strip()]

    @property
    def run_ar(self) -> bool:
        return not self.skip_ar

    @property
    def run_spec(self) -> bool:
        return not self.ar_only

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmark_compile_all.py",
                                description="Speculative-decoding benchmark: HF target + dFlash drafter.")
    a = p.add_argument
    a("--model-name-or-path", help="target: HF repo id, local directory, or local .gguf file")
    a("--draft-name-or-path", help="dFlash drafter directory (config.json + *.safetensors); not needed with --ar-only")
    a("--dataset", required=True, help="benchmark name, or NAME of DIR/NAME.jsonl with --data-dir")
    a("--data-dir", help="directory of JSONL files with a 'turns' list per row (e.g. shared/data/eval)")
    a("--block-size", type=int, help="block B = anchor + B-1 drafts; default: the drafter's block_size")
    a("--max-samples", type=int, help="subset: shuffle(seed=0) then the first N when the dataset is larger")
    a("--max-new-tokens", type=int, default=16384, help="generation budget per turn")
    a("--max-model-len", type=int, help="context limit in tokens; default: the target's max_position_embeddings")
    a("--temperature", type=float, default=0.0, help="target sampling temperature; < 1e-5 is greedy")
    a("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off); applied to p and to q")
    a("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off); applied to p and to q")
    a("--draft-temperature", type=float, help="temperature of the drafts (default: --temperature)")
    a("--draft-noise", default="gumbel", choices=["gumbel", "uniform"],
      help="frozen per-block draft noise: Gumbel-max (the reference) or one inverse-CDF uniform per slot")
    a("--compat-reference", action="store_true",
      help="reproduce the reference harness's quirks: one global random stream, an extra step after an EOS "
           "bonus, unclipped tau entries, decode timer started after the first drafting, first token counted, "
           "stops on the tokenizer's eos only")
    a("--drafter-only", action="store_true", help="speculative arm uses the drafter's own draft (no refiner, K=0)")
    a("--ar-only", action="store_true", help="run only the autoregressive baseline (block 1)")
    a("--skip-ar", action="store_true", help="run only the speculative arm")
    a("--answer-file", help="write per-sample JSONL results here")
    a("--no-answer-timing", action="store_true",
      help="leave timings and timestamps out of the answer file, so seeded runs can be compared byte for byte")
    a("--attn-implementation", default="sdpa", help="attention kernel: sdpa (default) or eager")
    a("--device", help="cpu, cuda, cuda:N or spyre (IBM Spyre through torch-spyre; default: cuda if available)")
    a("--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on CUDA, float32 on CPU)")
    a("--seed", type=int, default=0, help="seed of the per-(prompt, turn) random streams")
    r = p.add_argument_group("refiners")
    r.add_argument("--xpress-refiner-path", help="xPress checkpoint: co-training .pt, serving directory, HF id "
                   "user/repo or user/repo:file (default: env XPRESS_CKPT)")
    r.add_argument("--markov-refiner-path", help="Markov-head checkpoint, same forms (default: env MK_CKPT)")
    r.add_argument("--xpress-refine-passes", type=int, default=3, help="K Jacobi passes; 0 = drafter-only")
    r.add_argument("--xpress-topc", type=int, default=0,
                   help="score only each slot's top-C base candidates (1..min(1024, V)); 0 = full vocabulary")
    r.add_argument("--refine-numerics", choices=("standard", "spyre"), default="standard",
                   help="spyre: the xPress shortlist refinement as Spyre runs it (CPU top-k of the base logits, FP16 "
                        "per-pass scores on the device, first-position ties, candidate embeddings cached per block); "
                        "plain torch, any device")
    r.add_argument("--max-num-batched-tokens", type=int,
                   help="Spyre: token slots per scheduler step (default 64); a request needs >= 31 at block 16")
    r.add_argument("--hf-overrides", metavar="JSON",
                   help='JSON merged into the target config before loading, e.g. \'{"text_config": {...}}\' or '
                        '\'{"text_only": true}\' (Gemma 4: load the text backbone only, the default)')
    r.add_argument("--xpress-prev-anchor", action="store_true",
                   help="slot 0's predecessor is the anchor itself (vLLM/Spyre convention), not the true token")
    r.add_argument("--no-fold-mixer", action="store_true", help="keep the xPress mixer unfolded (L*tril, + I)")
    r.add_argument("--trust-pickle", action="store_true",
                   help="load a .pt checkpoint with full pickle (only for files you trust)")
    r.add_argument("--trace", help="write one JSON line per decode step (draft, seed, accepted, next token)")
    r.add_argument("--use-graph", action="store_true",
                   help="CUDA: capture every decode step (draft, refine, verify, accept) as one CUDA graph per "
                        "arm, width and 256-slot KV bucket, replayed with one host read per step")
    r.add_argument("--compile-refiner", action="store_true", help="torch.compile the refinement step")
    r.add_argument("--kernels", choices=("auto", "triton", "torch"), default="auto",
                   help="target decode steps on harness.decode.kernels' Triton kernels (triton) or torch ops; auto: "
                        "triton on CUDA in bf16/fp16 where Triton is installed and the target fits")
    r.add_argument("--compile-all", action="store_true",
                   help="torch.compile what still runs as small torch ops where that measured faster (the xPress "
                        "refinement; target and drafter layers run on harness.decode.kernels); reports compile seconds and "
                        "graph count, fails on any recompile after warmup")
    r.add_argument("--compile-backend", default="inductor", choices=("inductor", "aot_eager", "eager"),
                   help="torch.compile backend for --compile-refiner/--compile-all")
    t = p.add_argument_group("timing at real shapes")
    t.add_argument("--random-weights", metavar="PRESET",
                   help="random target, drafter and heads at real shapes (qwen3-8b, smollm2-135m, tiny); prompts "
                        "are byte-tokenised, no stop ids; results are labelled random weights / scripted acceptance")
    t.add_argument("--scripted-accept", type=int, metavar="N",
                   help="force N accepted drafts per step (compute unchanged) to time steps at any tau")
    f = p.add_argument_group("paired protocol and results")
    f.add_argument("--fair-interleave", type=int, nargs="?", const=0, metavar="ROUNDS",
                   help="paired rounds over every arm (AR, drafter-only, Markov, xPress per K), rotated each round; "
                        "ROUNDS defaults to warmup + number of arms")
    f.add_argument("--fair-k-list", help="xPress K values as one arm each, e.g. 4,5,6,7 (default: --xpress-refine-passes)")
    f.add_argument("--fair-warmup-rounds", type=int, default=1, help="rounds run but excluded from statistics")
    f.add_argument("--results-dir", default="results", help="run folders are written under this directory")
    f.add_argument("--run-id", help="name of the run folder (default: dataset, temperature and a timestamp)")
    f.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run in this folder")
    f.add_argument("--first-turn-only", action="store_true", help="skip later turns (only turn 1 is measured)")
    f.add_argument("--explain", action="store_true",
                   help="print the conventions of every number after the table (they are always in the results "
                        "folder's README.md)")
    r.add_argument("--record-logit-gaps", action="store_true",
                   help="store the target's top-2 logit gap of every token, so each divergence from AR is reported "
                        "with its gap in both runs (one top-2 per step inside the timer: the run is labelled)")
    r.add_argument("--fp32-logits", action="store_true",
                   help="compute the target's lm_head logits in float32 (bf16 logits tie where the top-2 gap is "
                        "below their rounding; costs a float32 lm_head matmul per step)")
    return p


def parse_args(argv: list[str] | None = None) -> RunConfig:
    ns = build_parser().parse_args(argv)
    from harness.protocol.spyre_contract import given_flags
    ns.given = given_flags(build_parser, argv)
    cfg = RunConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(RunConfig)})
    validate(cfg)
    return cfg


def validate(c: RunConfig) -> None:
    """Everything that can be wrong without reading a model."""
    if c.ar_only and c.skip_ar:
        raise UsageError("--ar-only and --skip-ar exclude each other; pick one")
    if c.random_weights:
        from harness.protocol.presets import preset
        preset(c.random_weights)
        if c.model_name_or_path or c.draft_name_or_path or c.xpress_refiner_path or c.markov_refiner_path:
            raise UsageError("--random-weights builds every model itself; drop the model and checkpoint paths")
    else:
        if not c.model_name_or_path:
            raise UsageError("--model-name-or-path is required (or --random-weights PRESET for timing)")
        if not c.ar_only and not c.draft_name_or_path:
            raise UsageError("--draft-name-or-path is required unless --ar-only is given")
    if c.scripted_accept is not None and c.scripted_accept < 0:
        raise UsageError(f"--scripted-accept {c.scripted_accept}: must be >= 0")
    from harness.protocol.spyre_contract import check_run, is_spyre
    if is_spyre(c.device):
        check_run(c)
    if c.hf_overrides is not None:
        from harness.decode.hf_overrides import parse_overrides
        parse_overrides(c.hf_overrides)
    if c.refine_numerics == "spyre" and (c.draft_temperature if c.draft_temperature is not None
                                         else c.temperature) >= 1e-5:
        raise UsageError("--refine-numerics spyre selects greedily (Spyre drafts are greedy); use "
                         "--draft-temperature 0 (the target may still sample)")
    if c.refine_numerics == "spyre" and c.xpress_topc == 0 and not is_spyre(c.device):
        raise UsageError("--refine-numerics spyre scores a shortlist; pass --xpress-topc 1..1024 (Spyre uses 512)")
    if c.kernels == "triton":
        from harness.decode import kernels
        if not kernels.available():
            raise UsageError("--kernels triton: Triton is not installed; install triton or use --kernels torch")
        if c.device is not None and not c.device.startswith("cuda"):
            raise UsageError(f"--kernels triton runs on CUDA only, not --device {c.device}; use --kernels torch")
        if c.attn_implementation == "eager":
            raise UsageError("--kernels triton brings its own attention; --attn-implementation eager needs "
                             "--kernels torch")
    if c.block_size is not None and c.block_size < 2:
        raise UsageError(f"--block-size {c.block_size}: a speculative block needs >= 2 (anchor + drafts); "
                         "use --ar-only for plain decoding")
    if c.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {c.max_new_tokens}: must be >= 1")
    if c.max_model_len is not None and c.max_model_len < 2:
        raise UsageError(f"--max-model-len {c.max_model_len}: must be >= 2")
    if c.temperature < 0:
        raise UsageError(f"--temperature {c.temperature}: must be >= 0")
    if c.draft_temperature is not None and c.draft_temperature < 0:
        raise UsageError(f"--draft-temperature {c.draft_temperature}: must be >= 0")
    if c.top_k < 0:
        raise UsageError(f"--top-k {c.top_k}: must be >= 0 (0 = off)")
    if not 0 < c.top_p <= 1:
        raise UsageError(f"--top-p {c.top_p}: must be in (0, 1] (1 = off)")
    if c.attn_implementation not in ("sdpa", "eager"):
        raise UsageError(f"--attn-implementation {c.attn_implementation!r}: use sdpa or eager "
                         "(flash_attention_2 is not wired into the harness's own attention)")
    if c.xpress_refine_passes < 0:
        raise UsageError(f"--xpress-refine-passes {c.xpress_refine_passes}: must be >= 0 (0 = drafter-only)")
    if c.xpress_topc < 0 or c.xpress_topc > 1024:
        raise UsageError(f"--xpress-topc {c.xpress_topc}: use 0 (full vocabulary) or 1..1024")
    if c.ar_only and (c.xpress_refiner_path or c.markov_refiner_path):
        raise UsageError("--ar-only runs no drafter; drop the refiner paths or --ar-only")
    if c.fair_k_list is not None:
        try:
            ks = c.k_list
        except ValueError:
            raise UsageError(f"--fair-k-list {c.fair_k_list!r}: use comma-separated integers, e.g. 4,5,6,7") from None
        if not ks:
            raise UsageError("--fair-k-list is empty; give at least one K, e.g. 4,5,6,7")
        if any(k < 1 for k in ks):
            raise UsageError(f"--fair-k-list {c.fair_k_list}: every K must be >= 1 (K=0 is the drafter-only arm, "
                             "which the protocol runs anyway)")
    if c.fair and c.drafter_only:
        raise UsageError("--drafter-only with --fair-interleave: the paired protocol already runs a drafter-only arm")
    if c.fair and c.ar_only:
        raise UsageError("--ar-only with --fair-interleave: the protocol compares arms; drop one")
    if c.fair_warmup_rounds < 0:
        raise UsageError(f"--fair-warmup-rounds {c.fair_warmup_rounds}: must be >= 0")
    if c.fair_interleave is not None and c.fair_interleave < 0:
        raise UsageError(f"--fair-interleave {c.fair_interleave}: must be >= 1 (or given without a value)")
    for path in (c.answer_file, c.trace):
        if path:
            check_writable(path)
    check_results_dir(c.resume or c.results_dir, must_exist=bool(c.resume))


def check_results_dir(path: str, must_exist: bool) -> None:
    """The results folder (or the nearest existing parent) must be writable before anything runs."""
    if must_exist and not os.path.isdir(path):
        raise UsageError(f"--resume {path}: no such run folder")
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK):
        raise UsageError(f"results folder {path}: {probe} is not a writable directory; pass --results-dir")


def check_writable(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{path}: folder {folder} is not writable")

