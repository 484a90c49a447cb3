"""A speculators (vLLM) xpress/dspark directory as a refiner checkpoint; the layout itself is core.speculators_layout."""
from __future__ import annotations

from core.checkpoints import read_tensors, shard_files
from core.speculators_layout import is_speculators, split_tensors, zlab_config

__all__ = ["is_speculators", "load_dir"]


def load_dir(d, cfg: dict, expect_kind: str | None):
    """A speculators xpress/dspark directory as a refiners.checkpoint.RefinerCheckpoint (a gated/rnn Markov head:
    its gate/cell tensors in head_state beside w1/w2, the variant in `variant`)."""
    from refiners.checkpoint import XPRESS, RefinerCheckpoint, _check_kind, head_dims, recorded_step
    where = f"refiner checkpoint {d}"
    zlab_config(cfg, where)  # layout checks (fill-in, full vocab, taps)
    kind, draft, head, variant = split_tensors(cfg, read_tensors(shard_files(d, "refiner checkpoint")), where)
    _check_kind(kind, expect_kind, where, f"speculators_model_type={cfg['speculators_model_type']!r}")
    variant = variant or "vanilla"
    dims = head_dims(kind, head, str(d), variant)
    ck = RefinerCheckpoint(kind=kind, draft_state=draft or None, head_state=head, rank=dims["rank"], source=str(d),
                           variant=variant, extras={"architectures": cfg.get("architectures")}, step=recorded_step(d))
    if kind == XPRESS:
        ck.mlp_hidden, ck.block_size = dims["mlp_hidden"], dims["block"]
        ck.num_passes = cfg.get("num_jacobi_passes")
    return ck
