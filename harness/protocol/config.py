"""The run configuration: a frozen dataclass, and every check that needs no model.

The flags that fill it, and `parse_args`, are in harness.protocol.flags (names follow the xPress paper's reference
harness where it has the flag: --model-name-or-path, --draft-name-or-path, --fair-interleave, ...).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from core.attention import check_attn_impl
from core.errors import UsageError


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
    cotrained_drafter_only: bool = False      # paired rounds: each refiner's co-trained drafter alone, one arm each
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
    reference_dtype: str = "auto"            # T=0: AR against an untimed AR in this dtype (auto: float32 if embedded)
    kernels: str = "auto"
    batch_invariant: bool = False             # Triton kernels that compute a row alike at any verify width (issue 28)
    compile_backend: str = "inductor"
    refine_numerics: str = "standard"         # standard | spyre (refiners.spyre_numerics)
    max_num_batched_tokens: int | None = None  # Spyre token budget per step (default 64)
    hf_overrides: str | None = None           # JSON merged into the target config (harness.decode.hf_overrides)
    given: tuple[str, ...] = ()               # the flags set on the command line (explicit beats checkpoint)
    preset: str | None = None                 # the setup that filled untyped settings (harness.protocol.setups)
    quiet: bool = False
    batch_sizes: str | None = None            # --batch-sizes 1,2,4: a sweep (harness.protocol.sweep)
    context_lengths: str | None = None        # --context-lengths 0,1024: a sweep
    refill: bool = False                      # --refill: the sweep's batches refill freed rows (continuous)

    @property
    def fair(self) -> bool:
        return self.fair_interleave is not None

    @property
    def k_list(self) -> list[int]:
        if self.fair_k_list is None:
            return [self.xpress_refine_passes]
        return [int(k) for k in self.fair_k_list.split(",") if k.strip()]

    @property
    def draft_temperature_used(self) -> float:
        """The drafts' temperature the decode runs at: --draft-temperature, else --temperature
        (harness.decode.loop.DecodeSettings.draft_params)."""
        return self.temperature if self.draft_temperature is None else self.draft_temperature

    @property
    def run_ar(self) -> bool:
        return not self.skip_ar

    @property
    def run_spec(self) -> bool:
        return not self.ar_only


# typed flags that only a refiner arm, or only a drafter, reads (--draft-temperature is left out: the bench script
# passes it on every run)
REFINER_FLAGS = ("xpress_topc", "xpress_prev_anchor", "no_fold_mixer", "compile_refiner", "refine_numerics")
DRAFTER_FLAGS = ("block_size", "draft_noise", "scripted_accept")


def validate(c: RunConfig) -> None:
    """Everything that can be wrong without reading a model."""
    if c.ar_only and c.skip_ar:
        raise UsageError("--ar-only and --skip-ar exclude each other; pick one")
    if not c.resume:  # a folder started before these checks resumes as it ran (it cannot drop a saved flag)
        check_no_effect(c)
    if c.random_weights:
        from harness.protocol.presets import preset
        preset(c.random_weights)
        if c.model_name_or_path or c.draft_name_or_path or c.xpress_refiner_path or c.markov_refiner_path:
            raise UsageError("--random-weights builds every model itself; drop the model and checkpoint paths")
    else:
        if not c.model_name_or_path:
            raise UsageError("--model-name-or-path is required here (leave it out with no --preset for the embedded "
                             "default, or use --random-weights PRESET for timing)")
        if not c.ar_only and not c.draft_name_or_path:
            raise UsageError("--draft-name-or-path is required unless --ar-only is given")
    if not c.dataset:
        raise UsageError("--dataset is required when models are named (e.g. --dataset gsm8k); "
                         "python benchmark_compile_all.py --help lists the hub datasets")
    for flag, x in (("--temperature", c.temperature), ("--draft-temperature", c.draft_temperature),
                    ("--top-p", c.top_p)):
        if x is not None and not math.isfinite(x):  # flags.finite refuses it typed; this, from a config.json
            raise UsageError(f"{flag} {x}: must be a finite number, e.g. {flag} 0.7")
    if c.reference_dtype not in ("auto", "float32", "none"):
        raise UsageError(f"--reference-dtype {c.reference_dtype!r}: use auto, float32 or none")
    if c.reference_dtype == "float32" and c.temperature >= 1e-5:
        raise UsageError("--reference-dtype float32 compares AR's greedy text and needs --temperature 0; drop it")
    if c.scripted_accept is not None and c.scripted_accept < 0:
        raise UsageError(f"--scripted-accept {c.scripted_accept}: must be >= 0")
    from harness.protocol.spyre_contract import check_run, is_spyre
    if is_spyre(c.device):
        check_run(c)
    if not c.random_weights:  # after the Spyre contract, which refuses a GGUF whether or not it exists
        check_model_path("--model-name-or-path", c.model_name_or_path)
        if c.run_spec:
            check_model_path("--draft-name-or-path", c.draft_name_or_path)
    if c.hf_overrides is not None and c.random_weights:
        raise UsageError(f"--hf-overrides changes a loaded target's config; --random-weights {c.random_weights} "
                         "builds every model from its preset (harness/protocol/presets.py): drop --hf-overrides")
    if c.hf_overrides is not None:
        from harness.decode.hf_overrides import parse_overrides
        parse_overrides(c.hf_overrides)
    if c.refine_numerics == "spyre" and (c.draft_temperature if c.draft_temperature is not None
                                         else c.temperature) >= 1e-5:
        raise UsageError("--refine-numerics spyre selects greedily (Spyre drafts are greedy); use "
                         "--draft-temperature 0 (the target may still sample)")
    if c.refine_numerics == "spyre" and c.use_graph:
        raise UsageError("--refine-numerics spyre copies to the host inside every step, which a CUDA graph cannot "
                         "capture; add --no-use-graph")
    if c.refine_numerics == "spyre" and c.xpress_topc == 0 and not is_spyre(c.device):
        raise UsageError("--refine-numerics spyre scores a shortlist; pass --xpress-topc 1..1024 (Spyre uses 512)")
    if c.kernels == "triton":
        from core.ops import triton_installed
        if not triton_installed():
            raise UsageError("--kernels triton: Triton is not installed; install triton or use --kernels torch")
        if c.device is not None and not c.device.startswith("cuda"):
            raise UsageError(f"--kernels triton runs on CUDA only, not --device {c.device}; use --kernels torch")
        if c.attn_implementation == "eager":
            raise UsageError("--kernels triton brings its own attention; --attn-implementation eager needs "
                             "--kernels torch")
    if c.batch_invariant and c.kernels != "triton":
        raise UsageError(f"--batch-invariant fixes the Triton kernels' tiles; it needs --kernels triton (not "
                         f"{c.kernels}), or drop --batch-invariant")
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
    check_attn_impl(c.attn_implementation)
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
        twice = sorted({k for k in ks if ks.count(k) > 1})
        if twice:
            raise UsageError(f"--fair-k-list {c.fair_k_list}: K={','.join(map(str, twice))} is listed twice (two arms "
                             "of one name); list each K once")
    ignored = [f"--{k.replace('_', '-')}" for k in ("fair_k_list", "fair_warmup_rounds") if k in c.given]
    if ignored and not c.fair:
        raise UsageError(f"{' and '.join(ignored)} {'take' if len(ignored) > 1 else 'takes'} effect only with "
                         "--fair-interleave (the paired rounds); add --fair-interleave or drop "
                         f"{'them' if len(ignored) > 1 else 'it'}")
    if c.fair and c.fair_k_list is None and c.xpress_refine_passes == 0 and c.xpress_refiner_path:
        raise UsageError("--xpress-refine-passes 0 in the paired protocol would add an xPress arm at K=0, the "
                         "drafter-only arm it runs anyway; give K >= 1 (or --fair-k-list), or drop the xPress head")
    if c.fair and c.drafter_only and (c.xpress_refiner_path or c.markov_refiner_path):
        raise UsageError(drafter_only_conflict(c))
    if c.fair and c.ar_only:
        raise UsageError("--ar-only with --fair-interleave: the protocol compares arms; drop one")
    if c.cotrained_drafter_only:
        check_cotrained_drafter_only(c)
    if c.fair_warmup_rounds < 0:
        raise UsageError(f"--fair-warmup-rounds {c.fair_warmup_rounds}: must be >= 0")
    if c.fair_interleave is not None and c.fair_interleave < 0:
        raise UsageError(f"--fair-interleave {c.fair_interleave}: must be >= 1 (or given without a value)")
    from harness.protocol import sweep_points
    if sweep_points.is_sweep(c):
        sweep_points.check(c)
    elif c.refill:
        raise UsageError("--refill is a sweep's batching: give it with --batch-sizes (e.g. --batch-sizes 1,4,16)")
    if c.run_id is not None and (c.run_id in ("", ".", "..") or any(ch in c.run_id for ch in "/\\\0")):
        raise UsageError(f"--run-id {c.run_id!r}: must be a plain folder name (no /, no .., not empty), made inside "
                         "--results-dir; name the parent folder with --results-dir instead")
    for flag, path, example in (("--answer-file", c.answer_file, "answers.jsonl"), ("--trace", c.trace, "trace.jsonl")):
        if path:
            check_writable(path, flag, example)
    check_results_dir(c.resume or c.results_dir, must_exist=bool(c.resume), flag="--resume" if c.resume else
                      "--results-dir")


def check_cotrained_drafter_only(c: RunConfig) -> None:
    """--cotrained-drafter-only adds, to the paired rounds, each refiner checkpoint's own co-trained drafter run alone
    (harness.protocol.build.cotrained_arms; whether a checkpoint carries one is known once its header is read)."""
    if not c.fair:
        raise UsageError("--cotrained-drafter-only adds arms to the paired rounds: add --fair-interleave (outside them, "
                         "--drafter-only with a refiner path already runs that refiner's co-trained drafter, where it "
                         "carries one)")
    if c.random_weights:
        raise UsageError("--cotrained-drafter-only: --random-weights builds one drafter and no refiner carries its own; "
                         "drop one of them")
    if not (c.xpress_refiner_path or c.markov_refiner_path):
        raise UsageError("--cotrained-drafter-only runs a refiner checkpoint's own drafter alone, and no refiner is "
                         "given; pass --xpress-refiner-path or --markov-refiner-path, or drop the flag")
    if c.batch_sizes or c.context_lengths:
        raise UsageError("--cotrained-drafter-only is not part of the sweeps (--batch-sizes, --context-lengths) yet; "
                         "run it as a single point without them")


def drafter_only_conflict(c: RunConfig) -> str:
    """--drafter-only runs AR against the drafter alone; under the paired protocol a refiner's arms would run too.
    The line names what the user typed and where the rest came from (a setup, the environment)."""
    given = set(c.given)
    paths = [f"--{k.replace('_', '-')}" if k in given else f"${env}"
             for k, env in (("xpress_refiner_path", "XPRESS_CKPT"), ("markov_refiner_path", "MK_CKPT"))
             if getattr(c, k)]
    return (f"--drafter-only compares AR with the drafter alone, but {' and '.join(paths)} "
            f"{'add' if len(paths) > 1 else 'adds'} refiner arms to the paired rounds{'' if 'fair_interleave' in given else ' (the setup runs the paired protocol)'}; "
            "drop the refiner (an empty env variable drops it) or drop --drafter-only to compare every arm")


def check_results_dir(path: str, must_exist: bool, flag: str = "--results-dir") -> None:
    """The results folder (or the nearest existing parent) must be writable before anything runs; a failure says
    what is wrong with the path given (`flag` names where it came from)."""
    if must_exist and not os.path.isdir(path):
        raise UsageError(f"--resume {path}: no such run folder")
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UsageError(f"{flag} {path}: {probe} is a file, not a folder; move it away or name another folder")
    if not _can_write(probe):
        raise UsageError(f"{flag} {path}: {probe} is not a writable directory (no permission, or a read-only file "
                         "system); name a folder you can write to")


def _can_write(folder: str) -> bool:
    """A real write, not os.access: root passes every permission check, and read-only mounts or pseudo file
    systems (/proc) refuse the write anyway; that must be found before the models load, not after."""
    import tempfile
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".xpress-bench-probe-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def looks_local(spec: str) -> bool:
    """A path, not a hub id (`user/repo` or a bare name): starts with / . ~, ends in .gguf, or has two slashes."""
    return spec.startswith(("/", ".", "~")) or spec.endswith(".gguf") or spec.count("/") > 1 or "\\" in spec


def check_model_path(flag: str, spec: str) -> None:
    if looks_local(spec) and not os.path.exists(os.path.expanduser(spec)):
        raise UsageError(f"{flag} {spec}: no such path (a local directory or .gguf file must exist; a hub id "
                         "has the form user/repo)")


def check_no_effect(c: RunConfig) -> None:
    """Typed flags that the run would drop or never read: refused, so that a run does what its command says."""
    if c.ar_only:  # each of these selects a drafter's arm, which --ar-only would drop without a word
        chosen = [flag for flag, on in (("--drafter-only", c.drafter_only), ("--cotrained-drafter-only",
                  c.cotrained_drafter_only), ("--xpress-refine-passes", "xpress_refine_passes" in c.given),
                  ("--fair-k-list", c.fair_k_list is not None)) if on]
        if chosen:
            raise UsageError(f"--ar-only and {' and '.join(chosen)} exclude each other (--ar-only runs AR alone, no "
                             "drafter); pick one")
    idle = [f"--{k.replace('_', '-')}" for k in (REFINER_FLAGS + DRAFTER_FLAGS if c.ar_only else REFINER_FLAGS
                                                  if c.drafter_only else ()) if k in c.given]
    if idle:  # typed, and nothing in the run reads them
        mode = "--ar-only runs AR alone" if c.ar_only else "--drafter-only runs no refiner"
        raise UsageError(f"{' and '.join(idle)} would have no effect: {mode}; drop {'them' if idle[1:] else 'it'} "
                         f"or {mode.split()[0]}")
    ks = [f"--{k.replace('_', '-')} {getattr(c, k)}" for k in ("fair_k_list", "xpress_refine_passes")
          if c.drafter_only and k in c.given and getattr(c, k)]  # a typed K for the arm it runs without (K=0 is it)
    if ks:
        raise UsageError(f"{' and '.join(ks)} set{'s' * (len(ks) == 1)} xPress's K, and --drafter-only runs no xPress "
                         "arm (K=0); drop one of them")
    if c.record_logit_gaps and c.temperature >= 1e-5:  # at T > 0 no divergence from AR is checked (divergence.py)
        raise UsageError("--record-logit-gaps reports each divergence from AR's greedy text with its logit gaps and "
                         "needs --temperature 0 (at T > 0 the texts differ by design, none is reported); drop it")
    if c.draft_noise != "gumbel" and c.draft_temperature_used < 1e-5:
        raise UsageError(f"--draft-noise {c.draft_noise} is the noise of sampled drafts, and the drafts here are "
                         "greedy (draft temperature 0): it changes nothing; give --draft-temperature > 0 (or "
                         "--temperature > 0), or drop it")


def check_writable(path: str, flag: str, example: str) -> None:
    """An output file's folder must exist and be writable, and the path must not be a folder itself (writing it
    failed only after the whole run)."""
    if os.path.isdir(path) or path.endswith(os.sep):  # a trailing separator names a folder, new or not
        raise UsageError(f"{flag} {path}: names a directory, and {flag} takes a file; name one inside it, e.g. "
                         f"{flag} {os.path.join(path, example)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: folder {folder} does not exist; create it, or name a file in a folder that "
                         "does")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path}: folder {folder} is not writable; name a file in a folder you can write")
