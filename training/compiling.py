"""What torch.compile covers in a training step (`train.compile`).

speculators 0.9.0 decorates every speculator's `forward` with `conditional_torch_compile` (torch.compile whenever
CUDA is available), so the whole step (five draft layers, the anchors, the loss over a 49152-word vocabulary)
compiles on its first call. On the H200 that first step took 248.7 s of a 256.9 s box on a cold cache
(results/perf/training_box_h200.json), once per process and model. The choices:

* "model": speculators as it is (the whole forward compiled).
* "attention": the forward runs eagerly and only flex attention is compiled, alone (its kernels; the block masks
  are compiled by speculators already). Eager flex attention would fall back to a dense reference that builds the
  whole score matrix. Every batch is padded to `train.total_seq_len`, so the shapes never change.
* "layers": as "attention", and each draft decoder layer is compiled too (its norms, rotary, projections, flex
  attention and MLP in one graph; the anchors, the embedding and the loss stay eager). Why: in the H200 profile of
  the "attention" mode (results/perf/NOTES.md, item 4c of the next-session plan) ATen's eager elementwise kernels
  took 61.8 of a step's 328.8 ms. Dynamo takes speculators 0.9.0's layer in one graph with no break, and new block
  masks and data do not recompile it (a scratch check on the CPU with backend "eager", 3 steps, seventh session);
  its speed is not measured.
* "none": nothing compiled (what a CPU gets anyway).
* "auto": "attention" on CUDA, "none" elsewhere.

`train.flex_kernel_options`: the `kernel_options` our compiled flex attention passes (with "attention" and
"layers"). "auto" is forward tiles of 64 x 64 queries and keys: in `python -m training.bench_flex` on an H100 (torch
2.11, a packed row shaped as the SmolLM2 run's, results/perf/flex_h100/), torch's default forward for this mask
(128 x 128 tiles, 4 warps) spilled 738 registers a thread and took 8.21 ms a call against 1.93 ms for its backward;
with 64 x 64 tiles it spilled none and took 0.69 ms, its output within bf16 rounding of the default's. {} is torch's
own choice; any other dict is passed as it is (torch.nn.attention.flex_attention's kernel_options, e.g.
{"fwd_num_warps": 8}: 0.99 ms there, bitwise the default's output).
"""
from __future__ import annotations

import contextlib
import os
import types
from pathlib import Path

MODES = ("auto", "model", "layers", "attention", "none")


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


AUTO_FLEX_OPTIONS = {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64}
_COMPILED_FLEX: dict = {}  # the options (as JSON) -> their compiled flex attention


def flex_options(value) -> dict:
    """train.flex_kernel_options resolved: "auto" -> AUTO_FLEX_OPTIONS, a dict as it is; anything else refused."""
    from core.errors import UsageError
    if value == "auto":
        return dict(AUTO_FLEX_OPTIONS)
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, (bool, int, float))
                                              for k, v in value.items()):
        raise UsageError(f"config train.flex_kernel_options {value!r}: use auto, {{}} (torch's choice) or a dict of "
                         "flex_attention kernel_options to numbers or booleans, e.g. {\"fwd_num_warps\": 8}")
    return dict(value)


def _with_options(options: dict):
    """flex_attention with `options` under the caller's own kernel_options (a caller's key wins)."""
    from torch.nn.attention.flex_attention import flex_attention

    def flex(*args, kernel_options=None, **kwargs):
        return flex_attention(*args, kernel_options={**options, **(kernel_options or {})}, **kwargs)
    return flex


def compile_attention_only(options: dict | None = None) -> None:
    """speculators' flex attention forward calls the module-level `flex_attention` of speculators.models.attention
    (0.9.0); it is replaced there by one compiled function per `options` (kernel_options it passes; none: torch's
    choice), shared by every model of the process. A caller's own kernel_options keys win over `options`."""
    import json
    import torch
    import speculators.models.attention as attention
    from torch.nn.attention.flex_attention import flex_attention
    key = json.dumps(options or {}, sort_keys=True)
    if key not in _COMPILED_FLEX:
        _COMPILED_FLEX[key] = torch.compile(_with_options(dict(options)) if options else flex_attention, dynamic=False)
    attention.flex_attention = _COMPILED_FLEX[key]


def apply(model, mode: str, device_type: str, options="auto") -> str:
    """Set what compiles for `model`'s training (flex attention with `options`, train.flex_kernel_options, which
    `model.xb_flex_kernel_options` then records: None where our compiled flex attention is not in place); returns
    the resolved mode."""
    mode = resolve(mode, device_type)
    model.xb_flex_kernel_options = None
    if mode in ("attention", "layers", "none"):
        eager_forward(model)
    if mode in ("attention", "layers"):
        model.xb_flex_kernel_options = flex_options(options)
        compile_attention_only(model.xb_flex_kernel_options)
    if mode == "layers":
        compile_layers(model)
    return mode


def compile_layers(model, backend: str = "inductor") -> int:
    """Each of the model's draft decoder layers (`model.layers`) compiled in place (nn.Module.compile, static
    shapes); returns how many. `backend`: the tests trace with "eager" (dynamo alone)."""
    layers = list(getattr(model, "layers", None) or ())
    for layer in layers:
        layer.compile(dynamic=False, backend=backend)
    return len(layers)


def load_cache(path: str) -> dict:
    """`train.compile_cache`: the artifacts of torch.compile (inductor's compiled graphs and kernels, AOTAutograd's,
    autotuning) that an earlier run saved, on a machine with the same GPU, torch and Triton, put into this
    process's caches before anything compiles (torch.compiler.load_cache_artifacts), so the first step finds its
    graphs compiled. On the H200 that first step, mostly compiling, took 93.0 s of an 8-minute box
    (results/perf/training_scale_h200_continue/drafter_box.json). A missing file is no error (the first run makes
    it); one that does not load (corrupted, another torch) is reported, and everything compiles as without it.
    Returns the record written to train/compile_cache.json."""
    import torch
    rec = {"file": path, "loaded_bytes": 0}
    p = Path(path)
    if p.exists() and not p.is_file():
        return {**rec, "note": "not a file: nothing loaded or saved (name a file)", "unusable": True}
    if not p.is_file():
        return {**rec, "note": "no file yet: this run compiles from scratch and saves one"}
    data = p.read_bytes()
    try:  # None (with torch's warning) when it cannot read them; a cache never stops a run
        info = torch.compiler.load_cache_artifacts(data)
    except Exception as e:  # noqa: BLE001 (torch raises what its cache backends raise: OSError, pickle errors)
        return {**rec, "note": f"not loaded ({type(e).__name__}: {e}): everything compiles from scratch"[:400]}
    if info is None:
        return {**rec, "note": "not loaded (corrupted, or saved by another torch or Triton; torch's warning above "
                               "says which): everything compiles from scratch"}
    return {**rec, "loaded_bytes": len(data), "artifacts": {k: len(v) for k, v in info.artifacts.items()},
            "merged": keep_loaded(data)}


def keep_loaded(data: bytes) -> bool:
    """save_cache_artifacts (torch 2.13) writes what this process compiled or used from the caches, not what it
    loaded and never used: a heads-only run would save a file without the drafter's graphs. The loaded artifacts are
    recorded again so that every save keeps them (torch.compiler._cache, private: where this torch lacks it, False,
    and save_cache then never replaces the file with fewer artifacts). They are recorded as deserialize returns
    them: record_artifact would encode their content again, and the autotune kind's encode asserts that its content
    is not bytes yet (torch 2.13 here), so a GPU run's file, which holds autotuning results, failed the merge (the
    device's torch 2.11 too: on 2026-12-07 the heads' job kept the drafter's file and lost what the xPress head
    compiled, 88 s of its first step)."""
    try:
        from torch.compiler._cache import CacheArtifactManager as manager
        for kind, items in (manager.deserialize(data) or {}).items():
            for a in items:
                if a not in manager._seen_artifacts:  # as record_artifact does after encoding
                    manager._new_cache_artifacts[kind].append(a)
                    manager._seen_artifacts.add(a)
    except Exception:  # noqa: BLE001 (private API: any change in it only means the merge is off)
        return False
    return True


def save_cache(path: str, rec: dict) -> dict:
    """After each model of the stage: every artifact this process compiled, used or loaded, written to `path`
    (whole or not at all: a temporary file renamed). Nothing compiled (a CPU run, train.compile=none) writes
    nothing; a file that cannot be written is noted, not fatal (the training it follows is done)."""
    import torch
    out = None if rec.get("unusable") else torch.compiler.save_cache_artifacts()
    if not out or not out[0]:
        return {**rec, "saved_bytes": rec.get("saved_bytes", 0)}
    data, info = out
    saved = {k: len(v) for k, v in info.artifacts.items()}
    if sum(saved.values()) < sum(rec.get("artifacts", {}).values()):  # merged or not: never a file with fewer
        why = "the merge did not hold" if rec.get("merged", True) else "this torch cannot carry its unused artifacts"
        return {**rec, "saved_bytes": 0, "note": f"kept the loaded file: the new one would hold fewer ({why})"}
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, p)
    except OSError as e:
        with contextlib.suppress(OSError):  # the folder itself may be what failed
            tmp.unlink(missing_ok=True)
        return {**rec, "saved_bytes": 0, "note": f"not saved: {e.strerror or e} ({path})"}
    return {**rec, "saved_bytes": len(data), "saved_artifacts": saved}
