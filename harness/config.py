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
    drafter_only: bool = False
    ar_only: bool = False
    skip_ar: bool = False
    answer_file: str | None = None
    attn_implementation: str = "sdpa"
    device: str | None = None
    dtype: str | None = None
    seed: int = 0

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
    a("--model-name-or-path", required=True, help="target: HF repo id, local directory, or local .gguf file")
    a("--draft-name-or-path", help="dFlash drafter directory (config.json + *.safetensors); not needed with --ar-only")
    a("--dataset", required=True, help="benchmark name, or NAME of DIR/NAME.jsonl with --data-dir")
    a("--data-dir", help="directory of JSONL files with a 'turns' list per row (e.g. shared/data/eval)")
    a("--block-size", type=int, help="block B = anchor + B-1 drafts; default: the drafter's block_size")
    a("--max-samples", type=int, help="subset: shuffle(seed=0) then the first N when the dataset is larger")
    a("--max-new-tokens", type=int, default=16384, help="generation budget per turn")
    a("--max-model-len", type=int, help="context limit in tokens; default: the target's max_position_embeddings")
    a("--temperature", type=float, default=0.0, help="target sampling temperature; < 1e-5 is greedy")
    a("--drafter-only", action="store_true", help="speculative arm uses the drafter's own draft (no refiner, K=0)")
    a("--ar-only", action="store_true", help="run only the autoregressive baseline (block 1)")
    a("--skip-ar", action="store_true", help="run only the speculative arm")
    a("--answer-file", help="write per-sample JSONL results here")
    a("--attn-implementation", default="sdpa", help="attention kernel: sdpa (default) or eager")
    a("--device", help="cpu, cuda or cuda:N (default: cuda if available)")
    a("--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on CUDA, float32 on CPU)")
    a("--seed", type=int, default=0, help="seed of the per-(prompt, turn) random streams")
    return p


def parse_args(argv: list[str] | None = None) -> RunConfig:
    ns = build_parser().parse_args(argv)
    cfg = RunConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(RunConfig)})
    validate(cfg)
    return cfg


def validate(c: RunConfig) -> None:
    """Everything that can be wrong without reading a model."""
    if c.ar_only and c.skip_ar:
        raise UsageError("--ar-only and --skip-ar exclude each other; pick one")
    if not c.ar_only and not c.draft_name_or_path:
        raise UsageError("--draft-name-or-path is required unless --ar-only is given")
    if c.block_size is not None and c.block_size < 2:
        raise UsageError(f"--block-size {c.block_size}: a speculative block needs >= 2 (anchor + drafts); "
                         "use --ar-only for plain decoding")
    if c.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {c.max_new_tokens}: must be >= 1")
    if c.max_model_len is not None and c.max_model_len < 2:
        raise UsageError(f"--max-model-len {c.max_model_len}: must be >= 2")
    if c.temperature < 0:
        raise UsageError(f"--temperature {c.temperature}: must be >= 0")
    if c.attn_implementation not in ("sdpa", "eager"):
        raise UsageError(f"--attn-implementation {c.attn_implementation!r}: use sdpa or eager "
                         "(flash_attention_2 is not wired into the harness's own attention)")
    if c.answer_file:
        folder = os.path.dirname(os.path.abspath(c.answer_file))
        if not os.path.isdir(folder):
            raise UsageError(f"--answer-file {c.answer_file}: folder {folder} does not exist")
        if not os.access(folder, os.W_OK):
            raise UsageError(f"--answer-file {c.answer_file}: folder {folder} is not writable")
