"""Loading a target: its config first (checked before any weights), then the model, then the Target class of its
family (harness.decode.target for Llama/Qwen/Mistral, harness.decode.gemma4 for Gemma 4)."""
from __future__ import annotations

import os
from pathlib import Path

from core.attention import check_attn_impl
from core.devices import Backend
from harness.decode.gemma4 import FAMILY as GEMMA4, Gemma4Target, check_gemma4
from harness.decode.hf_overrides import apply_overrides, load_kwargs, multimodal_hint
from core.ops import Ops
from harness.decode.target import PLAIN_FAMILIES, Target, check_plain_family
from core.errors import UsageError

SUPPORTED_FAMILIES = PLAIN_FAMILIES + (GEMMA4,)


def split_model_path(spec: str) -> tuple[str, dict]:
    """A local .gguf file loads through transformers' GGUF reader: directory + gguf_file kwarg."""
    if spec.lower().endswith(".gguf"):
        if not os.path.isfile(spec):
            raise UsageError(f"--model-name-or-path {spec}: GGUF file not found")
        return os.path.dirname(os.path.abspath(spec)), {"gguf_file": os.path.basename(spec)}
    return spec, {}


def load_path(spec: str, convert: bool) -> tuple[str, dict]:
    """split_model_path, except that a .gguf file is read from its converted HF directory when there is one
    (harness.decode.gguf_cache; `convert`: make it now if missing). The config check never converts, so nothing
    heavier than a config is read before the checks are done."""
    path, extra = split_model_path(spec)
    if extra:
        from harness.decode import gguf_cache
        converted = gguf_cache.ensure(spec) if convert else gguf_cache.cached(spec)
        if converted:
            return converted, {}
    return path, extra


def check_local(path: str) -> None:
    """A target that can only be a local path and is not there, refused at once (instead of the hub's retries, and
    an error about a repository): absolute or ./, ../, ~ paths, more than owner/name, or owner/name whose first part
    is a folder here (e.g. runs/<config>/... after a training run)."""
    p = Path(path)
    if p.exists():
        return
    parts = p.parts
    under_folder = len(parts) == 2 and Path(parts[0]).is_dir()
    if p.is_absolute() or path.startswith((".", "~")) or len(parts) > 2 or under_folder:
        raise UsageError(f"target {path}: no such file or folder" + (
            f" ({parts[0]}/ is a folder here, so this names a path in it, not a hub id)" if under_folder and
            not p.is_absolute() else ""))


def load_target_config(spec: str, overrides: dict | None = None):
    """Read only the config (cheap) so that compatibility can be checked before any weights are loaded.
    `overrides`: --hf-overrides (harness.decode.hf_overrides), e.g. the text backbone of a multimodal model."""
    from transformers import AutoConfig
    path, extra = load_path(spec, convert=False)
    check_local(path)
    try:
        config = AutoConfig.from_pretrained(path, **extra)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        local = "" if Path(path).exists() else f" ({path} is no local path either)"
        raise UsageError(f"cannot read the target config from {spec!r}: {first}{local}") from None
    config = apply_overrides(config, overrides or {})
    check_family(config)
    return config


def check_family(config) -> None:
    """Whether a target with this config can run here, from the config alone."""
    hint = multimodal_hint(config)
    if hint:
        raise UsageError(hint)
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise UsageError(f"target model_type {family!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}")
    if family == GEMMA4:
        return check_gemma4(config)
    check_plain_family(config)


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer
    path, extra = load_path(spec, convert=True)
    return AutoTokenizer.from_pretrained(path, **extra)


def load_target(spec: str, backend: Backend, capacity: int = 256, taps: tuple[int, ...] = (),
                attn_impl: str = "sdpa", tokenizer=None, overrides: dict | None = None, ops: Ops | None = None):
    """Returns (Target, tokenizer). `spec` is a hub id, a local directory or a local .gguf file; `overrides`:
    --hf-overrides (the config is read and overridden first, then the weights load into it); `ops`: the decode
    math (core.ops, default torch ops)."""
    from transformers import AutoModelForCausalLM
    check_attn_impl(attn_impl)  # before the tokenizer and the weights
    tokenizer = tokenizer or load_tokenizer(spec)
    path, extra = load_path(spec, convert=True)
    if overrides:
        extra = {**extra, "config": load_target_config(spec, overrides), **load_kwargs(overrides)}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=backend.dtype, attn_implementation="sdpa", **extra)
    model.to(backend.device).eval()
    return make_target(model, backend, capacity=capacity, taps=taps, attn_impl=attn_impl, ops=ops), tokenizer


def make_target(model, backend: Backend, capacity: int = 256, taps: tuple[int, ...] = (), attn_impl: str = "sdpa",
                ops: Ops | None = None):
    """The Target class for the model's family (Gemma 4 has its own layer on torch ops, harness.decode.gemma4)."""
    if getattr(model.config, "model_type", None) == GEMMA4:
        return Gemma4Target(model, backend, capacity=capacity, taps=taps, attn_impl=attn_impl)
    return Target(model, backend, capacity=capacity, taps=taps, attn_impl=attn_impl, ops=ops)
