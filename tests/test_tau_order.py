"""The paper's claim in tau, xPress > Markov > drafter-only, as the summary's `tau_order` (harness/protocol/
replicates.py) and the table's 'tau order' line: each step a paired tau difference with its CI over prompts, and
'shown' only when both CIs exclude equality."""
from harness.protocol import report
from harness.protocol.tables import format_markdown_table

INFO = {"AR": ("ar", None, 1), "drafter-only": ("drafter-only", None, 8), "Markov": ("markov", None, 8),
        "xPress(K=1)": ("xpress", 1, 8), "xPress(K=4)": ("xpress", 4, 8)}


def row(arm, q, rnd, accept):
    method, k, block = INFO[arm]
    return {"run_id": "t", "dataset": "toy", "question_id": q, "dataset_row": q, "turn": 0, "round": rnd,
            "warmup": rnd == 1, "arm": arm, "method": method, "K": k, "block_size": block, "temperature": 0.0,
            "prompt_tokens": 5, "new_tokens": sum(accept) + 1, "decode_tokens": sum(accept), "ttft_s": 0.01,
            "decode_s": 0.1 * len(accept), "accept_lengths": accept, "stop_reason": "eos",
            "tokens": [1] * (sum(accept) + 1)}


def rows(per_arm: dict) -> list[dict]:
    """per_arm: arm -> tau per prompt (each prompt decodes 24 tokens in steps of that length)."""
    out = []
    for rnd in (1, 2):
        for q in range(8):
            out.append(row("AR", q, rnd, [1] * 24))
            for arm, taus in per_arm.items():
                out.append(row(arm, q, rnd, [taus[q]] * (24 // taus[q])))
    return out


SPREAD = [1, 0, 1, 0, 2, 0, 1, 0]  # per-prompt offsets: the same for every arm, so the pairing matters


def test_a_clear_order_is_shown_and_a_tie_is_not():
    drafter = [2 + d for d in SPREAD]
    markov = [3 + d for d in SPREAD]
    s = report.summarize(rows({"drafter-only": drafter, "Markov": markov, "xPress(K=1)": markov,
                               "xPress(K=4)": [4 + d for d in SPREAD]}), n_boot=400)
    o = s["tau_order"]
    assert o["markov"] == "Markov" and o["drafter_only"] == "drafter-only"
    assert o["markov_vs_drafter_only"]["diff_ci95"][0] > 0
    by = {x["arm"]: x for x in o["xpress"]}
    assert by["xPress(K=4)"]["shown"] and by["xPress(K=4)"]["vs_markov"]["diff"] > 0
    assert not by["xPress(K=1)"]["shown"] and by["xPress(K=1)"]["vs_markov"]["diff"] == 0  # a tie is no order
    assert by["xPress(K=4)"]["vs_drafter_only"] == s["arms"]["xPress(K=4)"]["tau_gain"]
    assert o["optimal_xpress"] == s["optimal"]["xpress"]["arm"] == "xPress(K=4)" and o["shown"]
    line = next(x for x in format_markdown_table(s, "toy").splitlines() if "tau order" in x)
    assert "shown for xPress(K=4)" in line and "xPress(K=1) - Markov +0.000" in line


def test_markov_above_xpress_is_not_shown_and_without_markov_there_is_no_order():
    drafter = [2 + d for d in SPREAD]
    s = report.summarize(rows({"drafter-only": drafter, "Markov": [4 + d for d in SPREAD],
                               "xPress(K=4)": [3 + d for d in SPREAD]}), n_boot=400)
    assert not s["tau_order"]["shown"] and s["tau_order"]["xpress"][0]["vs_markov"]["diff_ci95"][1] < 0
    assert "NOT shown" in format_markdown_table(s, "toy")
    s = report.summarize(rows({"drafter-only": drafter, "xPress(K=4)": [3 + d for d in SPREAD]}), n_boot=400)
    assert s["tau_order"] is None and "tau order" not in format_markdown_table(s, "toy")
