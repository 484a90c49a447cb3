"""The bottom layer: what the algorithms (drafters/, refiners/) and the harness (harness/) share.

ops/ (the decode math behind one interface: torch or Triton), kernels/ (the Triton kernels, imported only where
they can run), cache (the static KV cache), devices (+ spyre), errors, checkpoints (+ speculators_layout: reading
checkpoint directories), windows (attention masks), protocols (Proposal, Drafter, RefineContext, Refiner and the
drafter-only IdentityRefiner). Nothing here imports another package of the project (tests/test_layout.py).
"""
