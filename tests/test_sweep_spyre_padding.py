"""--device spyre decodes 3 requests as 4 rows (issue 29, item 4: its compiled batch shapes are 1, 2 and 4). The
sweep adds a padding row (harness.protocol.sweep.padded_requests) that is finished from the first step: it must
ride in every forward, at 4 rows, and change nothing of the 3 real requests."""
from types import SimpleNamespace

import pytest
import torch

from drafters.dflash import DFlashDrafter
from drafters.dflash_batch import DFlashGroup
from harness.decode import batch_target
from harness.decode.batch_loop import generate_batch
from harness.decode.loop import DecodeSettings
from harness.protocol.spyre_contract import SpyrePlan
from harness.protocol.sweep import padded_requests, served_rows
from tiny import CPU32, tiny_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


def _spyre_plan(batches):
    padded = tuple(4 if b == 3 else b for b in batches)
    return SimpleNamespace(spyre=SpyrePlan(passes=1, topc=8, shortlist=8, block=16, budget=128,
                                           compile_sizes=(1, 16, 128), batch_sizes=batches, padded=padded))


def test_only_spyre_pads_and_only_three():
    assert [served_rows(SimpleNamespace(spyre=None), b) for b in (1, 2, 3, 4, 8)] == [1, 2, 3, 4, 8]
    assert [served_rows(_spyre_plan((1, 2, 3, 4)), b) for b in (1, 2, 3, 4)] == [1, 2, 4, 4]
    prompts, limits, seeds = padded_requests([[5, 6], [7], [8, 9, 10]], [11, 12, 13], 4, 20)
    assert prompts == [[5, 6], [7], [8, 9, 10], [5, 6]] and limits == [20, 20, 20, 1] and seeds == [11, 12, 13, 11]
    assert padded_requests([[5]], [1], 1, 20) == ([[5]], [20], [1])


@pytest.mark.parametrize("arm", ["ar", "drafter-only"])
def test_a_padding_row_rides_in_every_forward_and_changes_no_request(arm, monkeypatch):
    t = tiny_target("qwen3", capacity=128)
    base = tiny_drafter(t, block=4)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(8, 104, (n,), generator=g).tolist() for n in (7, 19, 3)]
    settings = DecodeSettings(max_new_tokens=12, max_model_len=512, stop_ids=())

    def drafters(b):
        return None if arm == "ar" else DFlashGroup(DFlashDrafter(base.model, t.embed, t.lm_head, CPU32), b).members

    plain = generate_batch(t, prompts, settings, CPU32, drafters=drafters(3))
    rows, real = [], batch_target.BatchTarget.verify

    def verify(self, blocks, *a, **kw):
        rows.append(blocks.shape[0])
        return real(self, blocks, *a, **kw)
    monkeypatch.setattr(batch_target.BatchTarget, "verify", verify)
    run, limits, _ = padded_requests(prompts, [0, 0, 0], 4, settings.max_new_tokens)
    padded = generate_batch(t, run, settings, CPU32, drafters=drafters(4), max_new_tokens=limits)
    assert rows and set(rows) == {4}  # every step's forward at the served shape
    for a, b in zip(plain, padded[:3]):
        assert (a.tokens, a.accepted, a.stop_reason) == (b.tokens, b.accepted, b.stop_reason)
    pad = padded[3]
    assert len(pad.tokens) == 1 and pad.stop_reason == "max_new_tokens" and pad.spec_steps == 0
    assert pad.decode_s == 0.0  # never live: it ends where the decode clock starts


def test_a_spyre_sweep_runs_three_requests_as_four_rows_and_compiles_first(tmp_path, monkeypatch):
    """The sweep's wiring, on the CPU with a Spyre plan put in (no card here): the B=3 point decodes 4 rows (its
    rows record it, its labels say so), every number stays over the 3 real requests, and the forwards are compiled
    (core.spyre.compile_for) before the first point, as a single run does."""
    import dataclasses
    import json

    import benchmark_compile_all as cli
    import core.spyre
    from harness.decode import batch_loop
    from harness.protocol import sweep
    from harness.protocol.results_io import read_folder_rows
    from tiny import write_run_fixture
    files = write_run_fixture(tmp_path / "f", [{"turns": [q]} for q in ("Add 2 and 3.", "Name a colour.",
                                                                        "Count to four.")])
    real_prepare, calls, sizes = sweep.prepare, [], []
    monkeypatch.setattr(sweep, "prepare", lambda cfg, **kw: dataclasses.replace(
        real_prepare(cfg, **kw), spyre=_spyre_plan((3,)).spyre))
    monkeypatch.setattr(core.spyre, "compile_for", lambda target, drafters=(), backend=None: calls.append(len(sizes)))
    real_generate = batch_loop.generate_batch

    def generate(target, prompts, *a, **kw):
        sizes.append(len(prompts))
        return real_generate(target, prompts, *a, **kw)
    monkeypatch.setattr(batch_loop, "generate_batch", generate)
    assert cli.main(["--model-name-or-path", str(files / "target"), "--draft-name-or-path", str(files / "drafter"),
                     "--dataset", "mini", "--data-dir", str(files / "data"), "--max-new-tokens", "5", "--device",
                     "cpu", "--fair-interleave", "--results-dir", str(tmp_path / "r"), "--run-id", "s",
                     "--batch-sizes", "3"]) == 0
    assert calls == [0] and sizes and set(sizes) == {4}
    rows = read_folder_rows(tmp_path / "r" / "s")
    assert rows and {(r["batch_size"], r["batch_rows"]) for r in rows} == {(3, 4)}
    assert {r["batch_row"] for r in rows} == {0, 1, 2}  # the padding row is no request
    summary = json.loads((tmp_path / "r" / "s" / "sweep.json").read_text())
    assert "3 requests padded to 4 (Spyre)" in json.dumps(summary)
