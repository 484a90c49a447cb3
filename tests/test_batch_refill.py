"""Continuous batching in generate_batch (`rows` < len(prompts)): each freed row takes the next waiting prompt.

CPU, fp32: five prompts of different lengths and output limits (one stops on a planted EOS) on 2 and 3 rows; every
request's tokens, accepted counts, tau entries and stop reason equal its own B=1 decode, on the batched greedy step
(AR, drafter-only, xPress, Markov over a DFlashGroup), on the per-request step (one DFlashDrafter per row), and at
T=1 with per-request generators. The prompts after the first `rows` are prefilled into freed rows while the others
wait, each exactly once and in order, and every KV bucket the refilled batch reaches is captured before the clock
(the capture stand-in of test_batch_graphs refuses a replay it did not capture). A row's drafter or KV region
carrying anything of the request before it would change the next request's drafts, and so its accepted counts."""
import dataclasses

import pytest
import torch

from drafters.dflash import DFlashDrafter
from drafters.dflash_batch import DFlashGroup
from harness.decode import batch_loop
from harness.decode.batch_loop import generate_batch
from harness.decode.loop import DecodeSettings, generate
from harness.decode.state import DecodeState
from test_batch_graphs import (BATCHED, BUDGETS, REFINERS, CaptureAhead, assert_b1, case, no_per_request_step,
                               settings)
from tiny import CPU32

pytestmark = pytest.mark.usefixtures("one_thread")
__all__ = ["case"]  # the module fixture, shared

ORDER = [2, 0, 4, 1, 3]  # the queue: the shortest prompt first, so a later refill runs below the longest's length


def _group(case, rows):
    t, base = case[0], case[1]
    return DFlashGroup(DFlashDrafter(base.model, t.embed, t.lm_head, CPU32), rows)


def _prefills(monkeypatch, t):
    calls, prefill = [], t.prefill
    monkeypatch.setattr(t, "prefill", lambda ids, **k: (calls.append(ids.tolist()), prefill(ids, **k))[1])
    return calls


def _decode(case, arm, rows, s, drafters=None, **kw):
    t, _, prompts, _, _ = case
    if drafters is None and arm != "ar":
        drafters = _group(case, rows).members
    return generate_batch(t, [prompts[i] for i in ORDER], s, CPU32, drafters=drafters, refiner=REFINERS.get(arm),
                          max_new_tokens=[BUDGETS[i] for i in ORDER], refine_batch=BATCHED.get(arm), rows=rows, **kw)


@pytest.mark.parametrize("arm", ["ar", "drafter-only", "xpress1", "markov"])
@pytest.mark.parametrize("rows", [2, 3])
def test_refilled_rows_give_each_request_its_b1_decode(case, monkeypatch, arm, rows):
    """Guards the refill on the batched step: a freed row's cache, output row, position and the group's context row
    are the next request's alone, and every prompt is prefilled once, in queue order."""
    no_per_request_step(monkeypatch)
    calls = _prefills(monkeypatch, case[0])
    gens = _decode(case, arm, rows, settings(case))
    assert calls == [case[2][i] for i in ORDER]  # (before the B=1 references below prefill too)
    assert len(gens) == len(ORDER)
    assert_b1(case, "dflash", arm, ORDER, gens, settings(case), (arm, rows))
    assert {g.stop_reason for g in gens} == {"eos", "max_new_tokens"}


def test_refilled_rows_on_the_per_request_step(case):
    """One DFlashDrafter per row (no group: each request's own Stepper drafts and observes): the row's drafter
    begins afresh for each request that takes the row."""
    t, base = case[0], case[1]
    drafters = [DFlashDrafter(base.model, t.embed, t.lm_head, CPU32) for _ in range(2)]
    gens = _decode(case, "xpress1", 2, settings(case), drafters=drafters)
    assert_b1(case, "dflash", "xpress1", ORDER, gens, settings(case), "per-request")


@pytest.mark.parametrize("arm", ["ar", "xpress1"])
def test_refilled_sampled_requests_draw_what_they_draw_alone(case, arm):
    """T=1: a request's draws come from its own generator (one per prompt, not per row), so a refilled request
    emits what it emits alone with the same seed."""
    t, _, prompts, _, _ = case
    s = settings(case, temperature=1.0)
    seeds = [11 + i for i in ORDER]
    drafters = None if arm == "ar" else _group(case, 2).members
    gens = _decode(case, arm, 2, s, drafters=drafters, generators=[CPU32.generator(x) for x in seeds])
    for i, g, seed in zip(ORDER, gens, seeds):
        one = generate(t, prompts[i], dataclasses.replace(s, max_new_tokens=BUDGETS[i]), CPU32,
                       drafter=None if arm == "ar" else DFlashDrafter(case[1].model, t.embed, t.lm_head, CPU32),
                       refiner=REFINERS.get(arm), generator=CPU32.generator(seed))
        assert (g.tokens, g.accepted) == (one.tokens, one.accepted), (arm, i)


def test_a_refilled_batch_captures_every_bucket_before_its_clock(case, monkeypatch):
    """With 8-slot buckets: refills bring shorter prompts in after longer ones, so the step's KV length also falls
    to buckets below the first step's; all of them were captured before the clock (none inside it)."""
    no_per_request_step(monkeypatch)
    graphs = {}
    monkeypatch.setattr(batch_loop, "_check", lambda s, b: None)  # use_graph on the CPU: the stand-in captures
    monkeypatch.setattr(DecodeState, "step_graphs", lambda self: graphs.setdefault(id(self), CaptureAhead()))
    s = settings(case, use_graph=True, graph_bucket=8)
    gens = _decode(case, "xpress1", 2, s)
    assert_b1(case, "dflash", "xpress1", ORDER, gens, settings(case), "graphs")
    g = graphs[id(DecodeState.batched(case[0], 2))]
    assert all(x.graph_captures == 0 and x.graph_steps > 0 for x in gens)
    assert len(set(g.replayed)) >= 3 and min(g.replayed) < max(g.replayed)


def test_a_queue_emptied_before_the_clock_still_captures_the_short_prompts_buckets(case, monkeypatch):
    """The longest prompt stops at its prefill (output limit 1), so its row takes the last waiting prompt before the
    first step and the queue is empty when the buckets are captured: the rows now hold short prompts only, whose
    buckets lie below the longest prompt's. Capturing from the longest prompt (as a batch without refills may)
    would leave those to be captured inside the decode clock; the stand-in refuses that."""
    no_per_request_step(monkeypatch)
    graphs = {}
    monkeypatch.setattr(batch_loop, "_check", lambda s, b: None)  # use_graph on the CPU: the stand-in captures
    monkeypatch.setattr(DecodeState, "step_graphs", lambda self: graphs.setdefault(id(self), CaptureAhead()))
    t, _, prompts, refs, _ = case
    order, limits = [3, 2, 0], [1, BUDGETS[2], BUDGETS[0]]  # lengths 37 (stops at its prefill), 1 and 5
    s = settings(case, use_graph=True, graph_bucket=8)
    gens = generate_batch(t, [prompts[i] for i in order], s, CPU32, drafters=_group(case, 2).members,
                          max_new_tokens=limits, rows=2)
    assert gens[0].tokens == refs[3][:1] and all(g.graph_captures == 0 for g in gens)
    assert min(graphs[id(DecodeState.batched(t, 2))].replayed) < 37


def test_refills_are_kept_out_of_every_decode_clock(case, monkeypatch):
    """A refill (the finished request's read, the next one's setup and prefill, the drafter's pass over its prompt)
    stalls every row, and is prefill, not decode: it is kept out of every request's decode_s and out of batch_end_s,
    as a static batch keeps its prefills before its clock. Each refill's prefill is made to take 1 s here; the
    decoding itself (tiny model) takes far less, so a decode_s of 1 s or more means a refill leaked into it (0.3 s
    was too close: a loaded 2-core CI machine once took 0.3 s to decode the batch)."""
    import time
    stall = 1.0
    t, prompts = case[0], case[2]
    prefill, slow = t.prefill, [prompts[i] for i in ORDER[2:]]
    monkeypatch.setattr(t, "prefill", lambda ids, **k: (time.sleep(stall) if ids.tolist() in slow else None,
                                                        prefill(ids, **k))[1])
    start = time.perf_counter()
    gens = _decode(case, "drafter-only", 2, settings(case))
    wall = time.perf_counter() - start
    assert wall >= 3 * stall and all(g.ttft_s >= stall for g in gens[2:]) and all(g.ttft_s < stall for g in gens[:2])
    assert all(0 < g.decode_s < stall and 0 < g.batch_end_s < stall for g in gens), \
        [(g.decode_s, g.batch_end_s) for g in gens]
    assert max(g.batch_end_s for g in gens) >= max(g.decode_s for g in gens)


def test_a_request_that_stops_at_its_prefill_hands_its_row_on_at_once(case):
    """Output limits of 1 (and any first token that is a stop): the request never steps, and the row takes the
    next waiting prompt before the first step, so no row idles while prompts wait; with every limit 1 the batch
    ends without a step. Default limits (none given) refill too."""
    t, _, prompts, refs, _ = case
    s = settings(case)
    limits = [1, 6, 1, 6, 6]
    gens = generate_batch(t, [prompts[i] for i in ORDER], s, CPU32, max_new_tokens=limits, rows=2)
    alone = [generate(t, prompts[i], dataclasses.replace(s, max_new_tokens=m), CPU32).tokens
             for i, m in zip(ORDER, limits)]
    assert [g.tokens for g in gens] == alone and [gens[0].decode_s, gens[2].decode_s] == [0.0, 0.0]
    steps = [len(x) - 1 for x in alone]  # AR: a step per token after the prefill's
    # row 0: requests 0 and 2 stop at their prefill, so request 3 takes it before the first step, then request 4;
    # row 1: request 1. Had row 0 idled, requests 3 and 4 would have waited for row 1
    assert gens[0].batch_steps == max(steps[1], steps[3] + steps[4]) < steps[1] + steps[3] + steps[4]
    assert [g.served_row for g in gens] == [0, 1, 0, 0, 0]  # Generation.served_row: the row each decoded on
    ones = generate_batch(t, [prompts[i] for i in ORDER], dataclasses.replace(s, max_new_tokens=1), CPU32, rows=2)
    assert [g.tokens for g in ones] == [refs[i][:1] for i in ORDER] and ones[0].batch_steps == 0
    default = generate_batch(t, [prompts[i] for i in ORDER], dataclasses.replace(s, max_new_tokens=5), CPU32,
                             rows=1)
    assert [g.tokens for g in default] == [generate(t, prompts[i], dataclasses.replace(s, max_new_tokens=5),
                                                    CPU32).tokens for i in ORDER]


def test_two_rows_freed_in_one_step_share_a_queue_that_a_prefill_stop_shortens(case):
    """Both rows free at the same step and two prompts wait, the first of which stops at its prefill: the first
    row takes both, the second row finds the queue empty and idles (it once popped an empty queue)."""
    t, _, prompts, _, _ = case
    s = settings(case)
    limits = [2, 2, 1, 4]
    gens = generate_batch(t, [prompts[i] for i in ORDER[:4]], s, CPU32, max_new_tokens=limits, rows=2)
    alone = [generate(t, prompts[i], dataclasses.replace(s, max_new_tokens=m), CPU32).tokens
             for i, m in zip(ORDER[:4], limits)]
    assert [g.tokens for g in gens] == alone and [len(x) for x in alone[:3]] == [2, 2, 1]
    assert gens[0].batch_steps == 1 + len(alone[3]) - 1 and gens[2].decode_s == 0.0
