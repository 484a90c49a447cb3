"""The algorithms by name: the one module of harness/ that imports drafters/ and refiners/.

Everything else in harness/ drives a drafter or a refiner through the protocols of core.protocols; what builds arms
(build.py: arms from checkpoints; presets.py: random-weight models at real shapes; the lab's benches) takes the
classes and loaders from here. A new drafter or refiner is a module under drafters/ or refiners/, its names here,
and a line where build.py and presets.py construct it (tests/test_layout.py holds the rule).
"""
from __future__ import annotations

from drafters.dflash import (DFlashConfig, DFlashDrafter, DFlashModel, check_dflash_checkpoint, config_for_target,
                             load_dflash, read_dflash_config)
from drafters.dflash_batch import DFlashGroup
from drafters.rope import inv_frequencies
from refiners.batch import BatchRefiner, batchable
from refiners.batch import batch_refiner as _on_own_ops
from refiners.formats import (ENV_VARS, MARKOV, XPRESS, RefinerCheckpoint, load_refiner_checkpoint,
                              resolve_refiner_path, validate_against)
from refiners.markov import MarkovHead, MarkovRefiner, markov_head_from_state, random_markov_head
from refiners.spyre_numerics import SpyreXPressRefiner
from refiners.xpress import XPressHead, XPressRefiner, random_xpress_head, validate_topc, xpress_head_from_state

__all__ = ["BatchRefiner", "DFlashConfig", "DFlashDrafter", "DFlashGroup", "DFlashModel", "ENV_VARS", "MARKOV", "MarkovHead", "MarkovRefiner",
           "RefinerCheckpoint", "SpyreXPressRefiner", "XPRESS", "XPressHead", "XPressRefiner",
           "batch_refiner", "check_dflash_checkpoint", "config_for_target", "inv_frequencies", "load_dflash", "load_refiner_checkpoint",
           "markov_head_from_state", "random_markov_head", "random_xpress_head", "read_dflash_config",
           "resolve_refiner_path", "validate_against", "validate_topc", "xpress_head_from_state"]


def batch_refiner(refiner) -> BatchRefiner | None:
    """The run's refiner batched over a step's requests (refiners.batch), or None (each request refines alone):
    on its own ops where they are the torch ops; on the Triton kernels through a twin on core.ops.stacked's
    StackedTritonOps over the same head and kernels, whose launchers vmap can batch (the latent one launch for the
    stack, the readout too while the stack's rows fit one launch)."""
    own = _on_own_ops(refiner)
    if own is None and batchable(refiner) and getattr(refiner.ops, "name", None) == "triton":
        from core.ops.triton_impl import TritonOps  # only for Triton ops: core.kernels stays unimported otherwise
        if isinstance(refiner.ops, TritonOps):
            from core.ops.stacked import StackedTritonOps
            return BatchRefiner(refiner, ops=StackedTritonOps(refiner.ops))
    return own
