"""models.NAME.grow: a dflash drafter deeper, with a wider MLP, or tapping more target layers than the drafter it
starts from (`init_from`: an exported drafter folder or a drafter of this config), grown so that before its first
step it computes exactly what that drafter computes.

Why (issue 26, item 5: depth 3 against 5, "and more, if it pays"): each continuation of the 5-layer drafter gained
about half what the one before it did (results/perf/NOTES.md, "The drafter continued on fresh data"), so more of
the same recipe looks near its end; a deeper drafter has more capacity, but trained from random it would first
have to relearn what the steps behind its source taught (3,588 behind the drafter shipped then, 4,798 behind the
candidate). Grown, it starts at its source's τ.

How: every tensor of the source is copied. Layers past the source's count are appended on top (speculators 0.9.0's
DFlashDraftModel runs `layers` in order, then `norm` and the verifier's lm_head), keeping the fresh model's own
initialisation except their residual branches' output projections (self_attn.o_proj, mlp.down_proj), which start
at zero: such a layer adds nothing to the residual stream until training moves them (their gradients are not zero:
an output projection's is its input times the upstream gradient). A wider MLP keeps the source's rows of gate_proj
and up_proj and its columns of down_proj, the new rows at their fresh initialisation and the new down_proj columns
at zero, so the new units add nothing either. More taps (hidden.layer_ids holding the source's and more): fc, which maps
the taps' concatenation to the hidden size, keeps each source tap's columns where that layer now sits and starts
the new taps' columns at zero. Nothing is frozen; the learning rate schedule starts at step 0 as
for any init_from model (train.warm_start, which continues one, needs equal shapes).

The grown model equals its source up to the summation order of the wider MLP's and the wider fc's matmuls (zeros
added): the test checks its training forward's logits against the source's in fp32 (tests/test_training_grow.py).
The model is built with full attention in every layer (training/train.py build_model), so a source whose layers
are not all full attention is refused (check_layer_types)."""
from __future__ import annotations

import json
import re

import torch

from core.errors import UsageError

GROWN = ("num_layers", "intermediate_size")  # sizes grow may enlarge (and the taps); block_size and widths stay
ZEROED = ("self_attn.o_proj.", "mlp.down_proj.")  # a new layer's residual branches' outputs
_LAYER = re.compile(r"^layers\.(\d+)\.")


def check_options(where: str, m: dict) -> None:
    """models.NAME.grow's own rules, checked with the config."""
    if not isinstance(m["grow"], bool):
        raise UsageError(f"{where}: grow must be true or false (got {m['grow']!r})")
    if m["grow"] and (m["type"] != "dflash" or m["init_from"] is None or m["freeze_backbone"]):
        raise UsageError(f"{where}: grow enlarges a dflash drafter that trains from its init_from drafter; it needs "
                         "type dflash, init_from set and freeze_backbone false (training/grow.py)")


def check_warm(cfg: dict) -> None:
    """A grown model starts from init_from at step 0; a warm-start folder for it as well is a contradiction. Every
    model's folder is looked up here, with the config: a ship manifest that cannot be read is refused before loading."""
    from training.warm import source
    for name, m in cfg["models"].items():
        d = source(cfg, name)
        if m["grow"] and d is not None:
            raise UsageError(f"config models.{name}: grow starts it from init_from at step 0, and train.warm_start "
                             f"has a folder to continue it from ({d}); drop one of the two "
                             "(harness/lab/training_gpu.sh start: WARM_START=0)")


def check_sizes(where: str, m: dict, theirs: dict, source: str, folder: bool) -> None:
    """This model's sizes against its init_from source's: equal, or with grow at least the source's for GROWN. An
    unset (null) size is the target's: against a folder it is not compared (as before grow), and with grow it is
    checked when the tensors load."""
    for key, v in theirs.items():
        mine = m[key]
        if mine == v or (mine is None and folder):
            continue
        if m["grow"] and key in GROWN:
            if None in (mine, v) or mine > v:
                continue
            raise UsageError(f"{where}: {key}={mine} is below its init_from drafter {source}'s {v}; grow adds layers "
                             f"and MLP width and never removes them: set {key} >= {v}")
        bigger = key in GROWN and None not in (mine, v) and mine > v and m["type"] == "dflash" \
            and not m["freeze_backbone"]  # what grow takes (check_options)
        hint = f"set {key}={v}" + (", or grow: true to enlarge the drafter" if bigger else "")
        raise UsageError(f"{where}: {key}={mine} differs from its init_from drafter {source} ({v}); {hint}")


def check_taps(where: str, m: dict, taps, want, source: str, stage: str) -> None:
    """The init_from drafter's taps (target layers) against the hidden stage's: equal, or with grow all of them
    among the stage's (the new taps' columns of fc start at zero)."""
    if not taps or not want or list(taps) == list(want):
        return
    missing = [t for t in taps if t not in want]
    if m["grow"] and not missing:
        return
    if m["grow"]:
        raise UsageError(f"{where}: {stage} {list(want)}, without the init_from drafter {source}'s taps {missing}; "
                         f"grow adds taps and never removes them: keep {list(taps)} in hidden.layer_ids")
    raise UsageError(f"{where}: init_from drafter {source} taps the target's layers {list(taps)}, and {stage} "
                     f"{list(want)}; set hidden.layer_ids to {list(taps)}"
                     + (" (or grow: true to add taps)" if m["type"] == "dflash" else ""))


def check_layer_types(where: str, spec: dict, source: str) -> None:
    """An init_from folder's layers must all be full attention: the train stage builds every drafter layer so, and
    a sliding-window source copied into it would compute something else."""
    types = (spec.get("transformer_layer_config") or {}).get("layer_types") or []
    other = sorted({t for t in types if t != "full_attention"})
    if other:
        raise UsageError(f"{where}: init_from drafter {source} has {', '.join(other)} layers; the train stage builds "
                         "full attention only, so it cannot start from this drafter")


def layer_count(state: dict) -> int:
    return 1 + max((int(g.group(1)) for k in state if (g := _LAYER.match(k))), default=-1)


def grown(state: dict, own: dict, where: str, taps: tuple[list, list] | None = None) -> tuple[dict, dict]:
    """(the full state for a model whose fresh tensors are `own`, a record of the growth) from the source `state`;
    `taps`: (the source's target layers, this model's), when they differ. A source tensor that is neither equal in
    shape nor one grow enlarges is refused."""
    n_src, n_own = layer_count(state), layer_count(own)
    src_taps, own_taps = taps or (None, None)
    moved = taps is not None and list(src_taps) != list(own_taps)
    extra = sorted(set(state) - set(own))
    if extra:
        raise UsageError(f"{where}: grow: the init_from drafter's tensor {extra[0]} has no place in this model "
                         f"({n_src} layers into {n_own}); grow only adds layers and MLP width")
    out, widened = {}, set()
    for k, v in own.items():
        g = _LAYER.match(k)
        if k not in state:
            if g is None or int(g.group(1)) < n_src:
                continue  # not a drafter tensor the source carries (the verifier's, loaded at build)
            w = v.detach().clone()
            if any(z in k for z in ZEROED):
                w.zero_()
            out[k] = w
            continue
        s = state[k].to(v.dtype)
        if k == "fc.weight" and moved:
            out[k] = _fc(s, v, src_taps, own_taps, where)
        elif s.shape == v.shape:
            out[k] = s
        elif k.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")) and s.shape[1:] == v.shape[1:] \
                and s.shape[0] < v.shape[0]:
            w = v.detach().clone()
            w[:s.shape[0]] = s
            out[k] = w
            widened.add((s.shape[0], v.shape[0]))
        elif k.endswith("mlp.down_proj.weight") and s.shape[0] == v.shape[0] and s.shape[1] < v.shape[1]:
            w = torch.zeros_like(v)
            w[:, :s.shape[1]] = s
            out[k] = w
            widened.add((s.shape[1], v.shape[1]))
        else:
            raise UsageError(f"{where}: grow cannot take {k} from {tuple(s.shape)} to {tuple(v.shape)}: it adds "
                             "layers and MLP width only (the hidden size, heads and vocabulary are the target's)")
    width = list(widened.pop()) if widened else None  # one pair: every layer has the config's intermediate_size
    return out, {"num_layers": [n_src, n_own], "intermediate_size": width,
                 "taps": [list(src_taps), list(own_taps)] if moved else None}


def _fc(s: torch.Tensor, v: torch.Tensor, src_taps: list, own_taps: list, where: str) -> torch.Tensor:
    """fc (the taps' concatenation, tap by tap, into the hidden size) with each source tap's columns where that
    target layer sits among this model's taps, and the new taps' columns at zero."""
    h = v.shape[0]
    if s.shape != (h, h * len(src_taps)) or v.shape != (h, h * len(own_taps)):
        raise UsageError(f"{where}: grow: fc.weight {tuple(s.shape)} -> {tuple(v.shape)} does not match the taps "
                         f"{src_taps} -> {own_taps} at hidden size {h}")
    w = torch.zeros_like(v)
    for i, t in enumerate(src_taps):
        j = own_taps.index(t)
        w[:, j * h:(j + 1) * h] = s[:, i * h:(i + 1) * h]
    return w


def folder_taps(d) -> list[int] | None:
    """The target layers an exported drafter folder taps (None for no folder: a model of this config, which taps
    the hidden stage's)."""
    taps = None if d is None else json.loads((d / "config.json").read_text()).get("aux_hidden_state_layer_ids")
    return list(taps) if taps else None
