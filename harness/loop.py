"""THE decode loop: one function for autoregressive (block 1) and speculative (block B) decoding.

One step: propose -> refine -> verify -> accept -> commit, with every tensor on the device and exactly one host
sync (`_read_step`), which fetches the accepted count and the first stop position together.

Positions: the sequence is out[0..n-1]; the anchor is its last token, at index `pos` (the target has committed
pos slots, 0..pos-1). A speculative step writes cache slots pos..pos+B-1 and may emit up to B tokens, so it runs
only while the whole block fits the context (pos + B < max_model_len); after that the loop finishes with plain
target steps, so a proposed draft is never left half-verified.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from drafters.base import Drafter
from harness.devices import Backend
from harness.errors import UsageError
from harness.sampling import DraftSampler, SamplingParams, sample_rows
from harness.verify import exact_match, rejection
from refiners.base import RefineContext, Refiner
from refiners.identity import IdentityRefiner


@dataclass(frozen=True)
class DecodeSettings:
    max_new_tokens: int
    max_model_len: int
    stop_ids: tuple[int, ...]
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    draft_temperature: float | None = None   # None: the target temperature (the reference's convention)
    draft_noise: str = "gumbel"
    # The reference harness's loop quirks: tau entries not clipped at EOS or the budget, one extra draft+verify
    # step after an EOS correction/bonus token, and the decode timer started after the first block's drafting.
    compat_reference: bool = False

    @property
    def target_params(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    @property
    def draft_params(self) -> SamplingParams:
        t = self.temperature if self.draft_temperature is None else self.draft_temperature
        return SamplingParams(t, self.top_k, self.top_p)


@dataclass
class Generation:
    tokens: list[int]
    accept_lengths: list[int]          # per step: tokens the step added to the output (accepted + 1, clipped)
    accepted: list[int]                # per step: drafts accepted by verification (before clipping)
    stop_reason: str                   # eos | max_new_tokens | max_model_len
    prompt_len: int
    ttft_s: float = 0.0                # prefill + first token
    drafter_prefill_s: float = 0.0     # the drafter's pass over the prompt context, reported apart
    decode_s: float = 0.0              # every step after that
    spec_steps: int = 0
    ar_steps: int = 0
    host_syncs: int = 0
    compat_reference: bool = False

    @property
    def decode_tokens(self) -> int:
        """Tokens the decode timer is divided by: all but the prefill's first token (whose time is TTFT); the
        reference (compat mode) counts that token too."""
        return len(self.tokens) if self.compat_reference else max(0, len(self.tokens) - 1)


class PromptTooLong(UsageError):
    pass


def _read_step(n_accept: torch.Tensor, first_stop: torch.Tensor) -> tuple[int, int]:
    """The one host sync per step."""
    a, s = torch.stack((n_accept, first_stop)).tolist()
    return a, s


@torch.no_grad()
def generate(target, prompt: list[int], settings: DecodeSettings, backend: Backend,
             drafter: Drafter | None = None, refiner: Refiner | None = None,
             generator: torch.Generator | None = None,
             on_step: Callable[[dict], None] | None = None) -> Generation:
    """Decode one prompt. `on_step`, when given, sees each step's device tensors after the step's sync
    (tests and traces); it is None on timed runs, so it costs nothing there."""
    dev = backend.device
    m, limit = settings.max_new_tokens, settings.max_model_len
    p = len(prompt)
    if p == 0:
        raise UsageError("empty prompt: the chat template produced no tokens")
    if p >= limit:
        raise PromptTooLong(f"prompt has {p} tokens but --max-model-len is {limit}; raise --max-model-len "
                           "or drop the prompt")
    width = drafter.block_size if drafter is not None else 1
    refiner = refiner or IdentityRefiner()
    need = min(limit, p + m + width)
    target.ensure_capacity(need)
    if drafter is not None:
        drafter.ensure_capacity(need)
    target.reset()

    out = torch.full((p + m + width + 1,), -1, dtype=torch.long, device=dev)
    out[:p] = torch.tensor(prompt, dtype=torch.long)
    stops = torch.tensor(sorted(settings.stop_ids) or [-2], dtype=torch.long, device=dev)
    offsets = torch.arange(width, device=dev)
    compat = settings.compat_reference
    gen = Generation(tokens=[], accept_lengths=[], accepted=[], stop_reason="", prompt_len=p, compat_reference=compat)
    target_params, draft_params = settings.target_params, settings.draft_params
    sampler = None
    if drafter is not None and not draft_params.greedy:
        sampler = DraftSampler.shared(draft_params, settings.draft_noise, width - 1, target.vocab_size, dev)
    # Rejection sampling needs a real q: drafts drawn at Td > 0 verified against a sampled target. Any other
    # combination is verified by exact match (greedy, or against a sampled target for deterministic drafts).
    q_mode = sampler is not None and not target_params.greedy

    t0 = backend.now()
    logits, feats = target.prefill(out[:p], want_features=drafter is not None)
    first = sample_rows(logits, target_params, generator)
    out[p] = first
    first_id = int(first)  # host read of the prefill's token: part of TTFT, not of any step
    t1 = backend.now()
    gen.ttft_s = t1 - t0
    if drafter is not None:
        drafter.begin(feats)
        t2 = backend.now()
        gen.drafter_prefill_s = t2 - t1
        t1 = t2

    pos, produced = p, 1
    stop = ""
    if first_id in settings.stop_ids:
        stop = "eos"
    elif produced >= m:
        stop = "max_new_tokens"
    elif pos + 1 >= limit:
        stop = "max_model_len"

    extra_step = False  # compat: the step the reference runs with an EOS anchor, counted but emitting nothing
    while not stop or extra_step:
        speculative = drafter is not None and pos + width < limit
        w = width if speculative else 1
        anchor = out.index_select(0, target.pos.view(1))
        if speculative:
            proposal = drafter.propose(anchor[0], target.pos, pos + w)
            if sampler is not None:
                sampler.new_block(generator)
                proposal = dataclasses.replace(proposal, tokens=sampler.select(proposal.logits))
            prev = out.index_select(0, target.pos.view(1) - 1)[0]
            proposal = refiner.refine(proposal, RefineContext(anchor=anchor[0], prev_token=prev, sampler=sampler))
            if compat and gen.spec_steps == 0:
                t2 = backend.now()  # the reference starts its decode timer here (its drafter "prefill")
                gen.drafter_prefill_s += t2 - t1
                t1 = t2
            drafts = proposal.tokens
            block = torch.cat((anchor, drafts))
        else:
            drafts = out[:0]
            block = anchor
        logits, feats = target.verify(block, pos + w, want_features=speculative)
        if q_mode and speculative:
            verdict = rejection(drafts, sampler.q(proposal.logits), logits, target_params, generator)
        else:
            verdict = exact_match(drafts, logits, target_params, generator)
        n = verdict.n_accept
        idx = offsets[:w]
        candidates = torch.cat((drafts, verdict.next_token.view(1)))
        emitted = torch.where(idx < n, candidates, verdict.next_token)
        out.index_copy_(0, target.pos + 1 + idx, emitted)
        hits = torch.isin(emitted, stops) & (idx <= n)
        first_stop = torch.where(hits.any(), hits.long().argmax(), w)
        target.commit(n + 1)
        if speculative:
            drafter.observe(feats, n + 1)

        accepted, stop_at = _read_step(n, first_stop)
        gen.host_syncs += 1
        gen.spec_steps += speculative
        gen.ar_steps += not speculative
        if extra_step:
            gen.accept_lengths.append(accepted + 1)
            gen.accepted.append(accepted)
            break
        emit = accepted + 1
        if stop_at < w:
            emit, stop = stop_at + 1, "eos"
            # the reference checks stops before the token it just wrote: an EOS correction/bonus costs a step
            extra_step = (compat and stop_at == accepted and pos + accepted + 1 < p + m
                          and pos + accepted + 2 < limit)
        if produced + emit >= m:
            if produced + emit > m or not stop:
                stop = "max_new_tokens"
            emit = m - produced
        if on_step is not None:
            on_step({"position": pos, "speculative": speculative, "block": block, "logits": logits,
                     "proposal": proposal if speculative else None, "accepted": accepted, "emitted": emit,
                     "next_token": verdict.next_token,
                     "produced": produced + emit, "stop": stop})
        produced += emit
        pos += accepted + 1
        gen.accept_lengths.append(accepted + 1 if compat else emit)
        gen.accepted.append(accepted)
        if not stop and pos + 1 >= limit:
            stop = "max_model_len"

    gen.decode_s = backend.now() - t1
    gen.tokens = out[p: p + produced].tolist()
    gen.stop_reason = stop
    return gen
