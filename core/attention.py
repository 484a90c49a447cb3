"""The attention implementations of the torch ops path (core.cache.attend) and the one check of a requested name.

Imports no torch, so the command line's input checks can call it before torch loads."""
from __future__ import annotations

from core.errors import UsageError

ATTENTION_IMPLS = ("sdpa", "eager")


def check_attn_impl(impl: str) -> str:
    """`impl` if the harness's own attention has it, else a one-line UsageError naming the choices."""
    if impl not in ATTENTION_IMPLS:
        raise UsageError(f"--attn-implementation {impl!r}: use {' or '.join(ATTENTION_IMPLS)} (flash_attention_2 "
                         "is not wired into the harness's own attention)")
    return impl
