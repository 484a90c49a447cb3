"""Hidden states online (`hidden.mode=online`): the hidden stage writes only the arrow dataset (token ids, loss
masks, lengths) and every training step runs the frozen target over the batch's token ids to make the tensors the
offline files would hold. Glue around speculators 0.9.0, nothing of it copied:

* `IdsOnly` stands in for its `hs_connectors` transfer: `ArrowDataset` gets each sample's token ids and an empty
  `[T, L + 1, 0]` hidden-state tensor, so speculators' dataset, packing sampler and collate run as they are and
  carry no hidden states (the collated `hidden_states` / `verifier_last_hidden_states` are `[1, T, 0]`).
* `OnlineTaps` is a forward pre-hook on the speculators model: a batch whose hidden states are empty gets them
  from the target before the model's forward (training and validation alike).

Packing: the collate packs several sequences into one row of `total_seq_len` tokens (`document_ids` 0, 1, ... and
-1 on padding; the last sequence may be cut short). The offline stage ran the target on each sequence alone, in
right-padded batches with an attention mask; here the row is unpacked into such batches (one row per sequence,
positions from 0, no attention across sequences), run through the target's base model (no lm_head), and the
tapped rows are packed back; padding rows are zero, as in the collate's zero-filled buffer. The sequences go in
`train.target_groups` batches of similar lengths (`length_groups`), with no attention mask: padding sits only
after each row's sequence, so the causal mask alone keeps it out. One batch padded to the longest sequence makes
the target compute about 1.42 positions a packed token on lengths like the GPU run's (training/step_cost.py
`simulated_lengths`), four batches 1.10; yet on the H200 (training/bench_taps.py, random weights, bf16, compiled
layers) four batches took 108 ms a 32K-token row and one 36 ms (eager 497 and 128: the cost is per batch, not per
position; its cause is not measured), so the default is one. Without the mask one batch took 36 ms against 40 ms
with it (results/perf/bench_taps_groups/). (A packed row
with restarting position ids would give the same numbers through a dense T x T mask: O(T^2) attention per step.)
Dtypes follow the offline path: computed in the target's dtype (autocast off), rounded to `hidden.dtype` (what the
files would store), then cast to the training dtype (what the collate's buffer would hold).

Host-device syncs: the unpacking needs the sequence lengths on the host (the batches' shapes). They are read once,
with one copy of the row's document ids to the host (or none: `LengthsCollate` puts the collate's own lengths in the
batch as a list, `document_lengths`, which the trainer passes through untouched). The batches are then built and
packed back by index copies, whose indices are made on the host from the lengths and moved in one pinned,
non-blocking copy, so nothing else waits for the device. (It was six syncs a step once: `.sum()` to int,
bincount's min and max, `.tolist()`, a blocking copy of the lengths to the device, boolean-mask indexing.) Each
sequence's numbers are those of its own padded row in math; the rounding may differ from the one-batch masked
forward's (other batch shapes, the causal kernels), within the dtype's rounding (tests/test_training_online.py).

The taps cache (`train.taps_cache_gib`, 0: off): every epoch runs the target again over the same sequences, and the
loader packs them into other rows each epoch, so a cache must be per sequence. `LengthsCollate` also puts each packed
sequence's key in the batch (`document_keys`: a 16-byte BLAKE2b digest of its token ids as packed, so a sequence cut
short at the row's end has its own key); a sequence whose key is cached is copied from the cache, and the target runs
only over the others, as their own padded batches. A computed sequence is kept, in `hidden.dtype` (what the output is
rounded to anyway), until the budget is spent; nothing is evicted. A cached sequence keeps the numbers of the batch
it was first computed in (the offline files' behaviour); a recomputed one may round differently in another batch
shape, within the dtype's rounding. The cache lives as long as the train stage (every model it trains on the same
data reads it) and is not saved: a resumed stage fills it again.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch
from hs_connectors import HiddenStatesTransfer

from training.hidden import Capture
from training.store import ids_digest


class IdsOnly(HiddenStatesTransfer):
    """The token ids of sample `file_idx` of the arrow dataset at `data_path`, with no hidden states."""

    def __init__(self, data_path: str, n_taps: int, rows=None):
        self.data_path, self.n_taps, self.rows = data_path, n_taps, rows  # rows: training/rows.py, in memory
        self._data = None  # opened lazily: the loader's spawned workers get the path, not the table

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor]:
        if self.rows is not None:
            ids = self.rows.input_ids(file_idx)
            return {"token_ids": ids, "hidden_states": torch.empty(len(ids), self.n_taps + 1, 0)}
        if self._data is None:
            from datasets import load_from_disk
            self._data = load_from_disk(self.data_path)
            self._data.set_format("torch")
        ids = self._data[file_idx]["input_ids"]
        return {"token_ids": ids, "hidden_states": torch.empty(len(ids), self.n_taps + 1, 0)}

    def get_generated(self, hs_transfer_params):
        raise RuntimeError("hidden.mode=online computes hidden states in the training step; nothing is generated")

    def __getstate__(self):
        return {"data_path": self.data_path, "n_taps": self.n_taps, "rows": self.rows, "_data": None}


class OnlineTaps:
    """Forward pre-hook (`register_forward_pre_hook(..., with_kwargs=True)`) that fills empty hidden states."""

    def __init__(self, target, layer_ids: list[int], store_dtype: torch.dtype, train_dtype: torch.dtype):
        self.target = target.eval().requires_grad_(False)
        self.capture = Capture(target, layer_ids)
        self.store_dtype, self.train_dtype = store_dtype, train_dtype
        self.compile = "none"  # train.compile_target as resolved (training/train.py online_taps)
        self.groups = 1  # train.target_groups: the padded batches a packed row is run as (length_groups)
        self.cache = TapsCache(0)  # train.taps_cache_gib (training/train.py online_taps)

    @torch.no_grad()
    def compute(self, input_ids, position_ids, document_ids, lengths: list[int] | None = None,
                keys: list[bytes] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """([1, T, L*H], [1, T, H]) for one packed row, as ArrowDataset would read them from the offline files.
        `position_ids` are the collate's (each sequence from 0); the target gets them through its own padding.
        `lengths`: the packed sequences' lengths in order (the collate's), else read from `document_ids`.
        `keys`: the sequences' cache keys (the collate's `document_keys`); with the cache on, cached sequences are
        copied and only the others go through the target."""
        dev = next(self.target.parameters()).device
        if lengths is None:
            lengths = row_lengths(document_ids[0].tolist())  # the one host-device sync of a step
        if not lengths:
            raise RuntimeError("hidden.mode=online: a packed row holds no sequence (speculators' placeholder for a "
                               "batch whose samples were all dropped); the loaders run with on_missing=raise, so "
                               "report this with the dataset")
        n = sum(lengths)
        kept = self.cache.lookup(keys, lengths)  # per sequence: its cached [len, L+1, H], or None
        todo = [i for i, k in enumerate(kept) if k is None]
        hits = [k for k in kept if k is not None]
        plan, hit_pos = self._plan(lengths, dev, todo, [i for i, k in enumerate(kept) if k is not None])
        ids = input_ids[0, :n].to(dev)
        out = None
        with torch.autocast(dev.type, enabled=False), torch.profiler.record_function("xb.online_target"):
            for packed, local, rows, width in plan:
                x = ids.new_zeros(rows * width).index_copy_(0, local, ids.index_select(0, packed)).view(rows, width)
                self.target.model(input_ids=x, use_cache=False)  # right-padded rows, causal: no mask (_plan)
                full = self.capture.stacked()  # [rows, width, L+1, H]
                self.capture.store.clear()
                if out is None:
                    out = full.new_zeros((document_ids.shape[-1], *full.shape[2:]), dtype=self.store_dtype)
                out.index_copy_(0, packed, full.flatten(0, 1).index_select(0, local).to(self.store_dtype))
        if hits:
            if out is None:
                out = hits[0].new_zeros((document_ids.shape[-1], *hits[0].shape[1:]))
            out.index_copy_(0, hit_pos, torch.cat(hits))
        if keys is not None:
            self.cache.keep(keys, lengths, todo, out)
        out = out.to(self.train_dtype)
        return out[:, :-1].flatten(1)[None], out[:, -1][None]

    def _plan(self, lengths: list[int], dev, todo: list[int] | None = None, hits: list[int] = ()
              ) -> tuple[list[tuple[torch.Tensor, torch.Tensor, int, int]], torch.Tensor | None]:
        """For each group of `length_groups` over the sequences `todo` (default: all): the packed row's positions
        of its tokens, where they sit in the group's flattened [rows, width] batch (sequence r of the group in row
        r, from position 0), and rows and width; and the packed positions of the tokens of the sequences `hits`
        (the cached ones, in order), or None. Built on the host (the lengths are there) and moved in one pinned,
        non-blocking copy, so the step still waits for nothing on the device.

        No attention mask: every row holds one sequence from position 0 and padding only after it, so under the
        causal mask a real token never attends to padding; the padded positions' outputs are computed and dropped.
        Without a mask the target's SDPA runs its causal kernels (flash on CUDA) instead of the masked ones."""
        n = np.asarray(lengths, dtype=np.int64)
        starts = np.cumsum(n) - n
        todo = list(range(len(lengths))) if todo is None else todo
        parts, shapes = [], []
        for group in length_groups([lengths[i] for i in todo], self.groups):
            g = np.asarray([todo[i] for i in group], dtype=np.int64)
            gn, width = n[g], int(n[g[0]])
            within = np.arange(int(gn.sum())) - np.repeat(np.cumsum(gn) - gn, gn)  # each token's position
            parts.append(np.repeat(starts[g], gn) + within)  # in the packed row
            parts.append(np.repeat(np.arange(len(g)) * width, gn) + within)  # in the group's [rows, width]
            shapes.append((len(g), width))
        if hits:
            h = np.asarray(hits, dtype=np.int64)
            parts.append(np.concatenate([np.arange(starts[i], starts[i] + n[i]) for i in h]))
        if not parts:
            return [], None
        flat = torch.from_numpy(np.concatenate(parts))
        if dev.type == "cuda":
            flat = flat.pin_memory()
        flat = flat.to(dev, non_blocking=True)
        pieces = flat.split([len(p) for p in parts])
        plan = [(pieces[2 * i], pieces[2 * i + 1], rows, width) for i, (rows, width) in enumerate(shapes)]
        return plan, (pieces[-1] if hits else None)

    def __call__(self, module, args, kwargs):
        hs = kwargs.get("hidden_states")
        lengths = kwargs.pop("document_lengths", None)
        keys = kwargs.pop("document_keys", None)
        if hs is None or hs.shape[-1] != 0:
            return args, kwargs
        h, last = self.compute(kwargs["input_ids"], kwargs["position_ids"], kwargs["document_ids"], lengths, keys)
        return args, {**kwargs, "hidden_states": h.to(hs.device), "verifier_last_hidden_states": last.to(hs.device)}

    def close(self):
        self.capture.close()


def resolve_compile(mode: str, device_type: str) -> str:
    """train.compile_target: "layers" compiles each decoder layer of the online target (auto: on CUDA only)."""
    return ("layers" if device_type == "cuda" else "none") if mode == "auto" else mode


def compile_layers(target, backend: str = "inductor") -> int:
    """Compile the forward of each decoder layer of `target` (an HF causal LM), with dynamic shapes: the padded
    batch's rows and width change every step. The layers share one code object, so one graph serves all of them
    and every shape (tests/test_training_rows.py counts it); the Capture hooks stay outside, in the layers'
    `__call__`. What this fuses is the norms, RoPE and the gated MLP's elementwise ops, which on the H200 took most
    of the online target's 165 ms a 32K-token step (train/drafter/profile.json of the 2026-12-02 run). Returns the
    number of layers compiled."""
    layers = target.model.layers
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True, backend=backend)
    return len(layers)


def length_groups(lengths: list[int], most: int) -> list[list[int]]:
    """The packed sequences (indices into `lengths`) in at most `most` groups, each run through the target as one
    right-padded batch: sorted by length, longest first, and cut where the positions the target computes (the sum
    over groups of rows x the group's longest length) are fewest. One group is the whole row as one padded batch.
    Exact: a dynamic programme over the cuts between distinct lengths (a cut inside a run of equal lengths never
    saves a position), vectorised over the cut point; deterministic: ties keep the packed order."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if most <= 1 or len(order) <= 1:
        return [order] if order else []
    s = np.array([lengths[i] for i in order], dtype=np.int64)
    cuts_at = np.concatenate(([0], np.flatnonzero(s[1:] != s[:-1]) + 1, [len(s)]))  # where a new length starts
    m, k = len(cuts_at) - 1, min(most, len(cuts_at) - 1)
    width = s[cuts_at[:-1]]  # a group starting at cut a is as wide as the sequence there
    # best[j]: fewest positions for the sequences before cut j in the groups so far; back[g][j]: where its last
    # group starts (a cut index), -1 where fewer groups did as well
    best = np.where(np.arange(m + 1) == 0, 0, np.iinfo(np.int64).max // 4)
    back = []
    for _ in range(k):
        new, prev = best.copy(), np.full(m + 1, -1)
        for j in range(1, m + 1):
            cost = best[:j] + (cuts_at[j] - cuts_at[:j]) * width[:j]
            a = int(np.argmin(cost))
            if cost[a] < new[j]:
                new[j], prev[j] = cost[a], a
        back.append(prev)
        best = new
    groups, j = [], m
    for prev in reversed(back):
        if j == 0:
            break
        if prev[j] >= 0:
            groups.append(order[cuts_at[prev[j]]:cuts_at[j]])
            j = int(prev[j])
    return groups[::-1]


def row_lengths(doc: list[int]) -> list[int]:
    """The lengths of the sequences packed in one row of document ids (0, 1, ... in order, then -1 padding), on
    the host."""
    return [sum(1 for _ in run) for d, run in itertools.groupby(doc) if d >= 0]


class LengthsCollate:
    """speculators' collate with the packed sequences' lengths added as a list (`document_lengths`), so the
    online step reads them from the host, and their cache keys (`document_keys`, from `sequence_keys`). Picklable (the
    loader's workers are spawned)."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, batch):
        out = self.collate(batch)
        out["document_lengths"] = row_lengths(out["document_ids"][0].tolist())
        out["document_keys"] = sequence_keys(out["input_ids"][0], out["document_lengths"])
        return out


def sequence_keys(ids: torch.Tensor, lengths: list[int]) -> list[bytes]:
    """A key for each packed sequence of a row of token ids (on the host): its ids' 16-byte digest (ids_digest)."""
    flat = ids.numpy()
    ends = np.cumsum(lengths)
    return [ids_digest(flat[e - k:e], 16) for k, e in zip(lengths, ends)]


class TapsCache:
    """The online target's output per sequence key, on the target's device, up to `budget` bytes (0: off). What it
    kept and served is counted, for the box record (`record`).

    Kept sequences are copied into slabs of at most `SLAB` bytes, each one allocation, and each is a view of its
    slab: a separate small tensor per sequence (tens of thousands a run) would be placed by the caching allocator
    in the blocks the training step frees between steps, splitting the large blocks its activations reuse. A
    sequence that does not fit a slab's tail starts the next slab (the tail stays unused: at most one sequence's
    bytes a slab); the slabs' bytes count against the budget. A sequence larger than `SLAB` gets a slab of its
    own size. On CUDA a slab is made only while the device keeps `FREE_RESERVE` bytes free beside it (the
    training step's own blocks are already reserved after its first step), so a budget larger than the device
    holds stops the cache from growing (`stopped_for_memory`) instead of failing the stage out of memory.

    `reserve`: the free bytes a new slab must leave, at least FREE_RESERVE. A step's blocks are reserved only as
    large as the steps so far needed: a later step with more anchors asks for larger ones (`step_reserve`), and a
    reserve below that ran an H100 out of memory (results/perf/NOTES.md, the sixteenth session)."""

    SLAB = 2**30
    FREE_RESERVE = 4 * 2**30

    def __init__(self, budget: int, reserve: int = 0):
        self.reserve = max(int(reserve), self.FREE_RESERVE)
        self.budget, self.used, self.allocated = int(budget), 0, 0
        self.store: dict[bytes, torch.Tensor] = {}
        self.hit_tokens = self.computed_tokens = 0
        self.refused: set[bytes] = set()  # keys of sequences that did not fit (each once, whatever the epochs)
        self.stopped_for_memory = False
        self._slab, self._at = None, 0  # the slab being filled ([tokens, L+1, H]) and its next free token

    def lookup(self, keys: list[bytes] | None, lengths: list[int]) -> list[torch.Tensor | None]:
        got = [self.store.get(k) for k in keys] if self.budget and keys is not None else [None] * len(lengths)
        hit = sum(k for k, g in zip(lengths, got) if g is not None)
        self.hit_tokens += hit
        self.computed_tokens += sum(lengths) - hit
        return got

    def keep(self, keys: list[bytes], lengths: list[int], todo: list[int], out: torch.Tensor) -> None:
        """Keep the computed sequences `todo` of the packed row `out` ([T, L+1, H], in the stored dtype)."""
        if not self.budget:
            return
        starts = np.cumsum(lengths) - np.asarray(lengths)
        per_token = out[0].numel() * out.element_size()
        for i in todo:
            n = lengths[i]
            if keys[i] in self.store:
                continue
            if not self._room(n, out, per_token):
                self.refused.add(keys[i])
                continue
            s = int(starts[i])
            view = self._slab[self._at:self._at + n]
            view.copy_(out[s:s + n])
            self.store[keys[i]] = view
            self._at += n
            self.used += n * per_token

    def _room(self, n: int, like: torch.Tensor, per_token: int) -> bool:
        """Whether `n` tokens fit the slab being filled, or a new slab within the budget (then it is made)."""
        if self._slab is not None and self._at + n <= self._slab.shape[0]:
            return True
        tokens = min(max(self.SLAB, n * per_token), self.budget - self.allocated) // per_token
        if tokens < n or self.stopped_for_memory:
            return False
        free = self.free_bytes(like.device)
        if free is not None and free < tokens * per_token + self.reserve:
            self.stopped_for_memory = True
            return False
        self._slab, self._at = like.new_empty((tokens, *like.shape[1:])), 0
        self.allocated += tokens * per_token
        return True

    @staticmethod
    def step_reserve(models: list[dict], vocab: int, dtype: torch.dtype) -> int:
        """FREE_RESERVE and what a step may newly ask of the device at the most anchors any of `models` (their
        configs) takes: its loss's logits ([anchors x block, vocab] in the training dtype) and their gradient, which
        speculators 0.9.0's fused loss allocates apart in its backward (losses/fused.py: 6 GiB at 4,096 anchors x 16
        x 49,152 in bf16, the allocation that failed)."""
        worst = max((m["max_anchors"] * m["block_size"] for m in models), default=0)
        return TapsCache.FREE_RESERVE + 2 * worst * vocab * dtype.itemsize

    @staticmethod
    def free_bytes(device: torch.device) -> int | None:
        """The device's free bytes (CUDA), else None (host memory is not checked)."""
        return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None

    def record(self) -> dict | None:
        """Counts since the train stage began (the cache is shared by every model the stage trains), or None
        when off. kept_gib: the kept sequences' bytes; slabs_gib: the slabs' (what the device holds)."""
        if not self.budget:
            return None
        return {"budget_gib": round(self.budget / 2**30, 3), "reserve_gib": round(self.reserve / 2**30, 3),
                "kept_gib": round(self.used / 2**30, 3),
                "slabs_gib": round(self.allocated / 2**30, 3), "sequences": len(self.store),
                "refused_sequences": len(self.refused), "stopped_for_memory": self.stopped_for_memory,
                "hit_tokens": self.hit_tokens,
                "computed_tokens": self.computed_tokens}


def carry_lengths(loader) -> None:
    """Make `loader`'s batches carry `document_lengths` (a loader built by speculators' create_train_val_loaders)."""
    if not isinstance(loader.collate_fn, LengthsCollate):
        loader.collate_fn = LengthsCollate(loader.collate_fn)
