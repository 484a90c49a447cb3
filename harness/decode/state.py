"""What a decode needs besides the target's weights: `DecodeState` (one per target and caller) and its `Slot`s.

A target (harness.decode.target) holds the weights and runs forwards: prefill / verify / commit over the KV cache
its forward writes, with `pos`, its committed length, on the device. Everything else a generation needs is here:
  - the whole-step CUDA graphs (harness.decode.graphs.StepGraphs), shared by every arm and slot of the state (one
    memory pool, one graph generator) and dropped when the target changes what a step launches (`Target.version`,
    bumped by use_ops, use_fp32_logits and fuse_projections);
  - per slot: the output buffer, the stop-id tensors, the draft samplers' frozen noise and the logit-gap buffer,
    which persist across the requests that use the slot because a captured graph reads them by address, and the
    fields of the request now in the slot (`Request`: prompt length, output and context limits, committed
    length, tokens produced, stop state).
generate() uses one slot (`DecodeState.slot`); the batched loop (harness.decode.batch_loop) holds B of them
(`DecodeState(target, slots=B).slots`), one per request in flight, each with its own buffers, noise and request
fields; a request's drafter context is its own drafter's.

The KV cache stays in the target. Its forward writes the cache layer by layer inside the ops (core.ops attention
takes the cache), its layout belongs to the target's family (StaticKV; Gemma 4's per-kind LayerKV), and the cache
and `pos` move together on commit and rollback; a state owning the cache would hand it back into every forward.
The batched target (harness.decode.batch_target.BatchTarget) holds one cache row per slot and a `pos` per row; a
Slot refers to its row by index (`Slot.row`), the way the state refers to the target: it uses it, it does not own
it.

`DecodeState.of(target)` is a target's default state (in a weak registry: it lives as long as the target and does
not keep it alive); generate() uses it unless handed another, and so do the runner's presize and capture plan.
`DecodeState.batched(target, rows)` is its default state for batches of `rows` requests (the same registry, one
per batch size): generate_batch keeps its BatchTarget there (`rows_target`), so that the batch's cache, output
rows and masks keep their addresses from one batch to the next and its step graphs (per arm and KV-length bucket)
are captured once per batch size, not once per batch.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from harness.decode.graphs import StepGraphs
from harness.decode.sampling import DraftSampler, SamplingParams


@dataclass
class Request:
    """The host-side fields of the request in a slot: the loop's bookkeeping, updated from each step's one read."""
    prompt_len: int
    max_new_tokens: int      # the output limit
    max_model_len: int       # the context limit
    pos: int                 # committed length: the anchor's index in the output buffer (target.pos, on the host)
    produced: int = 0        # tokens emitted so far (the prefill's first one included)
    stop: str = ""           # "" while decoding; then eos | max_new_tokens | max_model_len
    extra: bool = False      # the accounting's step after an EOS is still to run (it emits nothing)

    def first_token(self, token: int, stop_ids) -> None:
        """The prefill's token: produced, and the stop it may already be."""
        self.produced = 1
        self.stop = ("eos" if token in stop_ids else "max_new_tokens" if self.produced >= self.max_new_tokens
                     else "")
        self.check_context()

    def check_context(self) -> None:
        """The context-limit stop: no room left for another token."""
        if not self.stop and self.pos + 1 >= self.max_model_len:
            self.stop = "max_model_len"

    def advance(self, gen, policy, spec_arm: bool, speculative: bool, w: int, accepted: int,
                stop_at: int) -> tuple[int, bool]:
        """One step's host bookkeeping from its read (`accepted` drafts, `stop_at` the first stop row, w if none):
        this request's fields and its Generation's step lists (`gen`, harness.decode.loop.Generation; `policy` its
        Accounting). Returns (tokens emitted, whether the step was the accounting's extra one after an EOS,
        which ends the decode). The context-limit stop is the caller's next call (`check_context`)."""
        gen.host_syncs += 1
        gen.spec_steps += speculative
        gen.ar_steps += not speculative
        if self.extra:
            gen.extra_steps += 1
            gen.accept_lengths.append(accepted + 1)
            gen.accepted.append(accepted)
            self.extra = False
            return 0, True
        emit, m = accepted + 1, self.max_new_tokens
        if stop_at < w:
            emit, self.stop = stop_at + 1, "eos"
            self.extra = policy.wants_extra_step(stop_at, accepted, self.pos + accepted + 1 < self.prompt_len + m,
                                                 self.pos + accepted + 2 < self.max_model_len)
        if self.produced + emit >= m:
            if self.produced + emit > m or not self.stop:
                self.stop = "max_new_tokens"
            emit = m - self.produced
        self.produced += emit
        self.pos += accepted + 1
        if speculative or not spec_arm:
            gen.accept_lengths.append(policy.tau_entry(accepted, emit))
            gen.accepted.append(accepted)
        else:  # a speculative arm's plain target step near the context limit: not a tau = 1 entry
            gen.tail_steps += 1
        return emit, False


class Slot:
    """One request's place in a decode: persistent buffers (reused by the requests the slot serves, never
    reallocated while big enough) and the `request` now using them (`begin`)."""

    def __init__(self, device: torch.device, row: int = 0):
        self.device, self.row = device, row  # row: this slot's row of a batched target's cache (0: the only one)
        self.out: torch.Tensor | None = None    # the persistent output buffer (graphs read it by address)
        self.gaps: torch.Tensor | None = None   # per output position: (top-2 logit gap, top logit)
        self.samplers: dict = {}                # DraftSampler per configuration (DraftSampler.kept_in)
        self._stops: dict = {}
        self.request: Request | None = None

    def reserve_output(self, n: int) -> torch.Tensor:
        """The persistent output buffer, at least n long (a larger one is a new address: graphs reading the old
        one are dropped, see capture_plan.reserve_output)."""
        if self.out is None or self.out.numel() < n:
            self.out = torch.full((n,), -1, dtype=torch.long, device=self.device)
        return self.out

    def output(self, n: int, persistent: bool) -> torch.Tensor:
        """An output buffer of n tokens: the persistent one for graph steps, else a fresh one."""
        if persistent:
            return self.reserve_output(n)
        return torch.full((n,), -1, dtype=torch.long, device=self.device)

    def gap_buffer(self, n: int) -> torch.Tensor:
        if self.gaps is None or self.gaps.shape[0] < n:  # per position: (top-2 gap, largest logit)
            self.gaps = torch.zeros(n, 2, dtype=torch.float32, device=self.device)
        return self.gaps

    def stop_ids(self, ids: tuple[int, ...]) -> torch.Tensor:
        """The stop ids as one device tensor per set ([-2], matching no token, when there are none)."""
        key = tuple(sorted(ids))
        if key not in self._stops:
            self._stops[key] = torch.tensor(list(key) or [-2], dtype=torch.long, device=self.device)
        return self._stops[key]

    def sampler(self, params: SamplingParams, noise: str, slots: int, vocab: int) -> DraftSampler:
        return DraftSampler.kept_in(self.samplers, params, noise, slots, vocab, self.device)

    def begin(self, prompt_len: int, max_new_tokens: int, max_model_len: int) -> Request:
        self.request = Request(prompt_len, max_new_tokens, max_model_len, pos=prompt_len)
        return self.request


class DecodeState:
    """The decode's state for one target: its step graphs and its slots (see the module's docstring)."""

    _defaults: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _batched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, target, slots: int = 1):
        self._target = weakref.ref(target)
        self.device = target.backend.device
        self.slots = [Slot(self.device, row) for row in range(slots)]
        # the batched loop's harness.decode.batch_target.BatchTarget over these slots (set by it on first use)
        self.rows_target = None
        # its batched steps (harness.decode.batch_step.RowsStep.of), one per arm and shape, alive while a batch
        # or a step graph (whose entry keeps it) uses it: what their graphs read
        self.rows_steps: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._graphs: StepGraphs | None = None
        self._graphs_version: int | None = None  # the target's version when the graphs were made

    @classmethod
    def of(cls, target) -> "DecodeState":
        """The target's default state (created on first use)."""
        state = cls._defaults.get(target)
        if state is None:
            state = cls._defaults[target] = cls(target)
        return state

    @classmethod
    def batched(cls, target, rows: int) -> "DecodeState":
        """The target's default state for batches of `rows` requests (created on first use)."""
        states = cls._batched.setdefault(target, {})
        if rows not in states:
            states[rows] = cls(target, slots=rows)
        return states[rows]

    @property
    def target(self):
        return self._target()

    @property
    def slot(self) -> Slot:
        """The one slot of an unbatched decode."""
        return self.slots[0]

    @property
    def graphs(self) -> StepGraphs | None:
        """The step graphs, or None: before the first use_graph generation, and once the target changed what a
        step launches (they would replay the old launches)."""
        if self._graphs is not None and self._graphs_version != self.target.version:
            self._graphs = self._graphs_version = None
        return self._graphs

    def step_graphs(self) -> StepGraphs:
        """The step graphs, made on first need (one set per state: every arm shares their pool and generator)."""
        graphs = self.graphs
        if graphs is None:
            graphs = self._graphs = StepGraphs(self.device)
            self._graphs_version = self.target.version
        return graphs


def graph_stats(target) -> dict:
    """The default state's step-graph statistics (StepGraphs.stats), {} when it holds no graphs."""
    graphs = DecodeState.of(target).graphs
    return graphs.stats() if graphs is not None else {}
