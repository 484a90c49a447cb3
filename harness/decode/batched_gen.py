"""Continuous batching over harness.decode.batched.BatchedLM: many prompts through a fixed number of rows.

Every row has its own committed length, output count, output limit and stop state, all device tensors that one
decode step updates in place (so the step is one CUDA graph per KV-length bucket on CUDA, replayed; eager on
CPU; attention="triton": the decode's attention is the harness's Triton kernel, each row over its own prefix, and
one graph serves every bucket). The host looks every `check_every` steps (one small read): finished rows hand
their answers back and take the next waiting prompts (a prefill of just those rows), and the bucket is chosen for
the next steps. A row's answer depends only on its own prompt (greedy; sampled draws come from one seeded
generator shared by the rows). A sampled step's top-p cut is `sampler`'s (harness.decode.sampling.pick_sampler:
the sort, or the Triton search of core.kernels.topp, which sorts nothing: the default on CUDA with Triton).

Answers are the new token ids up to and including the first stop id (keep_stop=False drops that stop), or
max_new_tokens ids, the format of training.gen.generate_batch.
"""
from __future__ import annotations

import time
from collections import deque

import torch

from core.errors import UsageError
from harness.decode.batched import BatchedLM, pick_attention
from harness.decode.sampling import DEFAULT_SAMPLER, SamplingParams, pick_sampler, sample_rows, sample_rows_cut

MAX_STOPS = 16


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class BatchedGenerator:
    """generate(prompts, ...) -> answers, `rows` at a time. Graphs, the cache and the state buffers are kept
    between calls (a call that needs a larger cache or longer answers reallocates them, and recaptures)."""

    def __init__(self, model, rows: int, dtype: torch.dtype | None = None, device=None, bucket: int = 128,
                 check_every: int = 8, use_graph: bool | None = None, prefill_tokens: int = 32768,
                 attention: str = "sdpa", refill_min: int = 1, sampler: str = DEFAULT_SAMPLER):
        if rows < 1 or bucket < 1 or check_every < 1 or not 1 <= refill_min <= rows:
            raise UsageError("batched generation: rows, bucket and check_every must be >= 1, refill_min 1..rows")
        # refill_min: free rows gathered before a refill's prefill (the eager prefill is launch-bound: fewer, larger
        # ones cost less host time, while the free rows wait; results/perf/NOTES.md, eighth session)
        self.refill_min = refill_min
        device = torch.device(device) if device is not None else model.device
        try:  # the top-p cut (harness.decode.sampling.pick_sampler), checked before the cache is allocated
            self.sampler = pick_sampler(sampler, device)
        except ValueError as e:
            raise UsageError(f"batched generation: {e}") from None
        self.use_graph = device.type == "cuda" if use_graph is None else use_graph
        if self.use_graph and device.type != "cuda":
            raise UsageError("batched generation: CUDA graphs need a CUDA device (use_graph=False elsewhere)")
        self.lm = BatchedLM(model, rows, bucket, dtype=dtype, device=device,
                            attention=pick_attention(model, attention, device))
        self.rows, self.bucket, self.check_every, self.prefill_tokens = rows, bucket, check_every, prefill_tokens
        self.device = device
        self._sample = sample_rows_cut if self.sampler == "threshold" else sample_rows
        self.gen = torch.Generator(device=device)
        self.stops = torch.full((MAX_STOPS,), -2, dtype=torch.long, device=device)
        self.answer_len = 0
        self._alloc_state(1)
        self.graphs: dict = {}
        self.pool = None
        # kv_slots_read: cache slots the decode steps' attention read (sdpa: every row over the step's bucket,
        # finished and empty rows too; triton: every row over its own prefix, an idle row's one slot);
        # kv_slots_needed: those below each busy row's own position (rows that finish between two checks counted
        # to the check's end, so this is an upper bound and read/needed a lower bound)
        self.stats = {"captures": 0, "capture_s": 0.0, "steps": 0, "prefills": 0, "prefill_rows": 0,
                      "checks": 0, "kv_slots_read": 0, "kv_slots_needed": 0}

    def _alloc_state(self, answer_len: int) -> None:
        b, dev = self.rows, self.device
        self.last = torch.zeros(b, dtype=torch.long, device=dev)     # the token each row feeds next
        self.length = torch.zeros(b, dtype=torch.long, device=dev)   # committed length = the next position
        self.count = torch.zeros(b, dtype=torch.long, device=dev)    # answer tokens so far
        self.limit = torch.ones(b, dtype=torch.long, device=dev)     # max_new_tokens of the row's prompt
        self.done = torch.ones(b, dtype=torch.bool, device=dev)      # finished (or empty) rows
        self.out = torch.zeros((b, answer_len), dtype=torch.long, device=dev)
        self.answer_len = answer_len

    def _ensure(self, capacity: int, answer_len: int) -> None:
        grown = self.lm.ensure(_round_up(capacity, self.bucket))
        if answer_len > self.answer_len:
            self._alloc_state(_round_up(answer_len, 64))
            grown = True
        if grown:
            self.graphs, self.pool = {}, None  # they read the old buffers by address

    # --- one decode step over every row (the captured unit) ----------------------------------------------------
    def _stopped(self, tokens: torch.Tensor, count: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
        return (tokens[:, None] == self.stops[None, :]).any(-1) | (count >= limit)

    def _step(self, length: int, params: SamplingParams) -> None:
        logits = self.lm.decode(self.last, self.length, length)
        nxt = self._sample(logits, params, self.gen)
        active = ~self.done
        slot = self.count.clamp(max=self.answer_len - 1).unsqueeze(1)
        self.out.scatter_(1, slot, torch.where(active, nxt, self.out.gather(1, slot)[:, 0]).unsqueeze(1))
        self.count.add_(active)
        self.length.add_(active)
        self.last.copy_(torch.where(active, nxt, self.last))
        self.done.logical_or_(active & self._stopped(nxt, self.count, self.limit))

    def _replay(self, length: int, params: SamplingParams) -> None:
        self.stats["steps"] += 1
        if not self.use_graph:
            self._step(length, params)
            return
        key = (length if self.lm.attention == "sdpa" else None, params)  # the kernel reads each row's own length
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(length, params)
        graph.replay()

    def _capture(self, length: int, params: SamplingParams):
        t0 = time.perf_counter()
        live = [self.last, self.length, self.count, self.done, self.out]
        saved = [x.clone() for x in live]
        rng = self.gen.get_state()

        def restore():  # warmup steps write K/V only at slots the next real step rewrites before reading
            for x, s in zip(live, saved):
                x.copy_(s)
            self.gen.set_state(rng)

        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(length, params)
                restore()
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(self.gen)
        with torch.cuda.graph(graph, pool=self.pool):
            self._step(length, params)
        restore()
        torch.cuda.synchronize(self.device)
        self.stats["captures"] += 1
        self.stats["capture_s"] += time.perf_counter() - t0
        return graph

    # --- prefill of some rows ----------------------------------------------------------------------------------
    def _fill(self, rows: list[int], prompts: list[list[int]], limits: list[int], params: SamplingParams) -> None:
        """Prompts into cache rows: chunks of similar lengths within the token budget; first tokens sampled."""
        order = sorted(range(len(rows)), key=lambda j: len(prompts[j]))
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and (end + 1 - start) * len(prompts[order[end]]) <= self.prefill_tokens:
                end += 1
            part = order[start:end]
            width = len(prompts[part[-1]])
            ids = torch.zeros((len(part), width), dtype=torch.long)
            for j, p in enumerate(part):
                ids[j, :len(prompts[p])] = torch.tensor(prompts[p])
            dev = self.device
            r = torch.tensor([rows[p] for p in part], device=dev)
            lens = torch.tensor([len(prompts[p]) for p in part], device=dev)
            first = self._sample(self.lm.prefill(r, ids.to(dev), lens), params, self.gen)
            self.out[r, 0] = first
            self.last[r] = first
            self.length[r] = lens
            self.count[r] = 1
            self.limit[r] = torch.tensor([limits[p] for p in part], device=dev)
            self.done[r] = self._stopped(first, self.count[r], self.limit[r])
            self.stats["prefills"] += 1
            self.stats["prefill_rows"] += len(part)
            start = end

    # --- the host loop -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens, stops: list[int], sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, keep_stop: bool = True,
                 refill: bool = True) -> list[list[int]]:
        """Answers to `prompts` (lists of ids, each >= 1 long). max_new_tokens: one int, or one per prompt.
        refill=False runs static waves of `rows` prompts (the next wave starts when the whole wave finished)."""
        n = len(prompts)
        limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(limits) != n or any(m < 1 for m in limits) or any(len(p) < 1 for p in prompts):
            raise UsageError("batched generation: every prompt needs >= 1 token and max_new_tokens >= 1")
        if sample and not (temperature >= 0 and 0 < top_p <= 1):
            raise UsageError(f"batched generation: sampling needs temperature >= 0 and 0 < top_p <= 1, got "
                             f"temperature {temperature}, top_p {top_p}")
        if len(set(stops)) > MAX_STOPS:
            raise UsageError(f"batched generation: at most {MAX_STOPS} stop ids")
        if not n:
            return []
        need = max(len(p) + m for p, m in zip(prompts, limits))
        if self.lm.max_position and need > self.lm.max_position:
            raise UsageError(f"batched generation: prompt + answer needs {need} positions, more than the model's "
                             f"{self.lm.max_position}")
        self._ensure(need, max(limits))
        self.stops.fill_(-2)
        self.stops[:len(set(stops))] = torch.tensor(sorted(set(stops)), dtype=torch.long)
        params = SamplingParams(temperature=temperature, top_p=top_p) if sample else SamplingParams()
        self.gen.manual_seed(seed)
        self.done.fill_(True)
        answers: list = [None] * n
        owner = [-1] * self.rows          # the prompt each row works on (-1: empty)
        queue = deque(range(n))
        while True:
            free = [b for b in range(self.rows) if owner[b] < 0]
            enough = len(free) >= min(self.refill_min, len(queue))
            if queue and free and ((refill and enough) or len(free) == self.rows):
                take = [queue.popleft() for _ in range(min(len(free), len(queue)))]
                with torch.profiler.record_function("xb.prefill"):
                    self._fill(free[:len(take)], [prompts[i] for i in take], [limits[i] for i in take], params)
                for b, i in zip(free, take):
                    owner[b] = i
            busy = [b for b in range(self.rows) if owner[b] >= 0]
            if not busy:
                break
            with torch.profiler.record_function("xb.check"):
                snap = torch.cat([self.done.long(), self.count, self.length]).tolist()  # the one read per check
            self.stats["checks"] += 1
            done, count = snap[:self.rows], snap[self.rows:2 * self.rows]
            finished = [b for b in busy if done[b]]
            if finished:
                outs = self.out[finished].tolist()
                for b, row in zip(finished, outs):
                    answers[owner[b]] = self._cut(row[:count[b]], stops, keep_stop)
                    owner[b] = -1
                self.length[finished] = 0  # an idle row's prefix: one slot for a kernel that reads each row's own
                continue  # refill first
            lengths = snap[2 * self.rows:]
            steps = min(self.check_every, max(limits[owner[b]] - count[b] for b in busy))
            span = min(self.lm.capacity, _round_up(max(lengths[b] for b in busy) + steps + 1, self.bucket))
            grown = len(busy) * steps * (steps - 1) // 2
            needed = steps * sum(lengths[b] + 1 for b in busy) + grown
            self.stats["kv_slots_needed"] += needed
            self.stats["kv_slots_read"] += steps * self.rows * span if self.lm.attention == "sdpa" else \
                steps * sum(lengths[b] + 1 for b in range(self.rows)) + grown  # the kernel: every row's own
            for _ in range(steps):
                self._replay(span, params)
        return answers

    @staticmethod
    def _cut(row: list[int], stops: list[int], keep_stop: bool) -> list[int]:
        if row and row[-1] in stops and not keep_stop:
            return row[:-1]
        return row


@torch.no_grad()
def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, stops: list[int], pad_id: int,
                sample: bool, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                keep_stop: bool = True) -> list[list[int]]:
    """The same answers from HF transformers `generate` in one left-padded batch (the reference engine)."""
    device = model.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kwargs = dict(do_sample=sample, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                  eos_token_id=stops or None)
    if sample:
        torch.manual_seed(seed)
        kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
    result = []
    for row in out[:, width:].tolist():
        cut = next((j for j, t in enumerate(row) if t in stops), None)
        if cut is not None:
            row = row[:cut + 1] if keep_stop else row[:cut]
        result.append(row)
    return result
