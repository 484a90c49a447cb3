"""How a decode is counted: one policy object, chosen once at the start of generate(), instead of branches.

Two policies exist. STANDARD is ours. REFERENCE (--compat-reference) reproduces the reference harness's loop
quirks, each listed below, so that its numbers can be matched:

- extra_step_after_eos: the reference checks for a stop before the token it just wrote, so a step whose
  correction/bonus token is the EOS is followed by one more draft+verify with the EOS as anchor. That step is
  counted (a tau entry, a host sync, its time) and emits nothing.
- clip_tau: our tau entry is the number of tokens the step added to the output (clipped at a stop or at the
  budget); the reference records accepted + 1 unclipped.
- timer_after_first_draft: the reference starts its decode timer after drafting the first block (it calls that
  the drafter's prefill); ours starts after the drafter's pass over the prompt.
- first_token_counts: the reference divides its decode time by every new token, the prefill's first one included;
  ours leaves that token to TTFT.
- eos_only: the reference stops only on the tokenizer's eos_token_id (151645 for Qwen3), not on every id of the
  model's generation config (Qwen3 also lists 151643).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accounting:
    name: str
    extra_step_after_eos: bool
    clip_tau: bool
    timer_after_first_draft: bool
    first_token_counts: bool
    eos_only: bool

    def tau_entry(self, accepted: int, emitted: int) -> int:
        """The step's acceptance-length entry."""
        return emitted if self.clip_tau else accepted + 1

    def decode_tokens(self, new_tokens: int) -> int:
        """Tokens the decode timer is divided by."""
        return new_tokens if self.first_token_counts else max(0, new_tokens - 1)

    def wants_extra_step(self, stop_at: int, accepted: int, room_budget: bool, room_context: bool) -> bool:
        """After a stop at block row `stop_at`: does one more step run? Only when the stop was the step's own
        correction/bonus token (row == accepted), and only while the budget and the context leave room."""
        return self.extra_step_after_eos and stop_at == accepted and room_budget and room_context

    def stop_ids(self, generation_ids, tokenizer_eos) -> tuple[int, ...]:
        """The ids that end a generation: all of the model's generation-config ids, or the tokenizer's eos only.
        Falls back to the other source when the preferred one is empty."""
        def ids(x):
            return [] if x is None else [x] if isinstance(x, int) else list(x)
        first, other = (ids(tokenizer_eos), ids(generation_ids)) if self.eos_only else \
            (ids(generation_ids), ids(tokenizer_eos))
        return tuple(sorted({int(i) for i in (first or other)}))


STANDARD = Accounting("standard", extra_step_after_eos=False, clip_tau=True, timer_after_first_draft=False,
                      first_token_counts=False, eos_only=False)
REFERENCE = Accounting("reference", extra_step_after_eos=True, clip_tau=False, timer_after_first_draft=True,
                       first_token_counts=True, eos_only=True)


def accounting_for(compat_reference: bool) -> Accounting:
    return REFERENCE if compat_reference else STANDARD


def model_stop_ids(model, tokenizer, policy: Accounting) -> tuple[int, ...]:
    """The run's stop ids under `policy`: the model's generation config (else its config) lists the ids a
    generation may end with; REFERENCE keeps only the tokenizer's eos, as the reference does."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = getattr(getattr(model, "config", None), "eos_token_id", None)
    return policy.stop_ids(ids, getattr(tokenizer, "eos_token_id", None))
