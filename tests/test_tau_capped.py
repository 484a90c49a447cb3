"""The "tau capped" label (harness/protocol/replicates.py capped_label): a run whose requests end at
--max-new-tokens on many verify steps cut to the tokens left says its tau reads low; and its neighbour for
requests cut short by the context limit (context_label)."""
from harness.protocol import replicates, report
from test_report import example


def rows(arm, method, stops, steps, cut=True):
    """Requests of `steps` verify steps of 2 accepted drafts each; one stopped at its limit has its last entry cut
    to 2 tokens (`cut`) or lands on its limit exactly (not `cut`)."""
    out = []
    for s in stops:
        lengths = [3] * steps
        if s == "max_new_tokens" and cut:
            lengths[-1] = 2
        out.append({"arm": arm, "method": method, "stop_reason": s, "accept_lengths": lengths, "accepted": [2] * steps})
    return out


def test_tau_capped_by_the_token_limit_is_labelled():
    """replicates.capped_label: from CAPPED_SHARE (5%) of a speculative arm's verify steps cut at a request's limit,
    the summary's labels say so and name the largest share; below it, where requests end at EOS, or where they land
    on their limit exactly (nothing cut, as a scripted run's or the reference accounting's), no label; AR's rows
    never count. Power: counting every limit stop (the first version) labels the exact landings; counting AR's
    steps or every row gives another share."""
    cut = rows("xPress(K=1)", "xpress", ["max_new_tokens"] * 2 + ["eos"] * 2, 5)  # 2 of 20 steps: 10%
    eos = rows("drafter-only", "drafter-only", ["eos"] * 4, 5)
    ar = rows("AR", "ar", ["max_new_tokens"] * 4, 1)
    assert replicates.capped_label(cut + eos + ar) == [
        "tau capped by --max-new-tokens: 10% of xPress(K=1)'s verify steps were a request's last, cut to the tokens "
        "its limit left (tau reads low; a larger --max-new-tokens narrows it)"]
    assert replicates.capped_label(eos + ar) == []
    assert replicates.capped_label(rows("x", "xpress", ["max_new_tokens"] * 4, 5, cut=False)) == []  # exact landings
    assert replicates.capped_label(rows("x", "xpress", ["max_new_tokens"] + ["eos"] * 4, 5)) == []  # 1 of 25: 4%


def test_the_summary_carries_the_label_from_its_measured_rows():
    ex = example()
    for r in ex:  # every request at its limit, landing on it exactly: no label
        r["stop_reason"], r["accepted"] = "max_new_tokens", [x - 1 for x in r["accept_lengths"]]
    assert not any(x.startswith("tau capped") for x in report.summarize(ex, n_boot=50)["labels"])
    for r in ex:  # the last step's entry cut below its accepted drafts + 1
        r["accepted"][-1] += 3
    assert any(x.startswith("tau capped") for x in report.summarize(ex, n_boot=50)["labels"])


def test_requests_cut_by_the_context_limit_label_the_run():
    """A --max-model-len that ends requests short of --max-new-tokens showed only in a stop-reasons note: every arm
    timed on fewer tokens than asked, the speculative ones' last steps plain target steps. From CAPPED_SHARE of the
    measured requests (all arms together) the header says so; below it, or in rows that are not measured (warmup,
    later turns), no label."""
    ex = example()
    label = lambda: [x for x in report.summarize(ex, n_boot=50)["labels"] if x.startswith("generation cut")]
    for r in ex:
        if r["warmup"] or r["turn"]:
            r["stop_reason"] = "max_model_len"
    assert label() == []
    next(r for r in ex if not r["warmup"] and r["turn"] == 0)["stop_reason"] = "max_model_len"  # 1 of 12 measured
    assert label() == ["generation cut by --max-model-len: 1 of 12 measured requests stopped at the context limit, "
                       "short of --max-new-tokens (a larger --max-model-len lets them finish)"]
    assert replicates.context_label([{"stop_reason": "max_model_len"}] + [{"stop_reason": "eos"}] * 20) == []  # 1 of 21
