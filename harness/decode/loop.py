"""THE decode loop: one function for autoregressive (block 1) and speculative (block B) decoding.

One step: propose -> refine -> verify -> accept -> commit, with every tensor on the device and exactly one host
sync (reading `StepOut.packed`), which fetches the accepted count and the first stop position together.

Positions: the sequence is out[0..n-1]; the anchor is its last token, at index `pos` (the target has committed
pos slots, 0..pos-1). A speculative step writes cache slots pos..pos+B-1 and may emit up to B tokens, so it runs
only while the whole block fits the context (pos + B < max_model_len); after that the loop finishes with plain
target steps, so a proposed draft is never left half-verified.

The device work of a step is one fixed-shape function of persistent state (`Stepper.step`): the output buffer,
target.pos, drafter.ctx, the KV caches and the draft sampler's noise. Eagerly it runs as plain PyTorch; with
`use_graph` it is captured once per (arm, width, KV-length bucket) as one CUDA graph (harness.decode.graphs.StepGraphs)
and replayed, so the host only reads (n_accept, first_stop) per step.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from drafters.base import Drafter, Proposal
from harness.decode.devices import Backend
from harness.errors import UsageError
from harness.decode.sampling import DraftSampler, SamplingParams, sample_rows
from harness.decode.verify import exact_match, rejection
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
    # Timing mode: force min(N, W-1) accepted drafts per verify (the target still verifies the whole block and the
    # next token is its choice at row N), so step times at any tau can be measured. Results made this way are
    # labelled "random weights / scripted acceptance".
    scripted_accept: int | None = None
    # One CUDA graph per (arm, width, KV bucket) for the whole step (CUDA only). graph_bucket: KV slots per bucket
    # (attention reads the bucket, masked); 0 attends over the whole cache capacity with one graph per width.
    use_graph: bool = False
    graph_bucket: int = 256

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
    graph_steps: int = 0               # steps replayed from a whole-step CUDA graph
    graph_note: str = ""               # why steps ran eagerly although use_graph was set ("" when none did)

    @property
    def decode_tokens(self) -> int:
        """Tokens the decode timer is divided by: all but the prefill's first token (whose time is TTFT); the
        reference (compat mode) counts that token too."""
        return len(self.tokens) if self.compat_reference else max(0, len(self.tokens) - 1)


class PromptTooLong(UsageError):
    pass


@dataclass
class StepOut:
    """One step's device results. `packed` = (n_accept, first_stop) is all the host reads, in one sync."""
    packed: torch.Tensor
    n_accept: torch.Tensor
    next_token: torch.Tensor
    block: torch.Tensor
    logits: torch.Tensor
    proposal: Proposal | None


_IDENTITY = IdentityRefiner()  # one object: step graphs are keyed by the refiner's identity


def _no_mark(stage: str) -> None:
    pass


class Stepper:
    """The device work of one step as a fixed-shape function of persistent state (no host sync): for a given
    (speculative, width, length) every call launches the same kernels on the same buffers, which is what lets
    harness.decode.graphs capture it once and replay it. `mark(stage)` is called at "begin" and after each of STAGES
    (timing only; never inside a capture)."""

    STAGES = ("draft", "refine", "verify", "accept", "observe")

    def __init__(self, target, drafter, refiner, settings: DecodeSettings, out: torch.Tensor, stops: torch.Tensor,
                 sampler: DraftSampler | None, generator: torch.Generator | None):
        self.target, self.drafter, self.refiner = target, drafter, refiner
        self.out, self.stops, self.sampler, self.generator = out, stops, sampler, generator
        self.params = settings.target_params
        # Rejection sampling needs a real q: drafts drawn at Td > 0 verified against a sampled target. Any other
        # combination is verified by exact match (greedy, or against a sampled target for deterministic drafts).
        self.q_mode = sampler is not None and not self.params.greedy
        width = drafter.block_size if drafter is not None else 1
        self.offsets = torch.arange(width, device=out.device)
        self.scripted = settings.scripted_accept
        self.forced = {} if self.scripted is None else {
            w: torch.full((), min(self.scripted, w - 1), dtype=torch.long, device=out.device) for w in {1, width}}

    def step(self, speculative: bool, width: int, length: int, mark=_no_mark) -> StepOut:
        t = self.target
        mark("begin")
        anchor = self.out.index_select(0, t.pos.view(1))
        proposal = None
        if speculative:
            proposal = self.drafter.propose(anchor[0], t.pos, length)
            if self.sampler is not None:
                self.sampler.new_block(self.generator)
                proposal = dataclasses.replace(proposal, tokens=self.sampler.select(proposal.logits))
            mark("draft")
            prev = self.out.index_select(0, t.pos.view(1) - 1)[0]
            proposal = self.refiner.refine(proposal, RefineContext(anchor=anchor[0], prev_token=prev,
                                                                   sampler=self.sampler))
            mark("refine")
            drafts = proposal.tokens
            block = torch.cat((anchor, drafts))
        else:
            drafts = self.out[:0]
            block = anchor
        logits, feats = t.verify(block, length, want_features=speculative)
        mark("verify")
        n, nxt = self._verdict(drafts, proposal, logits, width, speculative)
        idx = self.offsets[:width]
        candidates = torch.cat((drafts, nxt.view(1)))
        emitted = torch.where(idx < n, candidates, nxt)
        self.out.index_copy_(0, t.pos + 1 + idx, emitted)
        hits = (emitted.unsqueeze(1) == self.stops).any(1) & (idx <= n)
        first_stop = torch.where(hits.any(), hits.long().argmax(), width)
        t.commit(n + 1)
        mark("accept")
        if speculative:
            self.drafter.observe(feats, n + 1)
            mark("observe")
        return StepOut(torch.stack((n, first_stop)), n, nxt, block, logits, proposal)

    def _verdict(self, drafts, proposal, logits, width, speculative):
        if self.q_mode and speculative:
            v = rejection(drafts, self.sampler.q(proposal.logits), logits, self.params, self.generator)
        else:
            v = exact_match(drafts, logits, self.params, self.generator)
        if self.scripted is None:
            return v.n_accept, v.next_token
        # Scripted acceptance: the verdict is still computed (same work), then overridden.
        n = self.forced[width]
        return n, sample_rows(logits.index_select(0, n.view(1)), self.params, self.generator)[0]


def _check(settings: DecodeSettings, backend: Backend) -> None:
    s = settings.scripted_accept
    if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
        raise UsageError(f"--scripted-accept must be an integer >= 0, got {s!r}")
    if settings.use_graph and backend.kind != "cuda":
        raise UsageError("--use-graph captures CUDA graphs and needs --device cuda; drop it on "
                         f"{backend.kind}")
    b = settings.graph_bucket
    if isinstance(b, bool) or not isinstance(b, int) or b < 0:
        raise UsageError(f"graph bucket must be an integer >= 0 (0 = the whole cache), got {b!r}")


@torch.no_grad()
def generate(target, prompt: list[int], settings: DecodeSettings, backend: Backend,
             drafter: Drafter | None = None, refiner: Refiner | None = None,
             generator: torch.Generator | None = None,
             on_step: Callable[[dict], None] | None = None, mark: Callable[[str], None] | None = None) -> Generation:
    """Decode one prompt. `on_step`, when given, sees each step's device tensors after the step's sync
    (tests and traces); it is None on timed runs, so it costs nothing there. `mark(name)`, for CUDA-event timing
    (harness.decode.timing.StageTimer), is called at "begin" and "end" of every step and, on eager steps, after each
    stage (Stepper.STAGES)."""
    dev = backend.device
    m, limit = settings.max_new_tokens, settings.max_model_len
    p = len(prompt)
    if p == 0:
        raise UsageError("empty prompt: the chat template produced no tokens")
    if p >= limit:
        raise PromptTooLong(f"prompt has {p} tokens but --max-model-len is {limit}; raise --max-model-len "
                           "or drop the prompt")
    _check(settings, backend)
    graphs = None
    if settings.use_graph:
        from harness.decode.graphs import step_graphs
        graphs = step_graphs(target)
    width = drafter.block_size if drafter is not None else 1
    refiner = refiner or _IDENTITY
    need = min(limit, p + m + width)
    if graphs is not None:
        need = graphs.capacity_for(need, settings.graph_bucket)
    target.ensure_capacity(need)
    if drafter is not None:
        drafter.ensure_capacity(need)
    target.reset()

    if graphs is not None:  # buffers a captured graph reads by address: persistent across generations
        out = graphs.out_buffer(target.capacity + width + 1)
        stops = graphs.stop_ids(settings.stop_ids)
    else:
        out = torch.full((p + m + width + 1,), -1, dtype=torch.long, device=dev)
        stops = torch.tensor(sorted(settings.stop_ids) or [-2], dtype=torch.long, device=dev)
    out[:p] = torch.tensor(prompt, dtype=torch.long)
    compat = settings.compat_reference
    gen = Generation(tokens=[], accept_lengths=[], accepted=[], stop_reason="", prompt_len=p, compat_reference=compat)
    target_params, draft_params = settings.target_params, settings.draft_params
    sampler = None
    if drafter is not None and not draft_params.greedy:
        sampler = DraftSampler.kept_in(target.samplers, draft_params, settings.draft_noise, width - 1,
                                       target.vocab_size, dev)

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

    rng = generator
    random_steps = sampler is not None or not target_params.greedy
    if graphs is not None and random_steps:
        if graphs.adopt_rng(generator):
            rng = graphs.rng  # a graph reads the generator it was captured with: the state moves, not the object
        else:
            gen.graph_note = graphs.rng_unsupported
            graphs = None
    stepper = Stepper(target, drafter, refiner, settings, out, stops, sampler, rng)

    pos, produced = p, 1
    stop = ""
    if first_id in settings.stop_ids:
        stop = "eos"
    elif produced >= m:
        stop = "max_new_tokens"
    elif pos + 1 >= limit:
        stop = "max_model_len"

    clock = [t1]

    def compat_mark(stage: str) -> None:
        if stage == "refine":  # the reference starts its decode timer here (its drafter "prefill")
            t2 = backend.now()
            gen.drafter_prefill_s += t2 - clock[0]
            clock[0] = t2

    extra_step = False  # compat: the step the reference runs with an EOS anchor, counted but emitting nothing
    while not stop or extra_step:
        speculative = drafter is not None and pos + width < limit
        w = width if speculative else 1
        first_compat = compat and speculative and gen.spec_steps == 0
        if graphs is not None and not first_compat:
            length = graphs.length(pos + w, settings.graph_bucket, target.capacity)
            if mark is not None:
                mark("begin")
            res = graphs.run(stepper, speculative, w, length)
            gen.graph_steps += 1
        else:
            res = stepper.step(speculative, w, pos + w, compat_mark if first_compat else (mark or _no_mark))
        if mark is not None:
            mark("end")

        accepted, stop_at = res.packed.tolist()  # the one host sync per step
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
            on_step({"position": pos, "speculative": speculative, "block": res.block, "logits": res.logits,
                     "proposal": res.proposal, "accepted": accepted, "emitted": emit,
                     "next_token": res.next_token, "produced": produced + emit, "stop": stop})
        produced += emit
        pos += accepted + 1
        gen.accept_lengths.append(accepted + 1 if compat else emit)
        gen.accepted.append(accepted)
        if not stop and pos + 1 >= limit:
            stop = "max_model_len"

    gen.decode_s = backend.now() - clock[0]
    if rng is not generator and graphs is not None:
        graphs.return_rng(generator)
    gen.tokens = out[p: p + produced].tolist()
    gen.stop_reason = stop
    return gen
