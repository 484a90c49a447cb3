"""--hf-overrides: a JSON object merged into the target's HF config before anything loads (vLLM's flag of the same
name), and the text-backbone selection of multimodal targets.

A multimodal checkpoint such as google/gemma-4-26B-A4B-it (Gemma4ForConditionalGeneration: vision and audio towers
around a text decoder) is served text-only by naming the text architecture, as with vLLM:
    --hf-overrides '{"architectures": ["Gemma4ForCausalLM"]}'
Then the config becomes its `text_config` (plus any other override keys), and the weights load from the
checkpoint's `model.language_model.*` tensors into the text model's `model.*`; the towers are never built.
"""
from __future__ import annotations

import json

from core.errors import UsageError

# text architecture -> the prefix of its tensors inside the multimodal checkpoint
TEXT_BACKBONES = {"Gemma4ForCausalLM": "model.language_model."}


def parse_overrides(text: str | None) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--hf-overrides is not valid JSON ({e.msg} at column {e.colno}); pass an object, e.g. "
                         "'{\"architectures\": [\"Gemma4ForCausalLM\"]}'") from None
    if not isinstance(value, dict):
        raise UsageError(f"--hf-overrides must be a JSON object, got {type(value).__name__}")
    return value


def text_architecture(overrides: dict) -> str | None:
    arch = overrides.get("architectures")
    if isinstance(arch, list) and len(arch) == 1 and arch[0] in TEXT_BACKBONES:
        return arch[0]
    return None


def apply_overrides(config, overrides: dict):
    """The config to build the target from: the text backbone when asked for, then every other key merged in
    (a nested `text_config` object merges into the text config)."""
    if not overrides:
        return config
    arch = text_architecture(overrides)
    rest = {k: v for k, v in overrides.items() if k != "architectures" or arch is None}
    if arch is not None:
        text = getattr(config, "text_config", None)
        if text is None:
            raise UsageError(f"--hf-overrides asks for {arch}, but the target config has no text_config "
                             "(it already is a text model): drop the architectures override")
        config = text
        config.architectures = [arch]
        rest = {**rest.pop("text_config", {}), **rest}
    for key, value in rest.items():
        sub = getattr(config, key, None)
        if isinstance(value, dict) and hasattr(sub, "to_dict"):
            for k, v in value.items():
                setattr(sub, k, v)
        else:
            setattr(config, key, value)
    return config


def load_kwargs(overrides: dict) -> dict:
    """Extra from_pretrained arguments: the tensor renaming that loads a text backbone out of its wrapper."""
    arch = text_architecture(overrides)
    if arch is None:
        return {}
    return {"key_mapping": {"^" + TEXT_BACKBONES[arch].replace(".", r"\."): "model."}}


def multimodal_hint(config) -> str | None:
    """Why a multimodal config cannot be the target as it stands, with the flag that fixes it."""
    if getattr(config, "text_config", None) is None:
        return None
    archs = [a for a, _ in TEXT_BACKBONES.items()
             if a.lower().startswith(str(getattr(config, "model_type", "")).lower().replace("_", ""))]
    arch = archs[0] if archs else "<TextArchitecture>"
    return (f"target {getattr(config, 'model_type', '?')!r} is multimodal; load its text backbone with "
            f"--hf-overrides '{{\"architectures\": [\"{arch}\"]}}'")
