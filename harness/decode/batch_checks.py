"""The checks of harness.decode.batch_loop.generate_batch's arguments, before any prefill."""
from __future__ import annotations

from core.errors import UsageError
from harness.decode.loop import DecodeSettings, check_prompt


def check_batch(prompts, settings: DecodeSettings, drafters, generators, state, limits, rows=None) -> int:
    """generate_batch's arguments checked before anything is prefilled (one-line UsageErrors); returns the rows."""
    n = len(prompts)
    if n == 0:
        raise UsageError("batched decoding got no prompts: pass at least one")
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= n):
        raise UsageError(f"batched decoding: rows must be an integer from 1 to the {n} prompts, got {rows!r}")
    b = n if rows is None else rows
    if drafters is not None and len(drafters) != b:
        raise UsageError(f"batched decoding got {len(drafters)} drafters for {b} rows: pass one per row (a row's "
                         "drafter serves each request that takes the row)")
    for name, given in (("generators", generators), ("output limits", limits)):
        if given is not None and len(given) != n:
            raise UsageError(f"batched decoding got {len(given)} {name} for {n} prompts: pass one per prompt")
    if drafters is not None:
        groups = {id(getattr(d, "group", None)) for d in drafters}
        if len(groups) > 1 or (getattr(drafters[0], "group", None) is not None and
                               [getattr(d, "b", None) for d in drafters] != list(range(b))):
            raise UsageError("batched decoding: pass a drafter group's members in order, all of them "
                             "(DFlashGroup(base, rows).members), or one drafter per row")
        if len({id(d) for d in drafters}) != b:
            raise UsageError("batched decoding got one drafter object for several requests: each request needs "
                             "its own (a drafter holds its request's context), over the same weights")
        if len({d.block_size for d in drafters}) != 1:
            raise UsageError("batched decoding: the drafters' block sizes differ; one arm has one block")
    if limits is not None and any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in limits):
        raise UsageError(f"batched decoding: output limits must be integers >= 1, got {list(limits)}")
    if state is not None and len(state.slots) < b:
        raise UsageError(f"batched decoding on {b} rows needs a DecodeState of >= {b} slots, "
                         f"got {len(state.slots)}")
    for i, p in enumerate(prompts):
        try:
            check_prompt(len(p), settings.max_model_len)
        except UsageError as e:
            raise type(e)(f"prompt {i} of the batch: {e}") from None
    return b
