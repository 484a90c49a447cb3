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

from core.protocols import Drafter, IdentityRefiner, Proposal, RefineContext, Refiner
from harness.decode.accounting import REFERENCE, STANDARD, Accounting, accounting_for
from harness.decode.capture_plan import room_to_speculate
from core.devices import Backend
from core.errors import UsageError
from harness.decode.graphs import check_use_graph
from harness.decode.sampling import DraftSampler, SamplingParams, sample_rows
from harness.decode.state import DecodeState
from harness.decode.verify import exact_match, rejection


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
    # The reference harness's accounting (harness.decode.accounting.REFERENCE): see that module.
    compat_reference: bool = False
    # Timing mode: force min(N, W-1) accepted drafts per verify (the target still verifies the whole block and the
    # next token is its choice at row N), so step times at any tau can be measured. Results made this way are
    # labelled "random weights / scripted acceptance".
    scripted_accept: int | None = None
    # One CUDA graph per (arm, width, KV bucket) for the whole step (CUDA only). graph_bucket: KV slots per bucket
    # (attention reads the bucket, masked), >= 1; a bucket as large as the cache attends over all of it.
    use_graph: bool = False
    graph_bucket: int = 256
    # Record the target's top-2 logit gap of every emitted token (one top-2 per step, inside the timer: off unless
    # asked, and labelled), so a divergence from AR can be shown to sit on a near-tie.
    record_gaps: bool = False

    def __post_init__(self):
        b = self.graph_bucket  # refused here, before anything sizes a cache by it (the runner's presize divides)
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise UsageError(f"graph bucket must be an integer >= 1 (KV slots per step graph), got {b!r}")

    @property
    def target_params(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    @property
    def accounting(self) -> Accounting:
        return accounting_for(self.compat_reference)

    @property
    def draft_params(self) -> SamplingParams:
        t = self.temperature if self.draft_temperature is None else self.draft_temperature
        return SamplingParams(t, self.top_k, self.top_p)


@dataclass
class Generation:
    tokens: list[int]
    accept_lengths: list[int]          # per verify step of the arm: its tau entry (accounting.tau_entry)
    accepted: list[int]                # per verify step of the arm: drafts accepted by verification (before clipping)
    stop_reason: str                   # eos | max_new_tokens | max_model_len
    prompt_len: int
    ttft_s: float = 0.0                # prefill + first token
    drafter_prefill_s: float = 0.0     # the drafter's pass over the prompt context, reported apart
    decode_s: float = 0.0              # every step after that
    spec_steps: int = 0
    ar_steps: int = 0
    tail_steps: int = 0                # a speculative arm's plain target steps near the context limit (no tau entry)
    extra_steps: int = 0               # the accounting's steps after an EOS (the reference's; emit nothing)
    host_syncs: int = 0
    accounting: Accounting = STANDARD
    timed: bool = True                 # False when a per-step callback ran inside the timer: decode_s is no measurement
    graph_steps: int = 0               # steps replayed from a whole-step CUDA graph
    graph_captures: int = 0            # whole-step graphs captured during this generation (inside its decode_s)
    graph_note: str = ""               # why steps ran eagerly although use_graph was set ("" when none did)
    setup_captures: int = 0            # graphs captured for it before its decode clock started (a batch's, all of
    setup_capture_s: float = 0.0       # them; harness.decode.batch_loop), and their host seconds (outside decode_s)
    batch_end_s: float = 0.0           # batched: seconds from the batch's first step to this request's end (=
    #                                    decode_s in a static batch; with refills, later requests start later)
    batch_steps: int = 0               # batched: the steps its batch took, every request's included
    served_row: int | None = None      # batched: the batch's row it decoded on (with refills, a row serves several)
    refined_batched: bool = False      # batched: its refinements ran in one call for the batch (refine_batch)
    top2_gaps: list[float] | None = None  # per token: the target's top-2 logit gap (settings.record_gaps)
    top_logits: list[float] | None = None  # per token: the target's largest logit (beside top2_gaps)

    @property
    def compat_reference(self) -> bool:
        return self.accounting is REFERENCE

    @property
    def decode_tokens(self) -> int:
        """Tokens the decode timer is divided by: all but the prefill's first token (whose time is TTFT); the
        reference's accounting counts that token too."""
        return self.accounting.decode_tokens(len(self.tokens))


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
        self.gaps: torch.Tensor | None = None  # [len(out), 2] float32 (gap, top) when settings.record_gaps (top2)
        self.forced = {} if self.scripted is None else {
            w: torch.full((), min(self.scripted, w - 1), dtype=torch.long, device=out.device) for w in {1, width}}

    def step(self, speculative: bool, width: int, length: int, mark=_no_mark) -> StepOut:
        mark("begin")
        drafts, block, proposal = self.propose(speculative, length, mark)
        logits, feats = self.target.verify(block, length, want_features=speculative)
        mark("verify")
        n, nxt, first_stop = self.settle(drafts, proposal, logits, width, speculative)
        mark("accept")
        if speculative:
            self.drafter.observe(feats, n + 1)
            mark("observe")
        return StepOut(torch.stack((n, first_stop)), n, nxt, block, logits, proposal)

    def propose(self, speculative: bool, length: int, mark=_no_mark):
        """(drafts, block = [anchor] + drafts, proposal): the draft and its refinement (none on a plain step)."""
        t = self.target
        anchor = self.out.index_select(0, t.pos.view(1))
        if not speculative:
            return self.out[:0], anchor, None
        proposal = self.drafter.propose(anchor[0], t.pos, length)
        if self.sampler is not None:
            self.sampler.new_block(self.generator)
            proposal = dataclasses.replace(proposal, tokens=self.sampler.select(proposal.logits))
        mark("draft")
        prev = self.out.index_select(0, t.pos.view(1) - 1)[0]
        proposal = self.refiner.refine(proposal, RefineContext(anchor=anchor[0], prev_token=prev,
                                                               sampler=self.sampler))
        mark("refine")
        return proposal.tokens, torch.cat((anchor, proposal.tokens)), proposal

    def settle(self, drafts, proposal, logits, width: int, speculative: bool):
        """From the block's target logits [width, V]: the verdict, the emitted tokens written to the output, the
        first stop row among them (width: none) and the commit. Returns (n accepted, next token, first stop)."""
        t = self.target
        n, nxt = self._verdict(drafts, proposal, logits, width, speculative)
        idx = self.offsets[:width]
        candidates = torch.cat((drafts, nxt.view(1)))
        emitted = torch.where(idx < n, candidates, nxt)
        self.out.index_copy_(0, t.pos + 1 + idx, emitted)
        if self.gaps is not None:
            self.gaps.index_copy_(0, t.pos + 1 + idx, top2(logits))
        hits = (emitted.unsqueeze(1) == self.stops).any(1) & (idx <= n)
        first_stop = torch.where(hits.any(), hits.long().argmax(), width)
        t.commit(n + 1)
        return n, nxt, first_stop

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


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    """Per row: the largest logit minus the second largest (float32). A greedy choice is a near-tie where this is
    within the rounding of the logits' dtype."""
    return top2(logits)[..., 0]


def top2(logits: torch.Tensor) -> torch.Tensor:
    """Per row: [top-2 gap, largest logit] (float32); the largest logit's magnitude sets the rounding unit."""
    top = logits.float().topk(2, dim=-1).values
    return torch.stack((top[..., 0] - top[..., 1], top[..., 0]), dim=-1)


def gap_lists(pairs: list) -> tuple[list[float], list[float]]:
    """top2's [gap, largest] rows (as lists) -> (gaps, largest logits) at 6 significant digits, not decimals: a
    float32 near-tie's gap is a few 1e-7."""
    return ([float(f"{x[0]:.6g}") for x in pairs], [float(f"{x[1]:.6g}") for x in pairs])


def check_prompt(p: int, limit: int) -> None:
    if p == 0:
        raise UsageError("empty prompt: the chat template produced no tokens")
    if p >= limit:
        raise PromptTooLong(f"prompt has {p} tokens but --max-model-len is {limit}; raise --max-model-len "
                            "or drop the prompt")


def _check(settings: DecodeSettings, backend: Backend) -> None:
    s = settings.scripted_accept
    if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
        raise UsageError(f"--scripted-accept must be an integer >= 0, got {s!r}")
    check_use_graph(settings.use_graph, backend.kind)


class _Decode:
    """One generation's setup: checks, cache sizes, the slot's buffers and sampler, graphs and the stepper. What
    outlives the generation (graphs, persistent buffers, noise) is the DecodeState's; its request fields are
    the slot's `request`."""

    def __init__(self, target, prompt, settings: DecodeSettings, backend: Backend, drafter, refiner, generator,
                 state: DecodeState | None, slot=None, row=None):
        """slot: the state's slot this request uses (default its one slot); row: what the stepper commits to (the
        target; a batched decode's row of its batched target, harness.decode.batch_target), the target prefills."""
        p = len(prompt)
        check_prompt(p, settings.max_model_len)
        _check(settings, backend)
        m, limit = settings.max_new_tokens, settings.max_model_len
        self.target, self.drafter, self.settings, self.backend = target, drafter, settings, backend
        self.policy = settings.accounting
        state = state if state is not None else DecodeState.of(target)
        slot = slot or state.slot
        self.graphs = state.step_graphs() if settings.use_graph else None
        self.width = width = drafter.block_size if drafter is not None else 1
        refiner = refiner or _IDENTITY
        need = min(limit, p + m + width)
        if self.graphs is not None:
            need = self.graphs.capacity_for(need, settings.graph_bucket)
        target.ensure_capacity(need)
        if drafter is not None:
            drafter.ensure_capacity(need)
        target.reset()
        graphed = self.graphs is not None  # buffers a captured graph reads by address: persistent in the slot
        self.out = slot.output(target.capacity + width + 1 if graphed else p + m + width + 1, persistent=graphed)
        self.out[:p] = torch.tensor(prompt, dtype=torch.long)
        self.request = slot.begin(p, m, limit)
        self.gen = Generation(tokens=[], accept_lengths=[], accepted=[], stop_reason="", prompt_len=p,
                              accounting=self.policy)
        draft_params = settings.draft_params
        self.sampler = None
        if drafter is not None and not draft_params.greedy:
            self.sampler = slot.sampler(draft_params, settings.draft_noise, width - 1, target.vocab_size)
        self.generator, self.rng = generator, generator
        if self.graphs is not None and (self.sampler is not None or not settings.target_params.greedy):
            if self.graphs.adopt_rng(generator):
                self.rng = self.graphs.rng  # a graph reads the generator it was captured with: the state moves
            else:
                self.gen.graph_note = self.graphs.rng_unsupported
                self.graphs = None
        self.stepper = Stepper(row or target, drafter, refiner, settings, self.out,
                               slot.stop_ids(settings.stop_ids), self.sampler, self.rng)
        if settings.record_gaps:  # persistent like `out`: a captured graph writes it by address
            self.stepper.gaps = slot.gap_buffer(self.out.numel())
        self.captures0 = self.graphs.captures if self.graphs is not None else 0
        self.clock = 0.0

    def prefill(self) -> int:
        """Prefill and first token (TTFT), then the drafter's pass over the prompt; starts the decode clock."""
        t, b, p, gen = self.target, self.backend, self.gen.prompt_len, self.gen
        t0 = b.now()
        logits, feats = t.prefill(self.out[:p], want_features=self.drafter is not None)
        # self.rng: the graphs' generator once it adopted this one's state, so the steps continue after this draw
        first = sample_rows(logits, self.settings.target_params, self.rng)
        self.out[p] = first
        if self.stepper.gaps is not None:
            self.stepper.gaps[p] = top2(logits).reshape(2)
        first_id = int(first)  # host read of the prefill's token: part of TTFT, not of any step
        t1 = b.now()
        gen.ttft_s = t1 - t0
        if self.drafter is not None:
            self.drafter.begin(feats)
            t2 = b.now()
            gen.drafter_prefill_s, t1 = t2 - t1, t2
        self.clock = t1
        return first_id

    def _first_draft_mark(self, stage: str) -> None:
        if stage == "refine":  # the reference starts its decode timer here (its drafter "prefill")
            now = self.backend.now()
            self.gen.drafter_prefill_s += now - self.clock
            self.clock = now

    def step(self, speculative: bool, w: int, pos: int, mark) -> StepOut:
        # the reference's timer starts inside the first speculative step, so that step runs eagerly
        first_draft = self.policy.timer_after_first_draft and speculative and self.gen.spec_steps == 0
        if self.graphs is not None and not first_draft:
            length = self.graphs.length(pos + w, self.settings.graph_bucket, self.target.capacity)
            if mark is not None:
                mark("begin")
            res = self.graphs.run(self.stepper, speculative, w, length)
            self.gen.graph_steps += 1
        else:
            res = self.stepper.step(speculative, w, pos + w, self._first_draft_mark if first_draft
                                    else (mark or _no_mark))
        if mark is not None:
            mark("end")
        return res

    def finish(self, produced: int, stop: str) -> Generation:
        gen = self.gen
        gen.decode_s = self.backend.now() - self.clock
        if self.graphs is not None:
            gen.graph_captures = self.graphs.captures - self.captures0
            if self.rng is not self.generator:
                self.graphs.return_rng(self.generator)
        p = gen.prompt_len
        gen.tokens = self.out[p: p + produced].tolist()
        if self.stepper.gaps is not None:  # read after the timer stopped
            gen.top2_gaps, gen.top_logits = gap_lists(self.stepper.gaps[p: p + produced].tolist())
        gen.stop_reason = stop
        return gen


def _trace(on_step, res: StepOut, **fields) -> None:
    if on_step is not None:
        on_step({"block": res.block, "logits": res.logits, "proposal": res.proposal, "next_token": res.next_token,
                 **fields})


@torch.no_grad()
def generate(target, prompt: list[int], settings: DecodeSettings, backend: Backend,
             drafter: Drafter | None = None, refiner: Refiner | None = None,
             generator: torch.Generator | None = None,
             on_step: Callable[[dict], None] | None = None, mark: Callable[[str], None] | None = None,
             state: DecodeState | None = None) -> Generation:
    """Decode one prompt. How it is counted is `settings.accounting` (harness.decode.accounting), chosen once.

    `on_step`, when given, sees each step's device tensors after the step's sync (tests and traces). It runs
    inside the decode timer, so a generation given one has `timed = False`: its decode_s is not a measurement
    (harness.protocol.trace replays a timed decode untimed instead). `mark(name)`, for CUDA-event timing
    (harness.decode.timing.StageTimer), is called at "begin" and "end" of every step and, on eager steps, after
    each stage (Stepper.STAGES). `state`: the DecodeState whose graphs and buffers it uses (default: the target's,
    DecodeState.of); its slot's `request` holds the bookkeeping below."""
    run = _Decode(target, prompt, settings, backend, drafter, refiner, generator, state)
    gen, policy, width, r = run.gen, run.policy, run.width, run.request
    limit = r.max_model_len
    gen.timed = on_step is None
    first_id = run.prefill()
    r.first_token(first_id, settings.stop_ids)
    while not r.stop or r.extra:  # r.extra: the policy's step after an EOS, counted, emitting nothing
        speculative = drafter is not None and room_to_speculate(r.pos, width, limit)
        w = width if speculative else 1
        res = run.step(speculative, w, r.pos, mark)
        accepted, stop_at = res.packed.tolist()  # the one host sync per step
        position = r.pos
        emit, extra = r.advance(gen, policy, drafter is not None, speculative, w, accepted, stop_at)
        _trace(on_step, res, position=position, speculative=speculative, accepted=accepted, emitted=emit,
               produced=r.produced, stop=r.stop, extra_step=extra)
        if extra:
            break
        r.check_context()
    return run.finish(r.produced, r.stop)
