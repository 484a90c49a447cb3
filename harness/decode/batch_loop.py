"""B requests decoding together: generate_batch(), for AR and every speculative arm, greedy and sampled (eager).

Built from the single-request loop's pieces (harness.decode.loop): each request has its own `_Decode` (checks,
its slot's output buffer, stop ids, draft sampler and `Request`, its Generation, prefill and finish) and its own
`Stepper`, whose `propose` and `settle` are the ones generate() runs; only the target's verify is shared, one
forward of B x W rows (harness.decode.batch_target.BatchTarget, each request over its own KV row). After the step
each request's host bookkeeping is `Request.advance`, the one generate() uses, so stops, budgets, the context
limit, tau entries and the accounting policy are the same code at every B.

One step: for each live request, its draft and refinement (its own drafter, which holds its context; its
sampler's noise and its generator; or, when the drafters are one DrafterGroup's members, e.g.
drafters.dflash_batch.DFlashGroup, every request's draft in one forward first and every row observed together
after the verdicts; then, for a greedy draft and a `refine_batch` (a refiners.batch.BatchRefiner of the run's
refiner, which the caller builds: harness.protocol.algorithms.batch_refiner), every drafting request's
refinement in one call); one batched verify; for
each live request, its verdict (the same exact_match / rejection call, with its own generator), output write,
stop scan, commit and the drafter's observe; then ONE host read of every request's (accepted, first stop) as one
[B, 2] tensor (`_read`).

A request that cannot take a whole block (pos + W >= its context limit) runs a plain target step, as at B=1: its
block is its anchor padded to W, and only row 0's logits are verified (width 1: the AR verdict). A finished
request is MASKED: it keeps its slot and its cache row, its anchor block still rides in the forward (its K/V land
past its committed length, in its own row, so no other request reads them), and nothing of it is proposed,
verified, committed or read. Masking rather than leaving keeps every step of a batch at the same B for every
arm, so a step's cost is always compared at the batch size asked for (the shape a CUDA graph per batch bucket
needs), and no arm gets a smaller batch because its requests ended sooner; each arm pays for its own longest
request.

Continuous batching (`rows` < len(prompts)): `rows` requests decode at once, and the prompts after them wait in
order; when a request finishes, the next waiting prompt takes its row at once (its prefill, into that row, between
two steps: the others wait for it, as a server's step would), so a row idles only once the queue is empty. Every
arm gets the same queue in the same order and the same number of rows; an arm whose requests end sooner takes its
next prompts sooner, which is what refilling buys. A request's decode clock starts after its own prefill and stops
at its finishing step. A refill (the finished request's read, the next one's setup, prefill and drafter pass)
stalls every row; its seconds are kept out of every request's decode_s and batch_end_s (prefill, as a static
batch's prefills come before its clock), so decode time is the steps' alone in both modes. A request that stops at
its prefill hands its row on at once. With `rows` = len(prompts) (the default) nothing is refilled: a static
batch.

The batched step (harness.decode.batch_step.RowsStep, kept in the DecodeState), used whenever the step is greedy
(T=0 with greedy drafts, or AR) and the drafts come from one DrafterGroup (or there are none; not under
record_gaps, not on Spyre, whose compiled path keeps the per-request step): one fixed-shape function of the
batch's persistent state (BatchTarget's pos, cache, output rows and live/spec masks; the group's cache and
context) that runs EVERY row, finished or not (its module says what it does). A finished row's pos and context do
not move; what it writes lands past its committed length, in its own row. A request near the context limit (spec
False) keeps row 0 of its block only: n = 0, its next token the target's choice after its anchor, as its plain
target step at B=1. Each request's tokens are therefore its B=1 tokens wherever the batched kernels give a row the
bits they give it at B=1 (fp32 on the CPU: tests/test_batch_graphs; the Triton kernels with
Launch(batch_invariant=True) at B x W <= 64 rows: tests/test_batch_neighbours*.py).

use_graph (CUDA): that function is captured as one CUDA graph per (arm, batch size, KV-length bucket) in the
batch's DecodeState (DecodeState.batched: one per batch size), and replayed each step, by this batch and every
later one of its size and arm (so the graph reads only the state's tensors, never the batch's own). Every bucket
a batch can reach (from its longest prompt to its longest request's end) is captured BEFORE its decode clock
starts, so no
capture runs inside decode_s (Generation.setup_captures / setup_capture_s count them, once per batch: every
generation of the batch carries the batch's count); a later batch of the same size and arm, on buffers of the
same addresses, captures nothing. A step the batched function cannot take (sampled, per-request drafters,
record_gaps) runs eagerly, and each Generation's graph_note says why.

Per-request generators (one torch.Generator per request, or None: greedy, or the default generator) make a
request's draws the ones it makes at B=1 with the same generator, in the same order: a request's sampled output
does not depend on its neighbours. Timing per request: ttft_s its own prefill (the prefills run one after
another before the first step), decode_s from the first step until the step that finished it.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from core.devices import Backend
from core.errors import UsageError
from core.protocols import Drafter, Refiner
from harness.decode.batch_checks import check_batch
from harness.decode.batch_step import RowsStep
from harness.decode.batch_target import BatchTarget
from harness.decode.capture_plan import room_to_speculate
from harness.decode.graphs import StepGraphs
from harness.decode.loop import DecodeSettings, Generation, _check, _Decode
from harness.decode.state import DecodeState


def _read(packed: torch.Tensor) -> list[list[int]]:
    """The one host read per step: every request's (accepted, first stop)."""
    return packed.tolist()


def _rows_target(state: DecodeState, target, rows: int) -> BatchTarget:
    """The state's BatchTarget for `rows` requests over `target` (made on first need, kept across batches)."""
    bt = state.rows_target
    if bt is None or bt.rows != rows or bt.target is not target:
        bt = state.rows_target = BatchTarget(target, rows)
    return bt


class _Batch:
    """One batch: each request's `_Decode` (prefilled here, or when it takes a freed row), the BatchTarget their
    rows share, and the step."""

    def __init__(self, target, prompts, settings: DecodeSettings, backend: Backend, drafters, refiner, generators,
                 state: DecodeState, limits, refine_batch=None, rows=None):
        b, self.backend = rows or len(prompts), backend
        self.batch = batch = _rows_target(state, target, b)
        self.width = width = drafters[0].block_size if drafters is not None else 1
        self.spec_arm, self.limit = drafters is not None, settings.max_model_len
        # each request's _Decode runs eagerly (its prefill and, off the batched step, its Stepper): the batch's
        # graphs are the batch's own (below)
        eager = dataclasses.replace(settings, use_graph=False)
        own = [eager if limits is None else dataclasses.replace(eager, max_new_tokens=m)
               for m in (limits or [settings.max_new_tokens] * len(prompts))]
        # drafters of one DrafterGroup (drafters.dflash_batch): every request's draft in one forward, observed
        # together; else each request's own drafter drafts and observes alone
        self.group = getattr(drafters[0], "group", None) if drafters is not None else None
        # and, for a greedy draft, the refiner batched (refine_batch): every request's refinement in one call after
        # the group's prefetch (`_refine_rows`); else each request's Stepper refines alone. A twin on other ops than
        # the refiner's (refiners.batch) from B = 2 only: one request keeps the refiner's own kernels
        self.refines = None
        if self.group is not None and refine_batch is not None and settings.draft_params.greedy and (
                b > 1 or not getattr(refine_batch, "twin", False)):
            self.refines = refine_batch
        greedy = settings.target_params.greedy and (drafters is None or settings.draft_params.greedy)
        why = ("a sampled step (each request draws from its own generator)" if not greedy else
               "per-request drafters (no DrafterGroup)" if drafters is not None and self.group is None else
               "record_gaps" if settings.record_gaps else
               "Spyre (its compiled per-request step)" if backend.kind == "spyre" else None)
        self.rows_step_on = why is None  # the batched step (`rows_step`), else each request's own Stepper
        self.graphs: StepGraphs | None = state.step_graphs() if settings.use_graph and why is None else None
        self.graph_note = f"batched steps ran eagerly under use_graph: {why}" if settings.use_graph and why else ""
        self.bucket = settings.graph_bucket
        # + width: a masked (finished) request's block still writes past its end, in its own row. Sized for every
        # prompt, the waiting ones too, so that no refill grows a cache (and moves what a graph reads)
        need = max(min(self.limit, len(p) + s.max_new_tokens + width) for p, s in zip(prompts, own)) + width
        batch.ensure_capacity(StepGraphs.capacity_for(need, self.bucket) if self.graphs is not None else need)
        target.ensure_capacity(need)  # the prefills' scratch (each _Decode's ensure is then a no-op)
        for d in drafters or ():
            d.ensure_capacity(batch.capacity)
        self.out = batch.outputs(batch.capacity + width + 1)
        # what each request's `_Decode` is made of (_start): prompt k's settings and generator, row i's drafter
        self.target, self.prompts, self.own, self.drafters = target, prompts, own, drafters
        self.given_refiner, self.generators, self.state = refiner, generators, state
        self.queue = list(range(b, len(prompts)))  # prompts waiting for a row, in order
        self.gens: list = [None] * len(prompts)
        self.paused = 0.0  # seconds of refills (finish, setup, prefill) inside the batch's clock, kept out of decode
        self.runs = [self._take(i, i) for i in range(b)]
        self.refiner = self.runs[0].stepper.refiner
        forced = None if settings.scripted_accept is None else min(settings.scripted_accept, width - 1)
        # the batched step: the state's, for this arm and shape, so that a graph one batch captures reads only
        # tensors that outlive it (harness.decode.batch_step)
        self.rows = RowsStep.of(state, batch, width, self.group, self.refiner, self.refines, forced,
                                state.slots[0].stop_ids(settings.stop_ids))
        self.idle = self.rows.idle
        self.zero = torch.zeros((), dtype=torch.long, device=backend.device)
        self.masks: tuple | None = None
        self.captures, self.capture_s, self.captures_inside = 0, 0.0, 0
        if self.graphs is not None:
            if self.group is not None:  # the group's cache too holds every bucket's slots (the bucket's length)
                self.group.ensure_capacity(batch.capacity)
            # refills may have run already (a request that stopped at its prefill handed its row on), so ask
            # whether any prompt was to wait for a row, not whether one still waits
            self._capture_ahead(prompts, own, refill=len(prompts) > b)
        self.clock = backend.now()
        for run in self.runs:
            run.start = self.clock

    def _start(self, i: int, k: int) -> _Decode:
        """Prompt k into row i: its `_Decode` on the row's slot and drafter (prefilled by the target, then copied
        into the row, as every request's prefill), its output the batch's row i."""
        slot, prompt, own = self.state.slots[i], self.prompts[k], self.own[k]
        run = _Decode(self.target, prompt, own, self.backend, None if self.drafters is None else self.drafters[i],
                      self.given_refiner, None if self.generators is None else self.generators[k], self.state,
                      slot=slot, row=self.batch.row(slot.row))
        run.request.first_token(run.prefill(), own.stop_ids)
        self.batch.load_prompt(slot.row, len(prompt))
        # the request's output is its row of the batch's: the batched step writes every row at once
        n = len(prompt) + 1
        self.out[slot.row, :n] = run.out[:n]
        run.out = run.stepper.out = self.out[slot.row]
        run.k, run.paused0, run.end, run.served_row = k, self.paused, None, slot.row
        return run

    @staticmethod
    def _done(run: _Decode) -> bool:
        return bool(run.request.stop) and not run.request.extra

    def _take(self, i: int, k: int) -> _Decode:
        """Prompt k into row i; while prompts wait, a request that stops at its prefill (its first token a stop,
        an output limit of 1) hands the row on at once, never having decoded."""
        run = self._start(i, k)
        while self._done(run) and self.queue:
            self._finish(run)
            run = self._start(i, self.queue.pop(0))
        return run

    def _finish(self, run: _Decode) -> None:
        """The request's Generation, read from its output row before the row's next request overwrites it. Its
        decode_s runs from its start to its end (0 if it never stepped) less the refills in between."""
        gen = self.gens[run.k] = run.finish(run.request.produced, run.request.stop)
        gen.served_row = run.served_row
        if run.end is None:
            gen.decode_s = gen.batch_end_s = 0.0
        else:
            end, paused = run.end
            gen.decode_s = end - run.start - (paused - run.paused0)
            gen.batch_end_s = end - self.clock - paused

    def live(self) -> list[bool]:
        """Per request: still stepping (decoding, or the accounting's extra step to come)."""
        return [not run.request.stop or run.request.extra for run in self.runs]

    def _refine_rows(self, spec: list[bool], anchors: torch.Tensor) -> dict:
        """Every speculative request's (drafts, block, proposal), as its Stepper.propose gives them for a greedy
        draft, with the refinements in one BatchRefiner call: its drafter's proposal (its row of the group's
        prefetch), refined with its anchor and the token before it."""
        rows = [i for i, s in enumerate(spec) if s]
        drafts, prev = [], []
        for i in rows:
            run, pos = self.runs[i], self.runs[i].request.pos
            drafts.append(run.drafter.propose(anchors[i], run.stepper.target.pos, pos + self.width))
            prev.append(run.out[pos - 1: pos])
        refined = self.refines.refine(drafts, anchors[rows], torch.cat(prev))
        return {i: (p.tokens, torch.cat((anchors[i: i + 1], p.tokens)), p) for i, p in zip(rows, refined)}

    def step(self, live: list[bool], spec: list[bool]) -> list[list[int]]:
        """The device work of one step for every request, then the one read."""
        width, proposed, blocks, refined = self.width, [], [], {}
        length = max(run.request.pos for run in self.runs) + width
        if self.group is not None and any(spec):
            anchors = torch.cat([run.out[run.request.pos: run.request.pos + 1] for run in self.runs])
            self.group.prefetch(anchors, self.batch.pos, length)
            if self.refines is not None:
                refined = self._refine_rows(spec, anchors)
        for i, run in enumerate(self.runs):
            r = run.request
            if i in refined:
                proposed.append(refined[i])
                block = proposed[-1][1]
            elif live[i]:
                proposed.append(run.stepper.propose(spec[i], r.pos + width))
                block = proposed[-1][1]
            else:
                proposed.append(None)
                block = run.out[r.pos: r.pos + 1]
            blocks.append(torch.cat((block, block[:1].expand(width - block.shape[0]))))
        logits, feats = self.batch.verify(torch.stack(blocks), length, want_features=any(spec))
        packed, counts = [], []
        for i, run in enumerate(self.runs):
            counts.append(self.zero)
            if not live[i]:
                packed.append(self.idle)
                continue
            w = width if spec[i] else 1
            drafts, _, proposal = proposed[i]
            n, _, first_stop = run.stepper.settle(drafts, proposal, logits[i, :w], w, spec[i])
            if spec[i] and self.group is None:
                run.drafter.observe(feats[i], n + 1)
            elif spec[i]:
                counts[-1] = n + 1
            packed.append(torch.stack((n, first_stop)))
        if self.group is not None and any(spec):
            self.group.observe(feats, torch.stack(counts))
        return _read(torch.stack(packed))

    # --- the batched step ---------------------------------------------------------------------------------------
    def _set_masks(self, live: list[bool], spec: list[bool]) -> None:
        """The host's live/spec lists into the batch's device masks, when they change (a request finished or
        reached the context limit: after a step's read, when the device is idle)."""
        if self.masks != (live, spec):
            self.batch.live.copy_(torch.tensor(live))
            self.batch.spec.copy_(torch.tensor(spec))
            self.masks = (list(live), list(spec))

    def _length(self, needed: int) -> int:
        if self.graphs is None:
            return needed
        return self.graphs.length(needed, self.bucket, self.batch.capacity)

    def _graph_args(self, length: int) -> tuple:
        rs = self.rows
        return (rs.key(length), rs.layout(), lambda: rs.run(length), rs.live(), False, (rs,))

    def _capture_ahead(self, prompts, own, refill: bool = False) -> None:
        """Capture every KV-length bucket this batch can reach before its clock starts (see the module's
        docstring): from its longest prompt's first step (refilling: its shortest prompt's, since the rows may all
        hold short prompts) to its longest request's last."""
        first = (min if refill else max)(map(len, prompts)) + self.width
        last = max(min(self.limit, len(p) + s.max_new_tokens + self.width) for p, s in zip(prompts, own)) + self.width
        lengths = sorted({self._length(x) for x in range(first, last + 1)})
        self._set_masks(*[[True] * len(self.runs)] * 2)
        g = self.graphs
        before, t0 = g.captures, g.capture_s
        for length in lengths:
            g.ensure(*self._graph_args(length))
        self.captures, self.capture_s = g.captures - before, g.capture_s - t0

    def _rows_read(self, live: list[bool], spec: list[bool]) -> list[list[int]]:
        self._set_masks(live, spec)
        length = self._length(max(run.request.pos for run in self.runs) + self.width)
        if self.graphs is None:
            return _read(self.rows.run(length))
        before = self.graphs.captures
        packed = self.graphs.replay(*self._graph_args(length))
        self.captures_inside += self.graphs.captures - before
        for run, on in zip(self.runs, live):
            run.gen.graph_steps += on
        return _read(packed)

    def decode(self) -> list[Generation]:
        steps = 0
        while any(live := self.live()):
            steps += 1
            spec = [self.spec_arm and on and room_to_speculate(run.request.pos, self.width, self.limit)
                    for on, run in zip(live, self.runs)]
            read = self._rows_read(live, spec) if self.rows_step_on else self.step(live, spec)
            freed = []
            for i, run in enumerate(self.runs):
                if not live[i]:
                    continue
                r = run.request
                _, extra = r.advance(run.gen, run.policy, self.spec_arm, spec[i], self.width if spec[i] else 1,
                                     *read[i])
                if not extra:
                    r.check_context()
                if self._done(run):
                    run.end = (self.backend.now(), self.paused)  # just after the read: the device is idle
                    freed.append(i)
            if freed and self.queue:  # refill: the next waiting prompts take the freed rows, in row order
                t0 = self.backend.now()
                taken = []
                for i in freed:  # a take may use up several prompts (those that stop at their prefill)
                    if not self.queue:
                        break
                    self._finish(self.runs[i])
                    self.runs[i] = self._take(i, self.queue.pop(0))
                    taken.append(i)
                t1 = self.backend.now()
                self.paused += t1 - t0
                for i in taken:
                    self.runs[i].start, self.runs[i].paused0 = t1, self.paused
        assert not self.queue, "a prompt was left waiting"
        for run in self.runs:
            self._finish(run)
        for gen in self.gens:
            gen.setup_captures, gen.setup_capture_s, gen.batch_steps = self.captures, self.capture_s, steps
            gen.graph_captures = self.captures_inside  # inside the clock: none unless a bucket was missed
            gen.graph_note = gen.graph_note or self.graph_note
            gen.refined_batched = self.refines is not None
        return self.gens


@torch.no_grad()
def generate_batch(target, prompts: Sequence[list[int]], settings: DecodeSettings, backend: Backend,
                   drafters: Sequence[Drafter] | None = None, refiner: Refiner | None = None,
                   generators: Sequence[torch.Generator | None] | None = None,
                   state: DecodeState | None = None,
                   max_new_tokens: Sequence[int] | None = None, refine_batch=None,
                   rows: int | None = None) -> list[Generation]:
    """Decode `prompts` together; one Generation per prompt, in order (see the module's docstring).

    rows: how many requests decode at once (default: all of them, a static batch); fewer is continuous batching,
    each freed row taking the next waiting prompt. drafters: one per row (each holds the context of the request
    on its row; they share weights), None for AR. refiner: one
    for all (a refinement keeps no state between calls). generators: one per prompt, or None. state: a
    DecodeState of >= rows slots (default: a new one); slot i serves the requests on row i. max_new_tokens: one
    output limit per prompt (default: settings.max_new_tokens for all). refine_batch: `refiner` batched
    (harness.protocol.algorithms.batch_refiner(refiner), or None: each request refines alone); used with a drafter
    group's members and greedy drafts."""
    b = check_batch(prompts, settings, drafters, generators, state, max_new_tokens, rows)
    _check(settings, backend)
    if refine_batch is not None and getattr(refine_batch, "refiner", None) is not refiner:
        raise UsageError("generate_batch: refine_batch batches another refiner than `refiner`; pass "
                         "harness.protocol.algorithms.batch_refiner(refiner), or None")
    state = state if state is not None else DecodeState.batched(target, b)
    return _Batch(target, prompts, settings, backend, drafters, refiner, generators, state, max_new_tokens,
                  refine_batch, rows).decode()
