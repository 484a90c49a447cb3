"""A sweep's folder text on hand-made rows and summaries: harness.protocol.sweep_steps (a batch's steps, its slot
use and the refill bound, the prefills' share of a batch's time and the speedup they leave), the crossover lines,
and what an interrupted sweep says (the sweep's own runs: tests/test_sweep.py)."""
import json

from harness.protocol import sweep_steps


def test_tail_and_extra_steps_are_counted_once():
    """A row's tail steps (plain steps near the context limit) and extra step (after an EOS) are among its spec and
    plain steps (harness.decode.state.Request.advance): a batch of rows 5+2 and 6+0 steps ran 7 steps, not 9."""
    row = dict(round=2, batch_index=0, batch_decode_s=0.07, decode_tokens=10)
    rows = [dict(row, spec_steps=5, ar_steps=2, tail_steps=1, extra_steps=1),
            dict(row, spec_steps=6, ar_steps=0, tail_steps=0, extra_steps=0)]
    got = sweep_steps.step_stats(rows)
    assert got == {"steps": 7, "ms_per_step": 10.0, "tokens_per_step": round(20 / 7, 3), "slot_use": round(13 / 14, 4)}


def _rows(prefill_ar=0.02, prefill_x=0.02):
    base = dict(round=2, batch_index=0, context_len=0, batch_size=2, warmup=False, ar_steps=0, tail_steps=0,
                extra_steps=0)
    ar = [dict(base, arm="AR", spec_steps=8, decode_tokens=8, batch_decode_s=0.08, batch_prefill_s=prefill_ar)
          for _ in range(2)]
    spec = [dict(base, arm="X", spec_steps=2, decode_tokens=8, batch_decode_s=0.04, batch_prefill_s=prefill_x),
            dict(base, arm="X", spec_steps=4, decode_tokens=8, batch_decode_s=0.04, batch_prefill_s=prefill_x)]
    return ar + spec


def test_slot_use_and_the_refill_bound_follow_from_the_rows_steps():
    """slot_use: the share of a batch's row-steps that held a request (a row of 2 steps in a batch of 8 leaves 6
    masked); refill_gain: token_gain at full slots (tokens/step over slot use, against AR's the same), the bound on
    what refilling freed slots could buy. Rows of equal length use every slot and bound nothing above token_gain."""
    e = {x["arm"]: x for x in sweep_steps.breakdown(_rows(), ["AR", "X"], "AR")}
    assert e["AR"]["slot_use"] == 1.0 and e["X"]["slot_use"] == 0.75  # 2 + 4 row-steps of 2 x 4
    assert e["X"]["token_gain"] == 2.0 and e["X"]["step_cost"] == 1.0  # 16 / 4 against 16 / 8, 10 ms both
    assert e["X"]["refill_gain"] == round(2.0 / 0.75, 3)
    table = sweep_steps.format_steps(list(e.values()))
    assert "| 2 | 0 | X | 4 | 10.0 | 4.0 | 1.0 | 2.0 | 2.000 | 0.75 | 2.667 | 2.667 | 0.3333 | 1.667 |" in table


def test_the_prefills_share_and_the_speedup_with_them_counted():
    """A batch's prefill seconds (batch_prefill_s, once a batch however many rows it has) against its decode
    seconds: X decodes 16 tokens in 0.04 s against AR's 0.08 s (2x), but with 0.02 s of prefill each it is
    16 / 0.06 against 16 / 0.10 (1.667x), and with AR's prefill 0.12 s it would be 16 / 0.06 against 16 / 0.20."""
    e = {x["arm"]: x for x in sweep_steps.breakdown(_rows(), ["AR", "X"], "AR")}
    assert e["AR"]["prefill_share"] == round(0.02 / 0.10, 4) and e["X"]["prefill_share"] == round(0.02 / 0.06, 4)
    assert e["X"]["with_prefill"] == round((16 / 0.06) / (16 / 0.10), 3) and "with_prefill" not in e["AR"]
    assert "tok_s_with_prefill" not in e["X"]  # a helper value, not a column
    e = {x["arm"]: x for x in sweep_steps.breakdown(_rows(prefill_ar=0.12), ["AR", "X"], "AR")}
    assert e["X"]["with_prefill"] == round((16 / 0.06) / (16 / 0.20), 3)
    old = [{k: v for k, v in r.items() if k != "batch_prefill_s"} for r in _rows()]  # rows before the field
    e = {x["arm"]: x for x in sweep_steps.breakdown(old, ["AR", "X"], "AR")}
    assert "prefill_share" not in e["X"] and "with_prefill" not in e["X"]
    assert "| 0.75 | 2.667 | 2.667 | - | - |" in sweep_steps.format_steps(list(e.values()))


def _summary(ci_b2):
    """Two batch sizes, two contexts, one arm: at context 0 it falls below AR at B = 2 (CI ci_b2), at context 64
    from B = 1; at B = 1 it falls below at context 64."""
    from harness.protocol.sweep import crossover
    pts = [{"batch_size": b, "context_len": c, "arms": {"AR": {}, "X": {"speedup": s, "speedup_ci": ci}}}
           for b, c, s, ci in ((1, 0, 1.3, [1.1, 1.5]), (2, 0, 0.95, ci_b2), (1, 64, 0.8, [0.7, 0.9]),
                               (2, 64, 0.7, [0.6, 0.8]))]
    summary = {"points": pts, "batch_sizes": [1, 2], "context_lengths": [0, 64]}
    return json.loads(json.dumps({**summary, "crossover": crossover(pts, ["AR", "X"], "AR", [1, 2], [0, 64])}))


def test_the_crossover_lines_cover_both_axes_and_say_when_the_ci_holds_1():
    """sweep.md printed the crossover by batch size only, though sweep.json has it by context too, and called a
    point below AR whose CI reached above 1 a crossing without a word (a new user read B = 1 at 0.84 [0.47, 2.06]
    as 'speculation does not pay')."""
    from harness.protocol.sweep_readme import crossover_lines
    lines = crossover_lines(_summary([0.9, 1.1]))
    assert lines == [
        "- X against AR by batch size: context 0: at or above AR below B=2, first below it at B=2 (by its point "
        "estimate; its CI [0.90, 1.10] includes 1); context 64: below AR from the smallest B swept, B=1",
        "- X against AR by context length: B=1: at or above AR below context=64, first below it at context=64; "
        "B=2: below AR from the smallest context swept, context=0 (by its point estimate; its CI [0.90, 1.10] "
        "includes 1)"]
    assert "includes 1" not in crossover_lines(_summary([0.85, 0.99]))[0]


def test_an_interrupted_sweep_says_it_cannot_be_resumed_and_which_folder_to_delete(tmp_path, monkeypatch, capsys):
    """Ctrl-C mid-sweep left config.json and part of samples.jsonl, said only "interrupted", and the same command
    was then refused (the folder holds a sweep): it now says a sweep cannot be resumed and names the folder."""
    import benchmark_compile_all as cli
    from harness.protocol import sweep
    from tiny import write_run_fixture
    files = write_run_fixture(tmp_path / "f", [{"turns": ["Add 2 and 3."]}], xpress_std=0.02, markov_std=0.02)

    def stop(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(sweep, "_decode_point", stop)
    rc = cli.main(["--model-name-or-path", str(files / "target"), "--draft-name-or-path", str(files / "drafter"),
                   "--drafter-only", "--dataset", "mini", "--data-dir", str(files / "data"), "--max-new-tokens", "4",
                   "--device", "cpu", "--fair-interleave", "--results-dir", str(tmp_path / "r"), "--run-id", "s",
                   "--batch-sizes", "1"])
    err = capsys.readouterr().err
    assert rc != 0 and f"a sweep cannot be resumed; delete {tmp_path / 'r' / 's'}" in err, err
