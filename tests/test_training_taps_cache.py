"""The online target's cache (training/online.py TapsCache, `train.taps_cache_gib`): a sequence the target has run
over once is copied from the cache in later rows, whatever row and position the loader packs it at, and the target
runs only over the sequences not kept."""
import os
import subprocess
import sys

import pytest
import torch

from tiny import tiny_hf_model

pytestmark = pytest.mark.usefixtures("one_thread")
WIDTH = 128


def _row(seqs: list[list[int]], width=WIDTH):
    """A packed row of the given sequences (token ids), as speculators' collate lays it out, with lengths and
    keys as LengthsCollate adds them."""
    from training.online import LengthsCollate
    n = sum(map(len, seqs))
    ids = torch.zeros(1, width, dtype=torch.long)
    ids[0, :n] = torch.tensor([t for s in seqs for t in s])
    doc = torch.full((1, width), -1)
    doc[0, :n] = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([len(s) for s in seqs]))
    pos = torch.zeros(1, width, dtype=torch.long)
    pos[0, :n] = torch.cat([torch.arange(len(s)) for s in seqs])
    b = LengthsCollate(lambda _: {"input_ids": ids, "document_ids": doc})([])
    return ids, pos, doc, b["document_lengths"], b["document_keys"]


def _seqs(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, 100, (k,), generator=g).tolist() for k in lengths]


class Calls:
    """The target's forwards: the [rows, width] batches it was given."""

    def __init__(self, taps):
        self.shapes = []
        self.handle = taps.target.model.register_forward_pre_hook(
            lambda m, a, kw: self.shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)


@pytest.fixture
def taps():
    from training.online import OnlineTaps, TapsCache
    t = OnlineTaps(tiny_hf_model("llama", layers=4), [1, 2], torch.bfloat16, torch.float32)
    t.cache = TapsCache(2**30)
    yield t
    t.close()


def _plain(taps, row):
    """The same row with the cache off (the reference)."""
    from training.online import TapsCache
    kept, taps.cache = taps.cache, TapsCache(0)
    try:
        return taps.compute(*row[:4], row[4])
    finally:
        taps.cache = kept


def test_a_kept_row_is_copied_bitwise_and_the_target_not_run(taps):
    """First time: the target runs as without a cache and gives bitwise the same tensors; the same row again: no
    target forward, bitwise the same. Power: a cache that served nothing would run the target the second time."""
    a = _row(_seqs(0, [17, 30, 5, 41]))
    calls = Calls(taps)
    first = taps.compute(*a)
    assert len(calls.shapes) == 1
    ref = _plain(taps, a)
    assert all(torch.equal(x, y) for x, y in zip(first, ref))
    calls.shapes.clear()
    again = taps.compute(*a)
    assert calls.shapes == []
    assert all(torch.equal(x, y) for x, y in zip(again, first))
    rec = taps.cache.record()
    assert rec["sequences"] == 4 and rec["hit_tokens"] == 93 and rec["computed_tokens"] == 93
    per_token = 3 * 64 * 2  # (2 taps + the last hidden state) x hidden 64 x bf16
    assert rec["kept_gib"] == round(93 * per_token / 2**30, 3)


def test_a_repacked_row_runs_the_target_only_on_sequences_not_kept(taps):
    """Row B holds two of row A's sequences at other positions, a new sequence of the same length as one of A's,
    and A's last sequence cut short (the row's end): the target runs over those two only (one padded batch of 2
    rows), and B's tensors equal B computed without a cache, to the stored dtype's rounding (A's sequences were
    computed in another batch shape). Power: keys by length or by position would serve the new sequence A's
    numbers, and a cut-short sequence keyed as its whole would serve 41 tokens for 20; both are far outside."""
    s = _seqs(1, [17, 30, 5, 41])
    new = _seqs(2, [17])[0]
    taps.compute(*_row(s))
    b = _row([s[1], new, s[2], s[3][:20]], width=80)
    calls = Calls(taps)
    got = taps.compute(*b)
    assert calls.shapes == [(2, 20)]  # the new 17 and the cut-short 20, padded to 20
    ref = _plain(taps, b)
    for x, y in zip(got, ref):
        scale = y.abs().max()
        assert (x - y).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * scale
    assert not torch.equal(got[0][0, 30:47], torch.zeros_like(got[0][0, 30:47]))
    assert got[0][0, 72:].abs().sum() == 0  # padding rows stay zero


def test_the_budget_bounds_what_is_kept_and_the_rest_is_computed(taps):
    """A budget of 40 tokens' worth keeps what fits (17 + 5 tokens: 30 and 41 do not fit after 17) and refuses the
    rest; the row is right either way. Power: an unbounded cache keeps all four."""
    from training.online import TapsCache
    per_token = 3 * 64 * 2
    taps.cache = TapsCache(40 * per_token)
    a = _row(_seqs(3, [17, 30, 5, 41]))
    got = taps.compute(*a)
    rec = taps.cache.record()
    assert (rec["sequences"], rec["refused_sequences"]) == (2, 2)
    assert taps.cache.used == 22 * per_token <= taps.cache.budget
    assert all(torch.equal(x, y) for x, y in zip(got, _plain(taps, a)))
    calls = Calls(taps)
    assert all(torch.equal(x, y) for x, y in zip(taps.compute(*a), got))
    assert calls.shapes == [(2, 41)]  # the two refused sequences, run again


def test_a_kept_row_makes_no_host_device_sync(taps):
    """The cache adds no sync to the step: with the lengths given, a row wholly from the cache counts none (the
    target's own forward, one sync in transformers 5.17-5.19, is not run). Power: the same row without the
    collate's lengths (the document ids read on the host) counts one."""
    from training.step_cost import StepCounter, total_syncs
    a = _row(_seqs(4, [17, 30, 5, 41]))
    taps.compute(*a)
    kw = {"input_ids": a[0], "position_ids": a[1], "document_ids": a[2], "hidden_states": torch.empty(1, WIDTH, 0),
          "document_keys": a[4]}
    counts = []
    for lengths in (a[3], None):
        counter = StepCounter()
        with counter:
            taps(None, (), {**kw, "document_lengths": lengths})
        counts.append(total_syncs(counter))
    assert counts == [0, 1]


def test_keys_are_by_content_and_the_same_in_every_process():
    """A sequence's key does not depend on its place in the row, differs for other ids or a cut-short copy, and a
    spawned loader worker (another hash seed) makes the same key. Power: Python's hash() of the bytes differs
    between processes with different PYTHONHASHSEED."""
    from training.online import sequence_keys
    s = _seqs(5, [9, 12])
    k1 = sequence_keys(torch.tensor(s[0] + s[1]), [9, 12])
    k2 = sequence_keys(torch.tensor(s[1] + s[0] + s[1][:5]), [12, 9, 5])
    assert k1 == [k2[1], k2[0]] and len(set(k1 + k2)) == 3 and all(len(k) == 16 for k in k1)
    code = ("import torch, sys; from training.online import sequence_keys; "
            f"sys.stdout.write(sequence_keys(torch.tensor({s[0]}), [9])[0].hex())")
    env = {**os.environ, "PYTHONHASHSEED": "123", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout == k1[0].hex()


def test_the_hook_drops_the_keys_online_and_offline(taps):
    a = _row(_seqs(6, [17, 30]))
    kw = {"input_ids": a[0], "position_ids": a[1], "document_ids": a[2], "hidden_states": torch.empty(1, WIDTH, 0),
          "document_lengths": a[3], "document_keys": a[4]}
    _, out = taps(None, (), kw)
    assert "document_keys" not in out and out["hidden_states"].shape == (1, WIDTH, 2 * 64)
    _, off = taps(None, (), {"hidden_states": torch.ones(1, WIDTH, 3), "document_keys": a[4]})
    assert "document_keys" not in off


@pytest.mark.parametrize("value,mode,says", [(-1, "online", "must be a number of GiB"),
                                             (True, "online", "must be a number of GiB"),
                                             (8, "offline", "needs hidden.mode=online")])
def test_config_refuses_a_bad_cache(value, mode, says):
    from training.config import UsageError, validate_steps, DEFAULTS
    import copy
    cfg = copy.deepcopy(DEFAULTS)
    cfg["train"]["taps_cache_gib"], cfg["hidden"]["mode"] = value, mode
    with pytest.raises(UsageError, match=says):
        validate_steps(cfg)
    cfg["train"]["taps_cache_gib"], cfg["hidden"]["mode"] = 8, "online"
    validate_steps(cfg)


def test_kept_sequences_are_views_of_few_slabs_and_stay_right(taps, monkeypatch):
    """With slabs of 45 tokens, four sequences of 17, 30, 5 and 41 tokens take three slabs (30 does not fit the
    first's tail, 41 not the second's), each sequence a view of its slab, and every one is served bitwise as first
    computed after all were written (a bump pointer that overlapped would overwrite one). Power: a slab per
    sequence, or clones, make four storages; an off-by-one in the pointer changes a served row."""
    from training.online import TapsCache
    per_token = 3 * 64 * 2
    monkeypatch.setattr(TapsCache, "SLAB", 45 * per_token)
    taps.cache = TapsCache(2**30)
    a = _row(_seqs(7, [17, 30, 5, 41]))
    first = taps.compute(*a)
    kept = [taps.cache.store[k] for k in a[4]]
    storages = {t.untyped_storage().data_ptr() for t in kept}
    assert len(storages) == 3 and taps.cache.allocated == 3 * 45 * per_token
    assert [t.shape[0] for t in kept] == [17, 30, 5, 41]
    calls = Calls(taps)
    assert all(torch.equal(x, y) for x, y in zip(taps.compute(*a), first)) and calls.shapes == []
    assert taps.cache.record()["slabs_gib"] == round(3 * 45 * per_token / 2**30, 3)


def test_refusals_count_sequences_once_and_a_long_sequence_gets_its_own_slab(taps, monkeypatch):
    """A refused sequence seen again (the next epoch) is one refused sequence, not two; a sequence longer than a
    slab is kept in a slab of its own size while the budget allows. Power: counting refusals, or slabs capped at
    SLAB, give 4 and a refused 41."""
    from training.online import TapsCache
    per_token = 3 * 64 * 2
    monkeypatch.setattr(TapsCache, "SLAB", 35 * per_token)
    taps.cache = TapsCache(76 * per_token)  # 17 + 5 in a 35-token slab, 41 in its own: 30 does not fit after
    a = _row(_seqs(8, [17, 5, 41, 30]))
    taps.compute(*a)
    taps.compute(*a)
    rec = taps.cache.record()
    assert (rec["sequences"], rec["refused_sequences"]) == (3, 1) and a[4][3] in taps.cache.refused
    assert taps.cache.store[a[4][2]].shape[0] == 41 and taps.cache.allocated == 76 * per_token


def test_an_empty_row_says_what_it_is(taps):
    ids, pos, doc, _, _ = _row([[5, 6]])
    with pytest.raises(RuntimeError, match="holds no sequence"):
        taps.compute(ids, pos, torch.full_like(doc, -1), [], [])


def test_the_cache_stops_growing_when_the_device_would_run_short(taps, monkeypatch):
    """A slab is made only while FREE_RESERVE stays free beside it: with the device's free bytes faked at one slab
    plus the reserve, then one byte less, the first slab is made (it keeps the 17 and the 5) and the second (for the
    30) is not; the stop is recorded and later rows still come
    out right. Power: without the check every sequence is kept."""
    from training.online import TapsCache
    per_token = 3 * 64 * 2
    monkeypatch.setattr(TapsCache, "SLAB", 30 * per_token)
    free = iter([30 * per_token + TapsCache.FREE_RESERVE, 30 * per_token + TapsCache.FREE_RESERVE - 1])
    monkeypatch.setattr(TapsCache, "free_bytes", staticmethod(lambda dev: next(free)))
    taps.cache = TapsCache(2**30)
    a = _row(_seqs(9, [17, 30, 5, 41]))
    got = taps.compute(*a)
    rec = taps.cache.record()
    assert rec["stopped_for_memory"] and rec["sequences"] == 2 and rec["slabs_gib"] == round(30 * per_token / 2**30, 3)
    assert all(torch.equal(x, y) for x, y in zip(got, _plain(taps, a)))


def test_a_reserve_above_the_default_stops_the_cache_sooner(taps, monkeypatch):
    """TapsCache(budget, reserve): a slab must leave `reserve` free, not only FREE_RESERVE. With the device's free
    bytes faked at one slab plus FREE_RESERVE (enough under the default), a cache given one more byte of reserve
    makes no slab and says it stopped; a reserve below FREE_RESERVE is raised to it. Power: the old rule (FREE_RESERVE
    alone) would make the slab and keep the sequences."""
    from training.online import TapsCache
    per_token = 3 * 64 * 2
    monkeypatch.setattr(TapsCache, "SLAB", 30 * per_token)
    monkeypatch.setattr(TapsCache, "free_bytes", staticmethod(lambda dev: 30 * per_token + TapsCache.FREE_RESERVE))
    assert TapsCache(2**30, reserve=1).reserve == TapsCache.FREE_RESERVE
    taps.cache = TapsCache(2**30, reserve=TapsCache.FREE_RESERVE + 1)
    a = _row(_seqs(9, [17, 5]))
    got = taps.compute(*a)
    rec = taps.cache.record()
    assert rec["stopped_for_memory"] and rec["sequences"] == 0 and rec["slabs_gib"] == 0
    assert rec["reserve_gib"] == round((TapsCache.FREE_RESERVE + 1) / 2**30, 3)
    assert all(torch.equal(x, y) for x, y in zip(got, _plain(taps, a)))


def test_the_step_reserve_covers_the_largest_loss_logits_and_their_gradient():
    """TapsCache.step_reserve: FREE_RESERVE plus twice the logits of the model with the most anchors x block, in the
    training dtype. The H100 case that ran out of memory: 4,096 anchors x 16 x 49,152 in bf16 is 6 GiB a buffer, so
    16 GiB in all (with a reserve of 4 GiB, 5.1 GiB were free when it failed). Power: a reserve of one buffer, the smallest model's, or
    fp32 sizes for bf16 give another number."""
    from training.online import TapsCache
    models = [{"max_anchors": 512, "block_size": 8}, {"max_anchors": 4096, "block_size": 16}]
    assert TapsCache.step_reserve(models, 49152, torch.bfloat16) == 16 * 2**30
    assert TapsCache.step_reserve(models[:1], 100, torch.float32) == TapsCache.FREE_RESERVE + 2 * 512 * 8 * 100 * 4
    assert TapsCache.step_reserve([], 100, torch.float32) == TapsCache.FREE_RESERVE
