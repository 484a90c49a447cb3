"""The online step's unpacking (training/online.py OnlineTaps) without host-device syncs, and the op counter that
measures them (training/step_cost.py)."""
import pytest
import torch

from tiny import tiny_hf_model

pytestmark = pytest.mark.usefixtures("one_thread")
WIDTH = 96
LENGTHS = [17, 30, 5, 41]  # the last one cut short by the row's end in the collate: still a sequence of its own


def _row(lengths=LENGTHS, width=WIDTH, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    ids = torch.zeros(1, width, dtype=torch.long)
    ids[0, :n] = torch.randint(8, 100, (n,), generator=g)
    doc = torch.full((1, width), -1)
    doc[0, :n] = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.zeros(1, width, dtype=torch.long)
    pos[0, :n] = torch.cat([torch.arange(k) for k in lengths])
    return ids, pos, doc


def _masked_reference(taps, input_ids, document_ids):
    """The unpacking as it was before (pad_sequence, a boolean mask, boolean-mask indexing)."""
    doc = document_ids[0]
    n = int((doc >= 0).sum())
    lengths = torch.bincount(doc[:n]).tolist()
    x = torch.nn.utils.rnn.pad_sequence(input_ids[0, :n].split(lengths), batch_first=True)
    mask = torch.arange(x.shape[1])[None] < torch.tensor(lengths)[:, None]
    taps.target.model(input_ids=x, attention_mask=mask.long(), use_cache=False)
    full = taps.capture.stacked()
    taps.capture.store.clear()
    out = full.new_zeros((doc.shape[0], *full.shape[2:]))
    out[:n] = full[mask]
    out = out.to(taps.store_dtype).to(taps.train_dtype)
    return out[:, :-1].flatten(1)[None], out[:, -1][None]


@pytest.fixture(scope="module")
def taps():
    from training.online import OnlineTaps
    t = OnlineTaps(tiny_hf_model("llama", layers=4), [1, 2], torch.bfloat16, torch.float32)
    yield t
    t.close()


def test_index_unpacking_gives_bitwise_the_masked_hidden_states(taps):
    """Guards the rewrite of OnlineTaps.compute (index copies instead of pad_sequence and boolean masks): the
    hidden states are bitwise those of the old masked version, with the lengths read from document_ids or given.
    Power: the row run as one sequence (attention across its sequences) gives other hidden states."""
    ids, pos, doc = _row()
    with torch.no_grad():
        ref = _masked_reference(taps, ids, doc)
    for lengths in (None, LENGTHS):
        got = taps.compute(ids, pos, doc, lengths)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert ref[0][0, sum(LENGTHS):].abs().max() == 0  # padding rows are zero
    n = sum(LENGTHS)
    one = torch.where(doc >= 0, 0, -1)
    naive = taps.compute(ids, torch.arange(WIDTH)[None], one, [n])
    assert torch.equal(naive[0][:, :LENGTHS[0]], ref[0][:, :LENGTHS[0]])  # the first sequence sees no other
    assert not torch.equal(naive[0], ref[0])


def test_unpacking_syncs_once_without_lengths_and_never_with_them(taps):
    """Guards the sync count of the online step's unpacking (a CUDA device waits at each): the old code made six
    (int(sum), bincount's min and max, tolist, a blocking copy, boolean indexing; five visible to the counter). Now
    one copy of the document ids to the host, none when the collate's lengths come with the batch. The target's
    own forward is counted apart: with a padding mask (the old code's) transformers makes two syncs checking it,
    without one (the online step's, training/online.py _plan) one, checking the position ids for packed sequences
    (`find_packed_sequence_indices`; transformers 5.17-5.19)."""
    from training.step_cost import StepCounter, total_syncs
    ids, pos, doc = _row()
    kwargs = {"input_ids": ids, "position_ids": pos, "document_ids": doc, "hidden_states": torch.empty(1, WIDTH, 0)}

    def syncs(fn):
        counter = StepCounter()
        with counter, torch.no_grad():
            fn()
        return total_syncs(counter)
    masked = syncs(lambda: taps.target.model(input_ids=ids[:, :4].expand(2, 4),
                                              attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])))
    plain = syncs(lambda: taps.target.model(input_ids=ids[:, :4].expand(2, 4), use_cache=False))
    taps.capture.store.clear()
    assert (masked, plain) == (2, 1)
    old = syncs(lambda: _masked_reference(taps, ids, doc)) - masked
    assert old == 5
    read = syncs(lambda: taps(None, (), dict(kwargs))) - plain
    given = syncs(lambda: taps(None, (), {**kwargs, "document_lengths": list(LENGTHS)})) - plain
    assert (read, given) == (1, 0)


def test_lengths_collate_adds_the_lengths_and_the_hook_takes_them_out(taps):
    """Guards LengthsCollate and the hook: the batch carries the collate's lengths as a list (moved by nobody),
    and the hook removes them before speculators' forward sees its kwargs."""
    from training.online import LengthsCollate
    ids, pos, doc = _row()
    collate = LengthsCollate(lambda batch: {"document_ids": doc, "input_ids": ids})
    assert collate([])["document_lengths"] == LENGTHS
    kwargs = {"input_ids": ids, "position_ids": pos, "document_ids": doc, "hidden_states": torch.empty(1, WIDTH, 0),
              "document_lengths": LENGTHS}
    _, out = taps(None, (), kwargs)
    assert "document_lengths" not in out and out["hidden_states"].shape == (1, WIDTH, 2 * 64)
    _, full = taps(None, (), {"hidden_states": torch.ones(1, WIDTH, 3), "document_lengths": LENGTHS})
    assert "document_lengths" not in full  # offline batches (hidden states present) pass, the list removed


def test_counter_counts_would_be_syncs_and_views():
    """Guards the classifier of training/step_cost.py: each data-dependent op once (bincount twice), views apart."""
    from training.step_cost import StepCounter
    counter = StepCounter()
    with counter, counter.phase("p"):
        d = torch.tensor([0, 0, 1, -1])
        int((d >= 0).sum())
        torch.bincount(d[:3])
        d[d >= 0]
        d.view(2, 2).tolist()
        torch.repeat_interleave(torch.arange(2), torch.tensor([1, 2]))
        torch.repeat_interleave(torch.arange(2), torch.tensor([1, 2]), output_size=3)
    t = counter.table()["p"]
    assert t["sync_ops"] == {"_local_scalar_dense": 1, "bincount": 2, "index": 1, "Tensor.tolist": 1,
                             "repeat_interleave": 1}
    assert t["aten_ops"] - t["kernel_ops"] >= 2  # d[:3] and view


def test_bad_sizes_are_one_line_before_anything_builds(capsys, tmp_path):
    from training.step_cost import main
    out = tmp_path / "never.json"
    assert main(["--total-seq-len", "0", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --total-seq-len and --max-anchors must be >= 1 (got 0 and 128)"] and not out.exists()
