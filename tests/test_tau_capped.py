"""The "tau capped" label (harness/protocol/replicates.py capped_label): a run whose requests end at
--max-new-tokens on many verify steps says its tau reads low."""
from harness.protocol import report
from test_report import example


def test_tau_capped_by_the_token_limit_is_labelled():
    """replicates.capped_label: a request that ends at --max-new-tokens ends on a step cut to the tokens left.
    From CAPPED_SHARE (5%) of a speculative arm's verify steps, the summary's labels say so and name the largest
    share; below it, or where requests end at EOS, no label; AR's rows never count. Power: a label counting every
    row (not only limit stops), or AR's steps, gives another share or a label where none is due."""
    from harness.protocol import replicates

    def rows(arm, method, stops, steps):
        return [{"arm": arm, "method": method, "stop_reason": s, "accept_lengths": [3] * steps} for s in stops]
    cut = rows("xPress(K=1)", "xpress", ["max_new_tokens"] * 2 + ["eos"] * 2, 5)  # 2 of 20 steps: 10%
    eos = rows("drafter-only", "drafter-only", ["eos"] * 4, 5)
    ar = rows("AR", "ar", ["max_new_tokens"] * 4, 1)
    assert replicates.capped_label(cut + eos + ar) == [
        "tau capped by --max-new-tokens: 10% of xPress(K=1)'s verify steps ended a request at its limit, each cut "
        "to the tokens left (tau reads low; a larger --max-new-tokens narrows it)"]
    assert replicates.capped_label(eos + ar) == []
    assert replicates.capped_label(rows("x", "xpress", ["max_new_tokens"] + ["eos"] * 4, 5)) == []  # 1 of 25: 4%
    ex = example()  # the summary carries it, from the measured rows
    assert not any(x.startswith("tau capped") for x in report.summarize(ex, n_boot=50)["labels"])
    for r in ex:
        r["stop_reason"] = "max_new_tokens"
    assert any(x.startswith("tau capped") for x in report.summarize(ex, n_boot=50)["labels"])
