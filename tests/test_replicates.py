"""Issue 27: tau at T>0 over sampling seeds (every round a replicate, warmup included), its paired CI between arms,
and the measured rounds' balance, as summarize reports them from the rows."""
import pytest

from harness.protocol import report
from harness.protocol.replicates import measured_order, replicate_rounds

INFO = {"AR": ("ar", None, 1), "drafter-only": ("drafter-only", None, 4), "xPress(K=2)": ("xpress", 2, 4)}


def row(arm, q, rnd, accept, *, warm_rounds=(1,), temperature=1.0, turn=0, slot=None):
    method, k, block = INFO[arm]
    r = {"run_id": "t", "dataset": "toy", "question_id": q, "dataset_row": q, "turn": turn, "round": rnd,
         "warmup": rnd in warm_rounds, "arm": arm, "method": method, "K": k, "block_size": block,
         "temperature": temperature, "prompt_tokens": 5, "new_tokens": sum(accept) + 1, "decode_tokens": sum(accept),
         "ttft_s": 0.01, "decode_s": 0.1 * len(accept), "accept_lengths": accept, "stop_reason": "eos",
         "tokens": [1] * (sum(accept) + 1)}
    return r if slot is None else dict(r, slot=slot)


# xPress per round (1 = warmup) and prompt q0, q1: a distinct tau per round, so pooling the wrong rounds shows
XP = {1: ([4, 4], [4, 2]), 2: ([2, 2], [2]), 3: ([3, 1], [1, 1]), 4: ([4], [2, 2])}
DO = {1: ([2, 2], [2, 2]), 2: ([1, 1], [1]), 3: ([2, 2], [1, 1]), 4: ([3], [1, 1])}


def sampled_rows(drop=None):
    rows = []
    for rnd in XP:
        for q in (0, 1):
            rows.append(row("AR", q, rnd, [1] * 3))
            rows.append(row("drafter-only", q, rnd, DO[rnd][q]))
            if (rnd, q) != drop:
                rows.append(row("xPress(K=2)", q, rnd, XP[rnd][q]))
            rows.append(row("xPress(K=2)", q, rnd, [4, 4, 4, 4], turn=1))  # later turns never count
    return rows


def pooled(lengths_per_prompt):
    steps = [x for s in lengths_per_prompt for x in s]
    return sum(steps) / len(steps)


def test_tau_over_seeds_pools_every_round_warmup_included_exactly_its_rows():
    """Guards: at T>0 tau was the mean over the measured rounds only (rounds 2-4 here); the warmup round is a
    sampling replicate too, each replicate pooled over exactly its own turn-0 rows."""
    s = report.summarize(sampled_rows(), n_boot=200)
    xp = s["arms"]["xPress(K=2)"]
    assert xp["tau_rounds"] == [1, 2, 3, 4] and xp["tau_seeds"] == 4
    assert xp["tau_per_step"] == pytest.approx(sum(pooled(XP[r]) for r in XP) / 4)
    assert "(rounds 1, 2, 3, 4: warmup included: round 1, each" in xp["tau_source"]
    assert "FEWER THAN 5 SEEDS (4" in xp["tau_source"]
    # a run without a warmup round said "warmup included" all the same
    cold = report.summarize([{**r, "warmup": False} for r in sampled_rows()], n_boot=200)["arms"]["xPress(K=2)"]
    assert "(rounds 1, 2, 3, 4: no warmup round among them, each" in cold["tau_source"]
    assert "tau over 4 seed(s), fewer than 5" in s["labels"]
    # timing still comes from the measured rounds only
    assert xp["rounds"] == [2, 3, 4] and len(xp["pooled_tok_s"]["values"]) == 3


def test_a_round_missing_a_prompt_is_no_replicate():
    """Guards: a replicate is a whole round; one that lost a prompt (crash, resume in progress) is left out."""
    rows = sampled_rows(drop=(3, 1))
    assert replicate_rounds(rows, "xPress(K=2)", [0, 1]) == [1, 2, 4]
    xp = report.summarize(rows, n_boot=200)["arms"]["xPress(K=2)"]
    assert xp["tau_per_step"] == pytest.approx(sum(pooled(XP[r]) for r in (1, 2, 4)) / 3)
    gain = xp["tau_gain"]
    assert gain["rounds"] == [1, 2, 4] and gain["seeds"] == 3  # paired: only the replicates both arms have


def test_tau_gain_against_drafter_only_with_a_paired_ci():
    """Guards: tau differences between arms had no CI; this one is paired over prompts x seeds."""
    s = report.summarize(sampled_rows(), n_boot=400)
    gain = s["arms"]["xPress(K=2)"]["tau_gain"]
    a = sum(pooled(XP[r]) for r in XP) / 4
    b = sum(pooled(DO[r]) for r in DO) / 4
    assert gain["ref"] == "drafter-only" and gain["prompts"] == 2 and gain["seeds"] == 4
    assert gain["diff"] == pytest.approx(a - b) and gain["ratio"] == pytest.approx(a / b)
    lo, hi = gain["ratio_ci95"]
    assert lo <= a / b <= hi and gain["diff_ci95"][0] <= a - b <= gain["diff_ci95"][1]
    assert s["arms"]["drafter-only"]["tau_gain"] is None and s["arms"]["AR"]["tau_gain"]["ref"] == "drafter-only"


def test_five_replicates_raise_no_seed_warning_and_t0_keeps_one():
    rows = sampled_rows() + [row(a, q, 5, DO[2][q]) for a in ("AR", "drafter-only", "xPress(K=2)") for q in (0, 1)]
    s = report.summarize(rows, n_boot=50)
    assert s["arms"]["xPress(K=2)"]["tau_seeds"] == 5 and "FEWER" not in s["arms"]["xPress(K=2)"]["tau_source"]
    assert not any("seed" in x for x in s["labels"])
    greedy = report.summarize([dict(r, temperature=0.0) for r in sampled_rows()], n_boot=50)
    assert greedy["arms"]["xPress(K=2)"]["tau_seeds"] == 1 and greedy["arms"]["xPress(K=2)"]["tau_rounds"] == [2]
    assert not any("seed" in x for x in greedy["labels"])


def test_summary_reports_the_design_and_labels_an_unbalanced_one():
    """Guards: 3 arms in 2 measured rounds ran unbalanced without a word in the summary or the tables."""
    arms = ["AR", "drafter-only", "xPress(K=2)"]
    order = {1: arms, 2: arms[1:] + arms[:1], 3: arms[2:] + arms[:2]}
    rows = [row(a, q, rnd, [1 if a == "AR" else 2], slot=i + 1, temperature=0.0) for rnd in (1, 2, 3)
            for i, a in enumerate(order[rnd]) for q in (0, 1)]
    s = report.summarize(rows[:12], n_boot=50)  # rounds 1 (warmup) and 2: one measured round of 3 arms
    assert s["design"]["latin_square"] is False and s["design"]["imbalance"] == 1
    assert "rotation unbalanced by 1" in s["labels"] and "unbalanced by 1" in s["design"]["note"]
    fourth = [row(a, q, 4, [1 if a == "AR" else 2], slot=i + 1, temperature=0.0) for i, a in enumerate(arms)
              for q in (0, 1)]
    s = report.summarize(rows + fourth, n_boot=50)  # rounds 2-4: one rotation, a Latin square
    assert s["design"]["latin_square"] is True and s["design"]["imbalance"] == 0 and s["design"]["note"] is None
    assert s["design"]["slots"]["AR"] == [1, 1, 1]
    assert not any("unbalanced" in x for x in s["labels"])


def test_order_from_recorded_slots_and_unknown_without_them():
    """Rows that record their slot give the order; older rows (no slot) leave the balance unknown, unlabelled."""
    rows = [row("xPress(K=2)", 0, 2, [2], slot=2), row("AR", 0, 2, [1], slot=1)]
    assert measured_order(rows, [1]) == [["AR", "xPress(K=2)"]]
    old = [{k: v for k, v in r.items() if k != "slot"} for r in rows]
    assert measured_order(old, [1]) is None
    s = report.summarize([dict(r, temperature=0.0) for r in sampled_rows()], n_boot=50)
    assert s["design"]["imbalance"] is None and "not recorded" in s["design"]["note"]
    assert not any("unbalanced" in x for x in s["labels"])


def test_a_sweep_labels_a_rotation_that_is_no_latin_square():
    """5 arms over 4 measured rounds (the H100 sweeps of 2026-12-05: --fair-k-list 1,4, 5 rounds, 1 warmup) put
    each arm in 4 of the 5 slots; a sweep's labels say so, as a single run's do; 4 arms in 4 rounds say nothing."""
    from types import SimpleNamespace

    from harness.protocol.sweep_readme import unbalanced
    five = SimpleNamespace(arm_names=["AR", "drafter-only", "Markov", "xPress(K=1)", "xPress(K=4)"], rounds=5,
                           warmup_rounds=1)
    assert unbalanced(five) == "rotation unbalanced by 1"
    assert unbalanced(SimpleNamespace(arm_names=five.arm_names[:4], rounds=5, warmup_rounds=1)) is None
    assert unbalanced(SimpleNamespace(arm_names=five.arm_names, rounds=11, warmup_rounds=1)) is None
