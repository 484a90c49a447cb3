"""Triton kernels for the decode step at batch 1 (one AR token or one verify block of a few rows), by family.

At batch 1 every weight is read once per step and used for a handful of rows, so the step is a stream of weight
bytes plus a few hundred small launches. A layer is six launches at one row (eight for a block of rows) instead
of about forty: `matmul.linear` (q/k/v with the norm folded at one row, o_proj and down_proj with the residual
add, gate/up, the lm_head with its argmax), `attention.attention` (norms, rotary, cache write and attention in
one launch), `rows.rms_norm` where a norm cannot fold. `common` holds the launch settings (`Launch`) and PDL.
Rounding follows HF's modules step by step (each elementwise op in fp32, rounded to the model's dtype where HF's
op would round); only the matmul and softmax summation orders differ from the torch ops, and a folded norm,
which skips one rounding of the normed row. Each module's docstring states its contract. Nothing here knows a
model: core.ops.TritonOps is the one user, and chooses when a shape fits.
With TRITON_INTERPRET=1 the same kernels run on CPU tensors (the tests use that for correctness).
`xpress.latent` is the xPress head's pass before its readout, in one launch; `markov.gated_latent` the gated
Markov head's step before its readout.
`linear`, `attention`, `fits` and `choose_linear` (select.py) run the default kernels, or with
Launch(batch_invariant=True) the batch-invariant ones of `invariant` beside them (issue 28; opt-in).
"""
from core.kernels.attention import MAX_ATTN_ROWS, heads_fit, write_kv
from core.kernels.common import HAS_GDC, MAX_SPLITS, Launch, available, interpreted, pdl_supported, triton
from core.kernels.markov import fits as markov_fits, gated_latent as markov_gated_latent
from core.kernels.matmul import MAX_ROWS, WIDE_ROWS, LinearConfig, wide_linear
from core.kernels.rows import rms_norm, silu_mul
from core.kernels.select import attention, choose_linear, fits, linear
from core.kernels.xpress import (fits as xpress_fits, head_weights as xpress_head_weights, latent as xpress_latent,
                                 refused as xpress_refused)

__all__ = ["MAX_ATTN_ROWS", "MAX_ROWS", "MAX_SPLITS", "HAS_GDC", "WIDE_ROWS", "Launch", "LinearConfig", "attention",
           "available", "choose_linear", "fits", "heads_fit", "interpreted", "linear", "markov_fits",
           "markov_gated_latent", "pdl_supported", "rms_norm", "silu_mul", "triton", "wide_linear", "write_kv",
           "xpress_fits", "xpress_head_weights", "xpress_latent", "xpress_refused"]
