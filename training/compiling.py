"""What torch.compile covers in a training step (`train.compile`).

speculators 0.9.0 decorates every speculator's `forward` with `conditional_torch_compile` (torch.compile whenever
CUDA is available), so the whole step (five draft layers, the anchors, the loss over a 49152-word vocabulary)
compiles on its first call. On the H200 that first step took 248.7 s of a 256.9 s box on a cold cache
(results/perf/training_box_h200.json), once per process and model. The choices:

* "model": speculators as it is (the whole forward compiled).
* "attention": the forward runs eagerly and only flex attention is compiled, alone (its kernels; the block masks
  are compiled by speculators already). Eager flex attention would fall back to a dense reference that builds the
  whole score matrix. Every batch is padded to `train.total_seq_len`, so the shapes never change.
* "none": nothing compiled (what a CPU gets anyway).
* "auto": "attention" on CUDA, "none" elsewhere.
"""
from __future__ import annotations

import types

MODES = ("auto", "model", "attention", "none")


def resolve(mode: str, device_type: str) -> str:
    if mode == "auto":
        return "attention" if device_type == "cuda" else "none"
    return mode


def eager_forward(model) -> bool:
    """Bind the undecorated forward of speculators' compiled one to `model`; False when it was not compiled."""
    orig = getattr(type(model).forward, "_torchdynamo_orig_callable", None)
    if orig is None:
        return False
    model.forward = types.MethodType(orig, model)
    return True


_COMPILED_FLEX = None


def compile_attention_only() -> None:
    """speculators' flex attention forward calls the module-level `flex_attention` of speculators.models.attention
    (0.9.0); it is replaced there by one compiled function, shared by every model of the process."""
    global _COMPILED_FLEX
    import torch
    import speculators.models.attention as attention
    from torch.nn.attention.flex_attention import flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    attention.flex_attention = _COMPILED_FLEX


def apply(model, mode: str, device_type: str) -> str:
    """Set what compiles for `model`'s training; returns the resolved mode."""
    mode = resolve(mode, device_type)
    if mode in ("attention", "none"):
        eager_forward(model)
    if mode == "attention":
        compile_attention_only()
    return mode
